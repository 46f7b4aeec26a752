"""Running the plan: tokens routed to the ranks that compute them (``routing``), batches claimed (``claims``) and
scored in float64 (``scoring``, ``masks``, ``kvcache``) or generated (``generate``) by the pipeline (``pipeline``);
run-time rules and checks (``runtime``, ``fit``, ``compiling``), resumable batches (``resume``) and rank-0
progress (``progress``)."""
