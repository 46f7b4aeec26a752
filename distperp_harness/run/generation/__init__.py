"""``generate_until``: what it needs from the loaded run (``setup``), requests as jobs (``requests``), the global plan
of lanes (``jobs``, ``lanes``), a lane's texts from its engine (``lane_texts``), the orchestrator (``generate``), and
one lane's decoding in three roles — the scheduler (``scheduler``: queue, row states, admission, stop rules), the KV
batch (``kv_batch``: ``DynamicCache`` edits; ``static_batch``: fixed buffers) with the prefill of joining rows
(``prefill``), and the decode step (``step``: eager or compiled) — walked by one loop (``loop``). ``engines``
chooses how a lane is decoded (slots, or ``model.generate`` batches: ``batchgen``); ``sampling`` and
``thinking`` are the per-row rules of sampled and thinking models."""
