"""The facts a run records, gathered from the stages' records (:mod:`distperp_harness.stages`) into the typed
:class:`~distperp_harness.run.execution.record.RunFacts` that ``run_record`` turns into the results' ``config``."""

from __future__ import annotations

import dataclasses

from distperp_harness.model.row_products import row_sizes_of
from distperp_harness.model.sharding import sharding_report
from distperp_harness.options import Options
from distperp_harness.run.execution.record import RunFacts
from distperp_harness.run.scoring.engine.invariance import Invariance
from distperp_harness.stages import Models, Placement, PreparedRun


def run_facts(
    options: Options,
    placement: Placement,
    models: Models,
    prepared: PreparedRun,
    load_seconds: float,
    checkpoint: dict,
) -> RunFacts:
    """The :class:`~distperp_harness.run.execution.record.RunFacts` of a run, from its stages' records."""
    model, loaded, collective = models.model, models.loaded, placement.collective
    reference = models.reference
    return RunFacts(
        options=options,
        device=placement.device,
        device_identity=placement.device_identity,
        checkpoint=checkpoint,
        model_num_parameters=sum(p.numel() for p in model.parameters()),
        model_dtype=str(next(model.parameters()).dtype),
        control_backend=collective.control_backend,
        world_size=collective.world_size,
        num_nodes=collective.num_nodes,
        max_length=loaded.max_length,
        batch_invariance={
            "asked": str(options.batch_invariant),
            "mode": prepared.invariance.name.lower(),
            "why": prepared.invariance_why,
            "small_products": sorted(row_sizes_of(model).exact) if prepared.invariance is not Invariance.OFF else None,
        },
        weight_bytes=loaded.weight_bytes,
        batching=prepared.batching,
        sharing=prepared.sharing,
        row_budget_reason=prepared.row_budget_reason,
        sharing_fallback=prepared.sharing_fallback,
        load_seconds=load_seconds,
        compiled=prepared.compiled.to_dict(),
        stats=prepared.stats,
        quantization=loaded.quant_report.to_dict() if loaded.quant_report else None,
        adapter=loaded.adapter.to_dict() if loaded.adapter else None,
        stored_quantization=loaded.stored_quantization,
        int4_products=loaded.int4_products.to_dict() if loaded.int4_products else None,
        chat=prepared.chat.to_dict(),
        resume=prepared.store.report() if prepared.store else None,
        reference=None
        if reference is None or models.comparison is None
        else {
            "source": options.reference,
            "dtype": str(next(reference.parameters()).dtype),
            "tasks": models.comparison.entries(),
            "weight_bytes": models.reference_weight_bytes,
        },
        sharding={
            **sharding_report(
                placement.shard_size, loaded.sharding, models.per_rank, collective.world_size, tp_size=placement.tp_size
            ),
            "cp_size": placement.cp.size,
        },
        traffic=prepared.traffic,
        load_memory_per_rank=[r["load_memory"] for r in models.per_rank],
        memory_estimate=dataclasses.asdict(placement.estimate) if placement.estimate else None,
        warnings=prepared.warnings,
        document_split=prepared.document_split.to_dict(),
        paths=prepared.paths,
    )
