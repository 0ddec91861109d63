"""``python -m cachemgr``: the same as the ``cachemgr`` console script."""

from cachemgr.cli.main import main

raise SystemExit(main())
