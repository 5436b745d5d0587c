from clipforge.eval.stage import main

raise SystemExit(main())
