"""The probe: what scoring may do with a model (:class:`~distperp_harness.run.scoring.engine.support.ModelPaths`),
decided on a float64 miniature of its architecture at the run's own shapes, instead of a list of model types.

Whether tree rows, padded batches, a cached prefix and the head only where scored give a unit the numbers of its
unshared row is a property of the model's code and configuration (how it reads positions, columns, lengths and
masks), not of its weights. So the probe builds the miniature
(:func:`~distperp_harness.model.miniature.build_miniature`: the same classes, every positional and attention setting
kept, widths shrunk, sharp random weights, float64) with the run's attention implementation on the run's device,
and runs the cases of :mod:`~distperp_harness.run.scoring.engine.probe_cases` through the engine's own
:func:`~distperp_harness.run.scoring.engine.forward.score_batch`: every unit against its unshared row (one forward of
its input alone), with float64's tolerance (:data:`TOLERANCE`). The cases are as long as the run's rows up to
:data:`PLAIN_CAP` tokens and its tree rows up to :data:`TREE_CAP` columns; the decision keeps the run within what was
probed (longer rows share a forward only with rows as long; tree rows no wider). The real weights then only confirm
the output head's map on one short row (:func:`head_map`).

A model no miniature can be built for is probed on its own weights, in float32 or wider, within
:data:`PROBE_BUDGET`, with a tolerance of :data:`NOISE_FACTOR` times the rounding measured between two batch shapes;
a model in a narrower dtype, or over the budget, shares nothing (never a tolerance that could hide a wrong mask).
Every rank probes and the verdicts are merged (:func:`merge_paths`): the same decision everywhere.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import numpy as np
import torch

from distperp_harness.model.attention import OutputMap
from distperp_harness.model.layers import matmul_params
from distperp_harness.model.lengths import fresh_rope_each_forward
from distperp_harness.planning.requests import Unit
from distperp_harness.run.scoring.engine.forward import LL, NonFiniteLogitsError, score_batch
from distperp_harness.run.scoring.engine.kvcache import body_of
from distperp_harness.run.scoring.engine.logprobs import at_least_float32
from distperp_harness.run.scoring.engine.probe_cases import Case, Target, cases
from distperp_harness.run.scoring.engine.support import ModelPaths, declared_paths, trying_paths

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PLAIN_CAP = 4096
"""Longest row the miniature is probed on (plain rows and padded batches; longer rows share a forward only with
rows of their own length)."""
TREE_CAP = 1024
"""Widest tree row the miniature is probed on (tree rows of the run are no wider)."""
TOLERANCE = 1e-6
"""Largest difference (nats) between a unit's shared and unshared scores on the float64 miniature: float64 rounding
is ~1e-13, the float32 tables some models keep (MPT's ALiBi slopes) round to ~1e-8; a wrong mask or position moves a
score of the sharp miniature by ~1e-2 or more. Never more than the measured sensitivity over :data:`SENSITIVITY`."""
FLOOR = 1e-9
"""The smallest tolerance (float64 rounding with margin): a probe that would need less cannot tell a wrong mask from
rounding, and nothing is shared."""
SENSITIVITY = 1e3
"""One key shown or hidden must move a unit's score by at least this many tolerances (measured on the probe's own
units: the token four positions before a scored one changed)."""
HEAD_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
"""Largest difference between the model's logits and its head's output under the map, relative to the largest
logit, per dtype (the real weights' check)."""
NOISE_FACTOR = 100.0
"""Without a miniature: the tolerance is this many times the rounding measured between two batch shapes."""
PROBE_BUDGET = {"cpu": 5e12, "cuda": 5e15}
"""Without a miniature: multiply-adds a probe of the real weights may spend per device kind."""
NON_FINITE = "the model gave NaN/inf logits on the probe's rows (scoring names the text where it does so again)"


def unshared_scores(model: torch.nn.Module, units: Sequence[Unit], device: torch.device) -> np.ndarray:
    """Each unit's log-likelihood from its unshared row: one forward of its input alone (no mask, no padding, no
    cache), the model's full logits, a float64 log-softmax and ``math.fsum``: independent of the engine."""
    out = np.empty(len(units))
    for i, unit in enumerate(units):
        logits = model(input_ids=torch.tensor([unit.tokens[:-1]], device=device), use_cache=False).logits[0]
        logp = torch.log_softmax(logits[-unit.n_score :].double(), -1)
        targets = torch.tensor(unit.tokens[-unit.n_score :], device=device)
        out[i] = math.fsum(logp.gather(-1, targets[:, None])[:, 0].tolist())
    return out


def case_scores(model: torch.nn.Module, case: Case, device: torch.device, pad: int, paths: ModelPaths) -> np.ndarray:
    """The units of ``case`` as the engine scores them under ``paths`` (its batches, in unit order)."""
    parts = []
    with trying_paths(model, paths):
        for rows, shared in case.batches:
            stats = score_batch(
                cast("PreTrainedModel", model), list(rows), device=device, pad_token_id=pad, shared=shared
            ).stats
            parts.append(stats[:, LL])
    return np.concatenate(parts) if parts else np.zeros(0)


def _largest(a: np.ndarray, b: np.ndarray) -> float:
    with np.errstate(invalid="ignore"):
        difference = np.abs(a - b)
    return float(difference.max(initial=0.0)) if np.isfinite(difference).all() else float("inf")


def sensitivity(model: torch.nn.Module, units: Sequence[Unit], device: torch.device) -> float:
    """How far one key moves a score: the smallest, over up to three of ``units``, of the difference between the
    unit's unshared score and the same with the token four positions before its first target changed."""
    vocab = int(getattr(model.get_input_embeddings(), "num_embeddings", 0) or model.config.vocab_size)
    chosen = [u for u in units if u.input_length >= 8][:3]
    changed = []
    for unit in chosen:
        tokens = list(unit.tokens)
        at = len(tokens) - unit.n_score - 4
        tokens[at] = 3 + (tokens[at] - 2) % max(1, vocab - 3)
        changed.append(Unit(tuple(tokens), unit.n_score))
    if not chosen:
        return 0.0
    moved = np.abs(unshared_scores(model, chosen, device) - unshared_scores(model, changed, device))
    return float(moved.min())


def run_cases(  # noqa: PLR0913 - the model, what to probe, and the tolerance with its margin
    model: torch.nn.Module,
    target: Target,
    device: torch.device,
    pad: int,
    paths: ModelPaths,
    tolerance: float,
    factor: float | None = None,
) -> tuple[dict[str, str], dict[str, Any]]:
    """``(why each kind of case fails, evidence)``: every case of ``target`` on ``model`` against its unshared rows;
    a kind fails at its first case whose units differ by more than the tolerance (``tolerance``, or less where one
    key moves scores by less than ``factor`` times it, by default :data:`SENSITIVITY`; below :data:`FLOOR`, every kind
    fails) or raises."""
    vocab = int(getattr(model.get_input_embeddings(), "num_embeddings", 0) or model.config.vocab_size)
    failed: dict[str, str] = {}
    largest: dict[str, float] = {}
    every = cases(target, vocab)
    moved = sensitivity(model, [case.units[i] for case in every for i in case.compared], device)
    tolerance = min(tolerance, moved / (factor or SENSITIVITY))
    if not tolerance >= FLOOR:
        why = f"one key moved a score by {moved:.3g} nats: the probe cannot tell a wrong mask from rounding"
        return {case.kind: why for case in every}, {"sensitivity": moved, "tolerance": tolerance}
    for case in every:
        if case.kind in failed:
            continue
        try:
            shared = case_scores(model, case, device, pad, paths)[case.compared]
            difference = _largest(shared, unshared_scores(model, [case.units[i] for i in case.compared], device))
        except NonFiniteLogitsError:
            failed[case.kind] = NON_FINITE
            continue
        except (RuntimeError, TypeError, ValueError, AttributeError, IndexError, KeyError) as exc:
            if isinstance(exc, torch.OutOfMemoryError):
                raise
            first = str(exc).splitlines()[0][:160] if str(exc) else ""
            failed[case.kind] = f"{case.what} failed ({type(exc).__name__}: {first})"
            continue
        largest[case.kind] = max(largest.get(case.kind, 0.0), difference)
        if not difference <= tolerance:
            failed[case.kind] = f"{case.what} gave {difference:.3g} nats from the unshared rows (tolerance {tolerance:.3g})"
    return failed, {"largest_difference": largest, "tolerance": tolerance, "sensitivity": moved}


@torch.no_grad()
def head_structure(model: torch.nn.Module, device: torch.device, output_map: OutputMap) -> str | None:
    """Whether ``model``'s logits are its output head of the body's last hidden state under ``output_map`` (None)
    or why not, on one short random row (the miniature answers for the architecture)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is None:
        return "the model has no output embeddings to apply at scored positions"
    ids = torch.arange(3, 27, device=device)[None] % max(4, int(model.config.vocab_size))
    try:
        full = at_least_float32(model(input_ids=ids, use_cache=False).logits[0])
        hidden = body_of(model)(input_ids=ids, use_cache=False).last_hidden_state[0]
        mine = output_map.apply_(at_least_float32(head(hidden)).clone())
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        return f"computing the head alone failed ({type(exc).__name__}: {str(exc)[:120]})"
    limit = HEAD_TOLERANCE.get(full.dtype, HEAD_TOLERANCE[torch.float32])
    if full.shape != mine.shape or not float((full - mine).abs().max()) <= limit * max(1.0, float(full.abs().max())):
        mapped = f" under {output_map.to_dict()}" if not output_map.identity else ""
        return f"its logits are not the output head of the last hidden state{mapped}"
    return None


@torch.no_grad()
def head_map(model: torch.nn.Module, device: torch.device, output_map: OutputMap) -> tuple[str | None, dict]:
    """On the real weights, one forward of 8 tokens: whether the model's logits are its output head's result under
    ``output_map`` (the map the configuration declares; a scale kept in the weights would show here), and the largest
    relative difference measured."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is None:
        return "the model has no output embeddings to apply at scored positions", {}
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    try:
        vocab = int(getattr(model.config, "vocab_size", 0) or 8)
        ids = (torch.arange(8, device=device)[None] * 7919 + 3) % max(4, vocab)
        full = at_least_float32(model(input_ids=ids, use_cache=False).logits[0])
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, torch.OutOfMemoryError):
            raise
        return f"the model's forward failed on the probe ({type(exc).__name__}: {str(exc)[:120]})", {}
    finally:
        hook.remove()
    if not bool(torch.isfinite(full).all()):
        return NON_FINITE, {}
    if len(seen) != 1 or seen[0].shape[-2:] != full.shape[-2:]:
        return "its output head is not applied once to every position", {}
    mine = output_map.apply_(at_least_float32(seen[0][0]).clone())
    difference = float((full - mine).abs().max()) / max(1.0, float(full.abs().max()))
    evidence = {"head_relative_difference": difference}
    if not difference <= HEAD_TOLERANCE.get(seen[0].dtype, HEAD_TOLERANCE[torch.float32]):
        return (
            f"its logits are not its head's output under {output_map.to_dict()} (relative difference "
            f"{difference:.3g} on the probe)"
        ), evidence
    return None, evidence


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


