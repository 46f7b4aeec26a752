"""Running the plan, in folders by stage: ``scoring`` (float64 log-probabilities of one batch: ``forward``, its
``masks`` and shared-prefix ``kvcache``), ``generation`` (``generate_until``), ``compiling`` (``compile=``:
``regional`` graphs, their ``state`` and ``agreement``, CPU ``prepack``) and ``execution`` (the executor shared by
both stages: ``claims``, ``routing``, ``groups``, ``resume``, ``calls``, ``progress``, ``record``, ``probes``). At
the top: the rules a call is planned by (``rules``), the policy that chooses them (``budget``, ``runtime``, ``fit``)
and the scoring call's orchestrator (``pipeline``)."""
