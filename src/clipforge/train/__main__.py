"""`python -m clipforge.train`: the train stage (clipforge.train.stage)."""

from clipforge.train.stage import main

raise SystemExit(main())