def architecture_key(model: torch.nn.Module, device: torch.device, target: Target) -> tuple:
    """What a miniature's verdict depends on: the model class, its configuration without the checkpoint's name and
    dtype, the attention implementation, the device kind and the target."""
    config = model.config
    settings = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE}
    return (type(model).__qualname__, repr(sorted(settings.items())), config._attn_implementation, device.type, target)


def probe_miniature(model: torch.nn.Module, device: torch.device, pad: int, target: Target) -> tuple | str:
    """``(failed, evidence, probed target)`` of ``model``'s float64 miniature (cached per architecture), or why
    no miniature could be built."""
    key = architecture_key(model, device, target)
    if key in _DECIDED:
        failed, evidence, probed = _DECIDED[key]
        return dict(failed), {**evidence, "decided_before": True}, probed
    from distperp_harness.model.miniature import build_miniature

    impl = model.config._attn_implementation
    mini = build_miniature(model.config, attn_implementation=impl, device=device)
    if isinstance(mini, str):
        return mini
    fresh_rope_each_forward(mini)
    probed = target.capped(PLAIN_CAP, TREE_CAP)
    paths = declared_paths(mini, target.max_length)
    structure = head_structure(mini, device, paths.output_map)
    paths = dataclasses.replace(paths, head_only=structure)
    with torch.no_grad():
        failed, evidence = run_cases(mini, probed, device, pad, paths, TOLERANCE)
        if "tree" in failed and probed.tree_tokens > probed.max_length:  # trees as wide as a path, then
            narrower = dataclasses.replace(probed, tree_tokens=probed.max_length, batched=False, cached=False)
            again, _ = run_cases(mini, narrower, device, pad, paths, TOLERANCE)
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
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in (torch.float32, torch.float64):
        return f"no miniature of it could be built and its {dtype} weights cannot tell a wrong mask from rounding"
    probed = target.capped(min(PLAIN_CAP, 512), min(TREE_CAP, 512))
    paths = declared_paths(model, target.max_length)
    units = [c.units[i] for c in cases(probed, int(model.config.vocab_size)) for i in c.compared]
    cost = 2.0 * sum(u.input_length for u in units) * 3 * matmul_params(model)[0]
    if cost > PROBE_BUDGET.get(device.type, PROBE_BUDGET["cpu"]):
        return f"no miniature of it could be built and a probe of its weights would cost {cost:.2g} multiply-adds"
    noise = _largest(unshared_scores(model, units[:4], device), unshared_scores(model, units[:4], device))
    failed, evidence = run_cases(model, probed, device, pad, paths, max(1e-6, NOISE_FACTOR * noise), NOISE_FACTOR)
    return failed, {**evidence, "probed_on": "the model's own weights"}, probed


