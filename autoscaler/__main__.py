"""`python -m kvgate.autoscaler`: the same as `kvgate autoscaler`."""

from kvgate.autoscaler.main import main

raise SystemExit(main())
