"""``python -m distperp_harness``: see :mod:`distperp_harness.cli`."""

from distperp_harness.cli import main

raise SystemExit(main())
