"""What a run records: the model and run metadata lm-eval merges into the results JSON's ``config``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distperp_harness import __version__
from distperp_harness.options import Options
from distperp_harness.run.execution.calls import RunStats
from distperp_harness.run.rules import Batching, Sharing


def bits_depend_on(batch_invariant: bool) -> list[str]:
    """What a run's per-document results depend on besides the requests: equal on these, equal bits. Not on the
    number of processes or nodes, ``shard_size`` or ``claim``; with ``batch_invariant`` not on the batch plan."""
    facts = [
        "checkpoint and computing options (the resume key: dtype, quantize, max_length, share_prefix, ...)",
        "library versions",
        "device kind (device_identity: GPU model or CPU instruction set, numerics flags)",
        "tp_size",
        "cp_size",
        "compile mode",
    ]
    if not batch_invariant:
        facts.append("batch plan (batch_size, max_batch_size, and batch_size=auto's budget from the device's memory)")
    return facts


@dataclass
class RunFacts:
    """What a run's record is made of, gathered by the face (``stages.run_facts``) from its stages' records."""

    options: Options
    device: torch.device
    device_identity: dict
    checkpoint: dict
    model_num_parameters: int
    model_dtype: str
    control_backend: str
    world_size: int
    num_nodes: int
    max_length: int
    weight_bytes: int
    batching: Batching
    sharing: Sharing
    row_budget_reason: str | None
    sharing_fallback: str | None
    load_seconds: float
    compiled: dict
    stats: RunStats
    quantization: dict | None
    adapter: dict | None
    stored_quantization: dict | None
    int4_products: dict | None
    chat: dict
    resume: dict | None
    reference: dict | None
    sharding: dict
    traffic: Any
    load_memory_per_rank: list
    memory_estimate: dict | None
    warnings: list[str]
    document_split: dict
    paths: dict
    batch_invariance: dict | None = None


def run_record(facts: RunFacts) -> dict:
    """``config`` entries of a run: the checkpoint's identity and ``distperp``: options (as the run used them),
    device, layout, batching, sharing, calls, fingerprint, memory.

    ``options.device`` is the device the run used where the value was lm-eval's default and fell back (no CUDA);
    ``options.compile`` is ``false`` or the torch.compile mode; ``sharing`` is what loglikelihood requests use
    (rolling windows are one per row: their calls record ``share_mode: off``), its ``mode`` ``None`` when no
    loglikelihood call ran; ``paths``: what the probe decided for the model (and the reference): packed rows, cached
    prefix, head only where scored, each with its fallback reason, and what it measured."""
    options = facts.options.to_dict()
    invariant = (facts.batch_invariance or {}).get("mode", "off") != "off"
    if facts.options.device_from_cli and str(facts.device) != facts.options.device:
        options["device"] = str(facts.device)
    options["compile"] = facts.options.compile_mode or False
    return {
        "model_num_parameters": facts.model_num_parameters,
        "model_dtype": facts.model_dtype,
        "model_revision": facts.options.revision,
        **facts.checkpoint,
        "distperp": {
            "version": __version__,
            "options": options,
            "device": str(facts.device),
            "device_identity": facts.device_identity,
            "control_plane": facts.control_backend,
            "world_size": facts.world_size,
            "num_nodes": facts.num_nodes,
            "max_length": facts.max_length,
            "weight_bytes": facts.weight_bytes,
            "batching": {
                "batch_size": facts.batching.batch_size,
                "token_budget": facts.batching.token_budget,
                "max_batch_size": facts.batching.max_batch_size,
            },
            "batch_invariant": invariant,
            "batch_invariance": facts.batch_invariance,
            "bits_depend_on": bits_depend_on(invariant),
            "sharing": {  # a mode only where loglikelihood requests ran (the calls say what ran)
                "mode": facts.sharing.mode if any(c.kind == "loglikelihood" for c in facts.stats.calls) else None,
                "requests": "loglikelihood",
                "max_row_length": facts.sharing.max_row_length,
                "cached_prefix": facts.sharing.cached_prefix.name.lower(),
                "row_budget": facts.row_budget_reason,
                "fallback_reason": facts.sharing_fallback,
            },
            "load_seconds": facts.load_seconds,
            "compile": facts.compiled,
            "calls": facts.stats.to_dicts(),
            "fingerprint": facts.stats.fingerprint,
            "quantization": facts.quantization,
            "adapter": facts.adapter,
            "stored_quantization": facts.stored_quantization,
            "int4_products": facts.int4_products,
            "chat": facts.chat,
            "resume": facts.resume,
            "reference": facts.reference,
            "sharding": facts.sharding,
            "traffic": facts.traffic,
            "load_memory_per_rank": facts.load_memory_per_rank,
            "memory_estimate": facts.memory_estimate,
            "warnings": facts.warnings,
            "document_split": facts.document_split,
            "paths": facts.paths,
        },
    }
