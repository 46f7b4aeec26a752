"""The probe: a few short forwards on the loaded weights decide what scoring may do with a model
(:class:`~distperp_harness.run.scoring.engine.support.ModelPaths`), instead of a list of model types.

transformers' declarations (:mod:`distperp_harness.model.attention`: layer types, windows, chunks, the final logit
map; the attention implementation) say what to try; the probe confirms each on the user's weights through the
engine's own code (:func:`~distperp_harness.run.scoring.engine.forward.score_batch` on rows the planner builds):

* **head**: the model's logits against the output head of its last hidden state under the declared map, on a short
  row (:func:`probe_head`);
* **packed rows**: units after one shared root on two branches, as one tree row against the two unshared rows
  (:func:`probe_rows`). The paths are just longer than the longest window or chunk that applies within
  ``max_length`` (every layer type attends over a span where its rule hides keys), and the scored positions lie past
  it. Where a window applies, the probe also computes the tree row *without* the windows: that wrong mask must
  differ from the unshared rows by well over the tolerance, or the probe cannot tell a wrong mask from rounding on
  these weights and refuses packed rows;
* **cached prefix**: the two rows continuing their root from a key/value cache computed once.

The tolerance is rounding, measured: short unshared rows computed in another batch shape (each alone), times
:data:`NOISE_FACTOR`, and at least :data:`TOLERANCE`'s floor for the dtype. A verdict the probe cannot reach within
its token budget (:func:`probe_budget`) is a fallback, never a guess. Every rank probes and the verdicts are merged
(:func:`merge_paths`): the same decision everywhere. ``between_forwards`` (sharded weights: gather the root group
again) runs between the probe's forwards, as the executor runs it between a call's forwards: a whole-model forward of
an FSDP2 model reshards its root group when it returns, and the next forward of the body alone must find it gathered.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import numpy as np
import torch

from distperp_harness.model.attention import OutputMap
from distperp_harness.model.layers import matmul_params
from distperp_harness.planning.requests import Unit, continuation_unit
from distperp_harness.planning.rows import ShareMode, build_rows
from distperp_harness.run.scoring.engine.forward import LL, NonFiniteLogitsError, score_batch, score_each_row
from distperp_harness.run.scoring.engine.kvcache import body_of
from distperp_harness.run.scoring.engine.logprobs import at_least_float32
from distperp_harness.run.scoring.engine.support import ModelPaths, declared_paths, trying_paths

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PROBE_SEED = 1234
"""Seed of the probe's token ids (the same rows on every rank and every run)."""
SCORED = 6
"""Positions scored on each branch (the last ones, past every window)."""
MARGIN = 8
"""Positions each probe path runs past the longest window or chunk."""
SHORT_ROOT = 16
"""The shared root of a model without windows (the tree mask alone is probed)."""
TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-4, torch.bfloat16: 0.5, torch.float16: 0.1}
"""Smallest tolerance on a log-probability (nats) per compute dtype: the kernels' rounding between a masked and an
unmasked forward of the same rows (measured on SmolLM2-135M: up to 2e-5 in float32, 0.19 in bfloat16)."""
HEAD_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
"""Largest difference between the model's logits and the head's, relative to the largest logit, per dtype."""
NOISE_FACTOR = 4.0
"""The tolerance is at least this many times the rounding measured between two batch shapes of the same rows."""
SENSITIVITY = 2.0
"""A wrong (window-less) mask must differ by more than this many tolerances for the probe to vouch for a window."""
NON_FINITE = "the model gave NaN/inf logits on the probe's rows (scoring names the text where it does so again)"
"""The fallback of a model whose unshared rows already give non-finite logits: nothing can be compared, and the
error belongs to scoring, which names the window."""
PROBE_BUDGET = {"cpu": 5e12, "cuda": 5e15}
"""Floating-point operations a probe may spend per device kind (input positions times body parameters, doubled):
about a minute of a 2-core CPU (a 270M-parameter body with 512-token windows probes in a fraction of it), well under
a second of a GPU."""


def _tokens(vocab: int, n: int, generator: torch.Generator) -> list[int]:
    low = min(3, max(0, vocab - 1))
    return torch.randint(low, max(low + 1, vocab), (n,), generator=generator).tolist()


def _vocab(model: torch.nn.Module) -> int:
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    return int(getattr(getattr(model, "config", None), "vocab_size", 256) or 256)


