"""`python -m clipforge.eval`: the eval stage (clipforge.eval.stage)."""

from clipforge.eval.stage import main

raise SystemExit(main())
