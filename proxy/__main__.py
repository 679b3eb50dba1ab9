"""`python -m proxy` is the same as `cachewitness`."""

from proxy.cli import main

raise SystemExit(main())
