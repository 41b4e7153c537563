"""`python -m kvgate.router`: see `kvgate.router.main`."""

from kvgate.router.main import main

raise SystemExit(main())
