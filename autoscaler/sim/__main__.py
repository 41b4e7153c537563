from autoscaler.sim.cli import main

raise SystemExit(main())
