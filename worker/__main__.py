"""`python -m tidal.worker`: the same entry point as the `tidal-worker` command."""

from tidal.worker.cli import main

raise SystemExit(main())
