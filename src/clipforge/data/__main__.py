"""`python -m clipforge.data`: the data stage (clipforge.data.stage)."""

from clipforge.data.stage import main

raise SystemExit(main())