def probe(model: torch.nn.Module, device: torch.device, pad_token_id: int, target: Target | int) -> ModelPaths:
    """``model``'s :class:`ModelPaths` for a run doing ``target`` (module doc; a number: batches of rows and tree
    rows of at most that many tokens, cached prefixes, as a direct caller of the engine plans them)."""
    if isinstance(target, int):
        target = Target(target, target)
    fresh_rope_each_forward(model)
    declared = declared_paths(model, target.max_length)
    target = dataclasses.replace(target, lengths=declared.lengths)
    head, head_evidence = head_map(model, device, declared.output_map)
    verdict = probe_miniature(model, device, pad_token_id, target)
    if isinstance(verdict, str):
        verdict = probe_weights(model, device, pad_token_id, target)
    if isinstance(verdict, str):  # nothing could be probed: share nothing
        failed = {"padded": verdict, "tree": verdict}
        evidence: dict[str, Any] = {"why_not_probed": verdict}
        probed = target
    else:
        failed, evidence, probed = verdict
    paths = decide(declared, target, failed, probed)
    return dataclasses.replace(paths, head_only=failed.get("head") or head, evidence={**head_evidence, **evidence})


def merge_paths(verdicts: Sequence[dict[str, Any]], mine: ModelPaths) -> ModelPaths:
    """The decision every rank takes from every rank's ``to_dict()``: this rank's, with any path another rank refused
    refused too (the first refusal's reason), the narrowest tree rows and the most careful length rule, so that all
    ranks plan alike."""
    from distperp_harness.model.lengths import LengthRule

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
