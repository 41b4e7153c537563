from kvgate.autoscaler.sim.cli import main

raise SystemExit(main())
