from clipforge.train.stage import main

raise SystemExit(main())
