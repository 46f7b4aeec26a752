"""The ``python -m distperp_harness`` commands (``cli``: ``demo``, ``tasks-path``, ``compare``, ``sweep``), their
figures (``plots``), the tiny models of the demo and the tests (``tiny``) and the task folder (``taskdir``).

The one folder above the lm-eval face: ``sweep`` builds :class:`~distperp_harness.lm.DistPerpLM` itself."""
