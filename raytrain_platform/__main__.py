from raytrain_platform.cli import main

raise SystemExit(main())
