"""`python -m autoscaler`: the same as `kvgate autoscaler`."""

from autoscaler.main import main

raise SystemExit(main())
