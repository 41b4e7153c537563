from kvgate.registry.cli import main

raise SystemExit(main())
