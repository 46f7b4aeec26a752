"""What a run records: the model and run metadata lm-eval merges into the results JSON's ``config``."""

from __future__ import annotations

import dataclasses
from typing import Any

from distperp_harness import __version__
from distperp_harness.model.sharding import sharding_report


def bits_depend_on(batch_invariant: bool) -> list[str]:
    """What a run's per-document results depend on besides the requests: equal on these, equal bits. Not on the
    number of processes or nodes, ``shard_size`` or ``claim``; with ``batch_invariant`` not on the batch plan."""
    facts = [
        "checkpoint and computing options (the resume key: dtype, quantize, max_length, share_prefix, ...)",
        "library versions",
        "device kind (device_identity: GPU model or CPU instruction set, numerics flags)",
        "tp_size",
        "compile mode",
    ]
    if not batch_invariant:
        facts.append("batch plan (batch_size, max_batch_size, and batch_size=auto's budget from the device's memory)")
    return facts


def run_record(lm: Any) -> dict:
    """``config`` entries of a :class:`~distperp_harness.lm.DistPerpLM`: the checkpoint's identity and
    ``distperp``: options (as the run used them), device, layout, batching, sharing, calls, fingerprint, memory.

    ``options.device`` is the device the run used where the value was lm-eval's default and fell back (no CUDA);
    ``options.compile`` is ``false`` or the torch.compile mode; ``sharing`` is what loglikelihood requests use
    (rolling windows are one per row: their calls record ``share_mode: off``), its ``mode`` ``None`` when no
    loglikelihood call ran."""
    options = lm.options.to_dict()
    if lm.options.device_from_cli and str(lm._device) != lm.options.device:
        options["device"] = str(lm._device)
    options["compile"] = lm.options.compile_mode or False
    info = {
        "model_num_parameters": sum(p.numel() for p in lm._model.parameters()),
        "model_dtype": str(next(lm._model.parameters()).dtype),
        "model_revision": lm.options.revision,
        **lm.checkpoint_identity,
        "distperp": {
            "version": __version__,
            "options": options,
            "device": str(lm._device),
            "device_identity": lm.device_identity,
            "control_plane": lm.collective.control_backend,
            "world_size": lm.world_size,
            "num_nodes": lm.collective.num_nodes,
            "max_length": lm.max_length,
            "weight_bytes": lm.weight_bytes,
            "batching": {
                "batch_size": lm.batching.batch_size,
                "token_budget": lm.batching.token_budget,
                "max_batch_size": lm.batching.max_batch_size,
            },
            "batch_invariant": lm.options.batch_invariant,
            "bits_depend_on": bits_depend_on(lm.options.batch_invariant),
            "sharing": {  # a mode only where loglikelihood requests ran (the calls say what ran)
                "mode": lm.sharing.mode if any(c.kind == "loglikelihood" for c in lm.stats.calls) else None,
                "requests": "loglikelihood",
                "max_row_length": lm.sharing.max_row_length,
                "row_budget": lm.row_budget_reason,
                "fallback_reason": lm.sharing_fallback,
            },
            "load_seconds": lm.load_seconds,
            "compile": lm.compiled.to_dict(),
            "calls": lm.stats.to_dicts(),
            "fingerprint": lm.stats.fingerprint,
            "quantization": lm.quant_report.to_dict() if lm.quant_report else None,
            "adapter": lm.loaded.adapter.to_dict() if lm.loaded.adapter else None,
            "stored_quantization": lm.loaded.stored_quantization,
            "int4_products": lm.loaded.int4_products.to_dict() if lm.loaded.int4_products else None,
            "chat": lm.chat.to_dict(),
            "resume": lm.store.report() if lm.store else None,
            "reference": None
            if lm.reference is None
            else {
                "source": lm.options.reference,
                "dtype": str(next(lm.reference.parameters()).dtype),
                "tasks": lm.comparison.entries(),
                "weight_bytes": lm.reference_weight_bytes,
            },
            "sharding": sharding_report(
                lm.shard_size, lm.loaded.sharding, lm.per_rank, lm.collective.world_size, tp_size=lm.tp_size
            ),
            "traffic": lm.traffic,
            "load_memory_per_rank": [r["load_memory"] for r in lm.per_rank],
            "memory_estimate": dataclasses.asdict(lm.estimate) if lm.estimate else None,
            "warnings": lm.warnings,
            "document_split": lm.document_split.to_dict(),
        },
    }
    return info
