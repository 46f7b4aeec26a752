"""The executor both stages share: who owns and claims which unit (``claims``, ``groups``), tokens to computers and
results back (``routing``), finished batches kept (``resume``), the executor itself (``executor``), typed call
records (``calls``), what a run records (``record``), the traffic probe (``probes``) and rank-0 output
(``progress``)."""
