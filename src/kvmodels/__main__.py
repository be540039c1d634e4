from kvmodels.cli import main

raise SystemExit(main())
