"""``python -m distperp_harness``: see :mod:`distperp_harness.commands.cli`."""

from distperp_harness.commands.cli import main

raise SystemExit(main())
