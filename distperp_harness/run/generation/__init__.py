"""``generate_until`` as a distributed plan above a one-lane engine (``engine/``): what it needs from the loaded run
(``setup``), requests as jobs (``prompts``), the global plan of lanes (``jobs``, ``lanes``), a lane's texts from its
engine (``lane_texts``) and the orchestrator (``generate``). The plan imports the engine; the engine never imports
the plan (tests/test_layout.py)."""
