"""Makes infra_harness (and through it infra/clipforge_infra) importable however pytest is invoked."""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
