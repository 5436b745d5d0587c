"""Makes infra_harness (and through it infra/clipforge_infra) importable however pytest is invoked;
a real sshd on 127.0.0.1 standing for the stack's workers (`make down` checks them)."""

import sys
from pathlib import Path

import pytest

from tests.support.sshd import start_sshd

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()
