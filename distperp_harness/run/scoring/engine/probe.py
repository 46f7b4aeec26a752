"""The probe: what scoring may do with a model (:class:`~distperp_harness.run.scoring.engine.support.ModelPaths`),
decided on a miniature of its architecture at the run's own shapes, instead of a list of model types.

Whether tree rows, padded batches, a cached prefix and the head only where scored give a unit the numbers of its
unshared row is a property of the model's code and configuration (how it reads positions, columns, lengths and
masks), not of its weights. So the probe builds the miniature
(:func:`~distperp_harness.model.miniature.build_miniature`: the same classes, every positional and attention setting
kept, widths shrunk, sharp random weights, float64) with the run's attention implementation on the run's device,
and runs the cases of :mod:`~distperp_harness.run.scoring.engine.probe_cases` through the engine's own
:func:`~distperp_harness.run.scoring.engine.forward.score_batch`, every unit against its unshared row
(:mod:`~distperp_harness.run.scoring.engine.probe_checks`: within the rounding measured between two batch shapes).
Cases of at most :data:`FLOAT64_COLUMNS` columns run in float64; longer ones (rows up to :data:`PLAIN_CAP` tokens,
tree rows up to :data:`TREE_CAP` columns) on a float32 copy of the miniature, whose dense-mask attention is six
times faster. The decision keeps the run within what was probed (longer rows share a forward only with rows as long;
tree rows no wider). The real weights then only confirm the output head's map on one short row.

A model no miniature can be built for is probed on its own weights, in float32 or wider, within
:data:`PROBE_BUDGET`; a model in a narrower dtype, or over the budget, shares nothing (never a tolerance that could
hide a wrong mask). Every rank probes and the verdicts are merged (:func:`merge_paths`): the same decision
everywhere. A miniature's verdict is kept per architecture (:data:`_DECIDED`): a series of checkpoints decides once.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence

import torch

from distperp_harness.errors import InputError
from distperp_harness.model.layers import matmul_params
from distperp_harness.model.lengths import LengthRule, fresh_rope_each_forward
from distperp_harness.model.parts import embedding_rows
from distperp_harness.run.scoring.engine.probe_cases import Case, Target, cases
from distperp_harness.run.scoring.engine.probe_checks import (
    dtype_of,
    head_map,
    head_structure,
    padding_refusal,
    run_cases,
)
from distperp_harness.run.scoring.engine.support import ModelPaths, declared_paths

NOT_CAUSAL = 1e-3
"""Nats a short row alone moves when right-padded, from which the model is refused (it reads later columns); a
smaller failure of that case (float32 parts of a kernel) only shares nothing."""
PLAIN_CAP = 2048
"""Longest row the miniature is probed on (plain rows and padded batches; longer rows share a forward only with
rows of their own length: a padded batch of 4,096 tokens costs the probe 1.2 s more on 2 CPU cores)."""
TREE_CAP = 2048
"""Widest tree row the miniature is probed on (tree rows of the run are no wider)."""
FLOAT64_COLUMNS = 1024
"""Cases of at most this many columns run on the float64 miniature, longer ones on its float32 copy."""
ROUNDING_LENGTH = {torch.float64: 64, torch.float32: 512}
"""Length of the two rows whose rounding between batch shapes sets each tier's tolerance."""
PROBE_BUDGET = {"cpu": 5e12, "cuda": 5e15}
"""Without a miniature: multiply-adds a probe of the real weights may spend per device kind."""


def decide(declared: ModelPaths, target: Target, failed: dict[str, str], probed: Target) -> ModelPaths:
    """The paths that keep the run within what passed: ``failed`` (why each kind of case failed) on ``probed``
    (the target within the caps)."""
    lengths = declared.lengths
    if "padded" in failed or "same length" in failed:
        why = failed.get("padded") or failed["same length"]
        lengths = lengths.at_most(0, f"every row shares a forward only with rows as long ({why})")
    elif probed.max_length < target.max_length:
        lengths = lengths.at_most(
            probed.max_length,
            f"rows longer than {probed.max_length} tokens share a forward only with rows as long (the probe's longest)",
        )
    packed = declared.packed_rows or failed.get("tree")
    cached = declared.cached_prefix or packed or failed.get("cached")
    return dataclasses.replace(
        declared,
        packed_rows=packed,
        cached_prefix=cached,
        lengths=lengths,
        tree_tokens=probed.tree_tokens if packed is None and target.tree_tokens else None,
        probed=True,
    )


