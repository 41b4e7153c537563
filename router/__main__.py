"""`python -m router`: see `router.main`."""

from kvgate.router.main import main

raise SystemExit(main())
