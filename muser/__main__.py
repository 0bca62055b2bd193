from muser.cli import main

raise SystemExit(main())
