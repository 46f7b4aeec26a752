"""One lane's decoding engine, below generation's distributed plan: the per-row rules (``sampling``, ``thinking``),
the lane's counters (``stats``), host/device transfers (``transfer``), the scheduler (``scheduler``: queue, admission,
stop rules), token choice on the device (``choose``), the KV batches (``kv_batch``: ``DynamicCache`` edits;
``static_batch``: fixed buffers) with the prefill of joining rows (``prefill``), the decode step (``step``: eager or
compiled; ``cudagraphs``: replayed), walked by one loop (``loop``); ``engines`` chooses how a lane is decoded (slots,
or ``model.generate`` batches: ``batchgen``). Nothing here imports the plan above it (tests/test_layout.py)."""
