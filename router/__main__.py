"""`python -m router`: see `router.main`."""

from router.main import main

raise SystemExit(main())
