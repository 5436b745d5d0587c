from clipforge.data.stage import main

raise SystemExit(main())