_DECIDED: dict[tuple, tuple[dict[str, str], dict[str, Any], Target]] = {}
"""Miniature verdicts per architecture, attention implementation, device kind and target (a series of
checkpoints of one architecture decides once)."""
_VOLATILE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash", "architectures")


def forget_decisions() -> None:
    """Drop every kept verdict (:data:`_DECIDED`): the next probe of each architecture runs its cases again."""
    _DECIDED.clear()


def architecture_key(model: torch.nn.Module, device: torch.device, target: Target) -> tuple:
    """What a miniature's verdict depends on: the model class, its configuration without the checkpoint's name and
    dtype, the attention implementation, the device kind and the target."""
    config: Any = getattr(model, "config")  # noqa: B009 - torch types module attributes as tensors
    settings = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE}
    return (type(model).__qualname__, repr(sorted(settings.items())), config._attn_implementation, device.type, target)


def tiers(
    mini: torch.nn.Module, every: list[Case], device: torch.device, pad: int, paths: ModelPaths
) -> tuple[dict[str, str], dict[str, Any]]:
    """``every`` case on the float64 miniature up to :data:`FLOAT64_COLUMNS` columns and the longer ones on its
    float32 copy (module doc): ``(why each kind failed, evidence of each tier)``."""
    short = [c for c in every if c.columns <= FLOAT64_COLUMNS]
    long = [c for c in every if c.columns > FLOAT64_COLUMNS]
    failed, evidence = run_cases(mini, short, device, pad, paths, ROUNDING_LENGTH[torch.float64])
    if long:
        wide = copy.deepcopy(mini).float()
        fresh_rope_each_forward(wide)
        moved = evidence.get("sensitivity")  # the float32 copy's weights are the miniature's
        more, wide_evidence = run_cases(wide, long, device, pad, paths, ROUNDING_LENGTH[torch.float32], moved)
        failed = {**more, **failed}
        evidence["float32"] = wide_evidence
    return failed, evidence


def probe_miniature(model: torch.nn.Module, device: torch.device, pad: int, target: Target) -> tuple | str:
    """``(failed, evidence, probed target)`` of ``model``'s float64 miniature (cached per architecture), or why
    no miniature could be built."""
    key = architecture_key(model, device, target)
    if key in _DECIDED:
        failed, evidence, probed = _DECIDED[key]
        return dict(failed), {**evidence, "decided_before": True}, probed
    from distperp_harness.model.miniature import build_miniature

    config: Any = getattr(model, "config")  # noqa: B009 - torch types module attributes as tensors
    mini = build_miniature(config, attn_implementation=config._attn_implementation, device=device)
    if isinstance(mini, str):
        return mini
    fresh_rope_each_forward(mini)
    probed = target.capped(PLAIN_CAP, TREE_CAP)
    paths = declared_paths(mini, target.max_length)
    structure = head_structure(mini, device, paths.output_map)
    paths = dataclasses.replace(paths, head_only=structure)
    vocab = embedding_rows(mini)
    with torch.no_grad():
        failed, evidence = tiers(mini, cases(probed, vocab), device, pad, paths)
        if "tree" in failed and probed.tree_tokens > probed.max_length:  # trees as wide as a path, then
            narrower = dataclasses.replace(probed, tree_tokens=probed.max_length, batched=False, cached=False)
            again, _ = tiers(mini, cases(narrower, vocab), device, pad, paths)
            evidence["wider_trees"] = failed.pop("tree")
            if "tree" in again:
                failed["tree"] = again["tree"]
            else:
                probed = dataclasses.replace(probed, tree_tokens=probed.max_length)
    if structure is not None:
        failed["head"] = structure
    evidence["probed"] = {"longest_path": probed.max_length, "widest_tree": probed.tree_tokens}
    _DECIDED[key] = (failed, evidence, probed)
    return dict(failed), evidence, probed


