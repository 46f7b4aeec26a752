"""What to compute, before any model runs: lm-eval requests become scoring units (``requests``), units become
fixed-size records ranks exchange (``records``), records and token sequences become rows (``rowplan``, ``rows``),
rows become world-size-independent batches assigned to ranks (``plan``). Pure: no process group, no model."""
