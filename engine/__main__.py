"""`python -m kvgate.engine ...`: the replica server, as `kvgate engine ...`."""

from kvgate.engine.server.main import main

raise SystemExit(main())