@torch.no_grad()
def probe_weights(model: torch.nn.Module, device: torch.device, pad: int, target: Target) -> tuple | str:
    """Without a miniature: the cases on the real weights, in float32 or wider and within :data:`PROBE_BUDGET`
    (module doc), or why they cannot be probed."""
    dtype = dtype_of(model)
    if dtype not in (torch.float32, torch.float64):
        return f"no miniature of it could be built and its {dtype} weights cannot tell a wrong mask from rounding"
    probed = target.capped(512, 512)
    paths = declared_paths(model, target.max_length)
    every = cases(probed, embedding_rows(model))
    units = [c.units[i] for c in every for i in c.compared]
    cost = 2.0 * sum(u.input_length for u in units) * 3 * matmul_params(model)[0]
    if cost > PROBE_BUDGET.get(device.type, PROBE_BUDGET["cpu"]):
        return f"no miniature of it could be built and a probe of its weights would cost {cost:.2g} multiply-adds"
    failed, evidence = run_cases(model, every, device, pad, paths, 64)
    return failed, {**evidence, "probed_on": "the model's own weights"}, probed


def probe(model: torch.nn.Module, device: torch.device, pad_token_id: int, target: Target | int) -> ModelPaths:
    """``model``'s :class:`ModelPaths` for a run doing ``target`` (module doc; a number: batches of rows and tree
    rows of at most that many tokens, cached prefixes, as a direct caller of the engine plans them)."""
    if isinstance(target, int):
        target = Target(target, target)
    fresh_rope_each_forward(model)
    declared = declared_paths(model, target.max_length)
    spans = tuple(sorted({rule.span for rule in declared.layout.rules if rule.span})) if declared.layout else ()
    target = dataclasses.replace(target, lengths=declared.lengths, spans=spans)
    head, head_evidence = head_map(model, device, declared.output_map, pad_token_id)
    refusal = padding_refusal(model, head_evidence)
    if refusal is not None:
        _refuse(model, refusal)
    verdict = probe_miniature(model, device, pad_token_id, target)
    if isinstance(verdict, str):
        verdict = probe_weights(model, device, pad_token_id, target)
    if isinstance(verdict, str):  # nothing could be probed: share nothing
        failed = {"padded": verdict, "tree": verdict}
        evidence: dict[str, Any] = {"why_not_probed": verdict}
        probed = target
    else:
        failed, evidence, probed = verdict
    if (evidence.get("largest_difference") or {}).get("alone", 0.0) >= NOT_CAUSAL:
        _refuse(model, f"{failed['alone']}: its positions read the columns after them")
    paths = decide(declared, target, failed, probed)
    return dataclasses.replace(paths, head_only=failed.get("head") or head, evidence={**head_evidence, **evidence})


def _refuse(model: torch.nn.Module, why: str) -> None:
    """Refuse ``model`` in one line (the same on every rank): it is not causal, so no row of it can be exact."""
    name = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    raise InputError(
        f"the loaded model ({name}) cannot be scored by --model distperp: {why}. Allowed: causal LMs, whose "
        "positions do not read later columns. Fix: evaluate it with --model hf at batch_size=1",
        same_on_every_rank=True,
    )


def merge_paths(verdicts: Sequence[dict[str, Any]], mine: ModelPaths) -> ModelPaths:
    """The decision every rank takes from every rank's ``to_dict()``: this rank's, with any path another rank refused
    refused too (the first refusal's reason), the narrowest tree rows and the most careful length rule, so that all
    ranks plan alike."""

    def refused(key: str, own: str | None) -> str | None:
        other = next((v[key] for v in verdicts if v.get(key)), None)
        return own if own is not None or other is None else f"{other} (on another rank)"

    packed = refused("packed_rows_fallback", mine.packed_rows)
    lengths = mine.lengths
    for v in verdicts:
        lengths = lengths.merged(LengthRule.from_dict(v.get("lengths") or {}))
    widths = [v["tree_tokens"] for v in verdicts if v.get("tree_tokens")]
    return dataclasses.replace(
        mine,
        packed_rows=packed,
        cached_prefix=refused("cached_prefix_fallback", mine.cached_prefix) or packed,
        head_only=refused("head_fallback", mine.head_only),
        lengths=lengths,
        tree_tokens=min(widths) if widths and packed is None else None,
    )
