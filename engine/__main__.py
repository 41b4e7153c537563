"""`python -m engine ...`: the replica server, as `kvgate engine ...`."""

from engine.server.main import main

raise SystemExit(main())
