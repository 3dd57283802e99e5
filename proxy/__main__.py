"""``python -m proxy`` is the same program as the ``kpx`` console script."""

from proxy.cli import main

raise SystemExit(main())