def _dtype(model: torch.nn.Module) -> torch.dtype:
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    weight = getattr(embeddings, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else torch.float32


def probe_budget(model: torch.nn.Module, device: torch.device, tokens: int) -> str | None:
    """Why a probe of ``tokens`` input positions costs too much on ``device`` (None: it does not): each position
    multiplies through the body's parameters (:func:`~distperp_harness.model.layers.matmul_params`)."""
    cost = 2.0 * tokens * matmul_params(model)[0]
    limit = PROBE_BUDGET.get(device.type, PROBE_BUDGET["cpu"])
    if cost > limit:
        return f"a probe of {tokens} tokens would cost {cost:.2g} multiply-adds (over {limit:.2g} on {device.type})"
    return None


@torch.no_grad()
def probe_head(
    model: torch.nn.Module,
    device: torch.device,
    output_map: OutputMap,
    between_forwards: Callable[[], None] = lambda: None,
) -> tuple[str | None, dict]:
    """Whether ``model``'s logits are its output head of the last hidden state under ``output_map`` (None) or why
    not, and the largest relative difference measured, on one short random row (``between_forwards``: module doc)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is None:
        return "the model has no output embeddings to apply at scored positions", {}
    generator = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.tensor([_tokens(_vocab(model), 24, generator)], device=device)
    try:
        full = at_least_float32(model(input_ids=ids, use_cache=False).logits[0, -8:])
        between_forwards()
        hidden = body_of(model)(input_ids=ids, use_cache=False).last_hidden_state[0, -8:]
        mine = output_map.apply_(at_least_float32(head(hidden)).clone())
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, torch.OutOfMemoryError):
            raise
        return f"computing the head alone failed ({type(exc).__name__}: {str(exc)[:120]})", {}
    if not bool(torch.isfinite(full).all()):
        return NON_FINITE, {}
    scale = max(1.0, float(full.abs().max()))
    difference = float((full - mine).abs().max()) / scale if full.shape == mine.shape else float("inf")
    evidence = {"head_relative_difference": difference}
    limit = HEAD_TOLERANCE.get(_dtype(model), HEAD_TOLERANCE[torch.float32])
    if not difference <= limit:
        mapped = f" under {output_map.to_dict()}" if not output_map.identity else ""
        return (
            f"its logits are not the output head of the last hidden state{mapped} (relative difference "
            f"{difference:.3g} > {limit:g} on the probe)"
        ), evidence
    return None, evidence


@dataclasses.dataclass(frozen=True)
class ProbeRows:
    """The probe's units and their rows: ``tree`` (one tree row: the root and two branches), ``paths`` (the two
    unshared rows), ``root`` (the tokens the rows share, never scored)."""

    units: list[Unit]
    tree: list
    paths: list
    root: int

    @classmethod
    def build(cls, vocab: int, span: int, max_length: int) -> ProbeRows:
        """A random root of a little more than ``span`` tokens, then two branches that copy the root's start after
        a token of their own, each path at most ``max_length`` inputs; the last :data:`SCORED` tokens of each branch
        are scored, one unit each. A trained model predicts a copy confidently where it sees the original and not
        where a window hides it, so a mask that gets a window wrong moves the scores far."""
        generator = torch.Generator().manual_seed(PROBE_SEED + 1)
        lengths = (SCORED + MARGIN // 2, SCORED + MARGIN)
        root = max(2, min(max_length - lengths[1] - 1, max(SHORT_ROOT, span + 2)))
        shared = _tokens(vocab, root, generator)
        heads = _tokens(vocab, 8, generator)
        first = [t for t in heads if t != shared[0]][:2] or heads[:2]
        branches = [[lead] + (shared * (1 + n // root))[: n - 1] for lead, n in zip(first, lengths)]
        units = [
            continuation_unit(shared + branch[:j], [branch[j]], max_length)
            for branch in branches
            for j in range(max(1, len(branch) - SCORED), len(branch))
        ]
        return cls(units, build_rows(units, ShareMode.PREFIX), build_rows(units, ShareMode.INPUTS), root)

    @staticmethod
    def by_unit(rows: Sequence, stats: np.ndarray) -> np.ndarray:
        """``stats[:, LL]`` reordered by unit id (rows list their units in row order)."""
        ids = [i for row in rows for i in row.unit_ids]
        out = np.empty(len(ids))
        out[ids] = stats[:, LL]
        return out


def _largest(a: np.ndarray, b: np.ndarray) -> float:
    with np.errstate(invalid="ignore"):
        difference = np.abs(a - b)
    return float(np.nanmax(difference)) if np.isfinite(difference).all() else float("inf")


@torch.no_grad()
def probe_rows(
    model: torch.nn.Module,
    device: torch.device,
    pad_token_id: int,
    paths: ModelPaths,
    max_length: int,
    between_forwards: Callable[[], None] = lambda: None,
) -> tuple[str | None, str | None, dict]:
    """``(why no packed rows, why no cached prefix, evidence)`` for ``model`` whose head verdict and declared layout
    ``paths`` carries (each None when allowed; module doc)."""
    layout = paths.layout
    if paths.packed_rows is not None or layout is None:
        why = paths.packed_rows or "no attention layout"
        return why, why, {}
    span = layout.span
    if span and span + 2 > max_length:
        return None, None, {"note": "no window applies within max_length"}
    rows = ProbeRows.build(_vocab(model), span, max_length)
    short = ProbeRows.build(_vocab(model), 0, max_length) if span else rows
    tokens = sum(r.length for r in rows.paths) * 2 + sum(r.length for r in rows.tree) * (2 if span else 1)
    tokens += sum(r.length for r in short.paths) * (2 if span else 1)
    costly = probe_budget(model, device, tokens)
    if costly:
        return costly, costly, {"probe_tokens": tokens}

    def score(batch, **kwargs) -> np.ndarray:
        scorer = score_each_row if kwargs.pop("each", False) else score_batch
        between_forwards()
        with trying_paths(model, kwargs.pop("as_paths", paths)):
            stats = scorer(
                cast("PreTrainedModel", model),
                batch,
                device=device,
                pad_token_id=pad_token_id,
                between_forwards=between_forwards,
                **kwargs,
            ).stats
        return ProbeRows.by_unit(batch, stats)

    try:
        base = score(rows.paths)
        short_base = score(short.paths) if short is not rows else base
        noise = _largest(short_base, score(short.paths, each=True))
    except NonFiniteLogitsError:
        return NON_FINITE, NON_FINITE, {"probe_tokens": tokens}
    tolerance = max(TOLERANCE.get(_dtype(model), TOLERANCE[torch.float32]), NOISE_FACTOR * noise)
    evidence: dict[str, Any] = {"probe_tokens": tokens, "tolerance": tolerance, "noise": noise}
    packed = _attempt(lambda: _largest(score(rows.tree), base))
    evidence["packed_difference"] = packed if isinstance(packed, float) else None
    why_packed = _verdict("tree rows", packed, tolerance)
    if why_packed is None and span:
        wrong = dataclasses.replace(paths, layout=layout.without_rules())
        sensitivity = _attempt(lambda: _largest(score(rows.tree, as_paths=wrong), base))
        evidence["window_effect"] = sensitivity if isinstance(sensitivity, float) else None
        if isinstance(sensitivity, float) and not sensitivity > SENSITIVITY * tolerance:
            why_packed = (
                f"the probe cannot tell its windows from rounding on these weights (a mask without them moved "
                f"log-likelihoods by {sensitivity:.3g} nats, tolerance {tolerance:.3g})"
            )
    if why_packed is not None:
        return why_packed, why_packed, evidence
    cached = _attempt(lambda: _largest(score(rows.paths, shared=rows.root), base))
    evidence["cached_difference"] = cached if isinstance(cached, float) else None
    return None, paths.cached_prefix or _verdict("rows continuing a cached prefix", cached, tolerance), evidence


def _attempt(compute) -> float | str:
    """``compute()``, or the one-line reason it raised (a model that refuses the inputs is a fallback)."""
    try:
        return compute()
    except (RuntimeError, TypeError, ValueError, AttributeError, IndexError, KeyError) as exc:
        if isinstance(exc, torch.OutOfMemoryError):
            raise
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _verdict(what: str, measured: float | str, tolerance: float) -> str | None:
    if isinstance(measured, str):
        return f"{what} failed on the probe ({measured})"
    if not measured <= tolerance:
        return (
            f"{what} gave other log-likelihoods than unshared rows on the probe ({measured:.3g} nats apart, "
            f"tolerance {tolerance:.3g})"
        )
    return None


def probe(
    model: torch.nn.Module,
    device: torch.device,
    pad_token_id: int,
    max_length: int,
    between_forwards: Callable[[], None] = lambda: None,
) -> ModelPaths:
    """``model``'s :class:`ModelPaths`, decided by its declarations and the probe's forwards (module doc)."""
    declared = declared_paths(model, max_length)
    head, head_evidence = probe_head(model, device, declared.output_map, between_forwards)
    decided = dataclasses.replace(declared, head_only=head, probed=True)
    packed, cached, evidence = probe_rows(model, device, pad_token_id, decided, max_length, between_forwards)
    return dataclasses.replace(
        decided,
        packed_rows=packed,
        cached_prefix=cached,
        evidence={**head_evidence, **evidence},
    )


def merge_paths(verdicts: Sequence[dict[str, Any]], mine: ModelPaths) -> ModelPaths:
    """The decision every rank takes from every rank's ``to_dict()``: this rank's, with any path another rank refused
    refused too (the first refusal's reason), so that all ranks plan alike."""

    def refused(key: str, own: str | None) -> str | None:
        other = next((v[key] for v in verdicts if v.get(key)), None)
        return own if own is not None or other is None else f"{other} (on another rank)"

    packed = refused("packed_rows_fallback", mine.packed_rows)
    return dataclasses.replace(
        mine,
        packed_rows=packed,
        cached_prefix=refused("cached_prefix_fallback", mine.cached_prefix) or packed,
        head_only=refused("head_fallback", mine.head_only),
    )
