from pyep.cli import main

raise SystemExit(main())
