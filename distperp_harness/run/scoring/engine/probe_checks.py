"""The probe's measurements (:mod:`~distperp_harness.run.scoring.engine.probe`): a unit's unshared score, the engine's
score of a case, the rounding between two batch shapes, how far one key moves a score, each case against its
unshared rows, and the output head's structure and map.

A unit's *unshared row* is one forward of its input alone: no mask, no padding, no cache, the model's full logits,
a float64 log-softmax and ``math.fsum``; it never goes through the engine, so the engine is compared with something
independent of it.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Iterator, Sequence, cast

import numpy as np
import torch

from distperp_harness.model.attention import OutputMap
from distperp_harness.model.parts import embedding_rows
from distperp_harness.planning.requests import Unit
from distperp_harness.run.scoring.engine.forward import LL, NonFiniteLogitsError, score_batch
from distperp_harness.run.scoring.engine.kvcache import body_of
from distperp_harness.run.scoring.engine.logprobs import at_least_float32
from distperp_harness.run.scoring.engine.probe_cases import Case, CaseTokens, same_length_case
from distperp_harness.run.scoring.engine.support import ModelPaths, trying_paths

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FLOOR = {torch.float64: 1e-6, torch.float32: 1e-4}
"""The smallest tolerance (nats) per compute dtype: float64 rounds to ~1e-13, but classes keep float32 parts in a
float64 model (transformers' eager attention takes its softmax in float32, MPT keeps its ALiBi table in float32:
~1e-7 between a tree row and unshared rows); float32 rounds to ~1e-6 between batch shapes on a unit of a few tokens,
more on long rows. A wrong mask or position moves a score of the sharp miniature by ~1e-2 or more."""
NOISE_FACTOR = 10.0
"""The tolerance is at least this many times the rounding measured between two batch shapes of the same rows (two
rows of one length, batched and alone: a mixture of experts groups tokens otherwise, ~1e-5 in float64)."""
SENSITIVITY = 100.0
"""A key shown or hidden must move a unit's score by at least this many tolerances (measured on the probe's own
units: one token before a scored one changed), else the probe cannot tell a wrong mask from rounding and the model
shares nothing."""
HEAD_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
"""Largest difference between the model's logits and its head's output under the map, relative to the largest
logit, per dtype."""
PAD_TOLERANCE = {dtype: 10 * tol for dtype, tol in HEAD_TOLERANCE.items()}
"""Largest difference at a row's positions that padding columns after it may make, relative to the largest value of
the head's input (a wider product of the same rows rounds otherwise; a model that reads the columns after a row
moves by a percent or more)."""
NON_FINITE = "the model gave NaN/inf logits on the probe's rows (scoring names the text where it does so again)"
_FAILURES = (RuntimeError, TypeError, ValueError, AttributeError, IndexError, KeyError, AssertionError)
"""What a model that refuses the probe's inputs raises (a reason to fall back, not a crash)."""


def dtype_of(model: torch.nn.Module) -> torch.dtype:
    """The dtype of ``model``'s input embedding weights (what it computes in)."""
    return getattr(model, "get_input_embeddings")().weight.dtype  # noqa: B009 - torch types module attributes as tensors


def _reason(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        raise exc
    first = str(exc).splitlines()[0][:160] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"


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
    """How far one key moves a score: the largest, over the three shortest of ``units`` with at least 8 input tokens
    (the weights decide it, not the length; a long unshared row costs most), of the difference between the unit's
    unshared score and the same with the token four positions before its first target changed."""
    vocab = embedding_rows(model)
    chosen = sorted((u for u in units if u.input_length >= 8), key=lambda u: u.input_length)[:3]
    changed = []
    for unit in chosen:
        tokens = list(unit.tokens)
        at = len(tokens) - unit.n_score - 4
        tokens[at] = 3 + (tokens[at] - 2) % max(1, vocab - 3)
        changed.append(Unit(tuple(tokens), unit.n_score))
    if not chosen:
        return 0.0
    moved = np.abs(unshared_scores(model, chosen, device) - unshared_scores(model, changed, device))
    return float(moved.max())


def rounding(model: torch.nn.Module, device: torch.device, pad: int, paths: ModelPaths, length: int) -> float:
    """The rounding between two batch shapes of the same rows: two rows of ``length`` tokens (no padding) in one
    batch against each alone."""
    vocab = embedding_rows(model)
    case = same_length_case(CaseTokens(vocab), length)
    return _largest(case_scores(model, case, device, pad, paths), unshared_scores(model, case.units, device))


def run_cases(
    model: torch.nn.Module,
    every: Sequence[Case],
    device: torch.device,
    pad: int,
    paths: ModelPaths,
    rounding_length: int,
    moved: float | None = None,
) -> tuple[dict[str, str], dict[str, Any]]:
    """``(why each kind of case fails, evidence)``: ``every`` case on ``model`` against its unshared rows; a kind
    fails at its first case whose units differ by more than the tolerance or that raises. The tolerance is
    :data:`NOISE_FACTOR` times the rounding between two batch shapes of ``rounding_length`` tokens
    (:func:`rounding`), at least the compute dtype's :data:`FLOOR`; where one key moves scores by less than
    :data:`SENSITIVITY` tolerances, every kind fails. ``moved``: how far one key moves a score, already measured on
    the same weights in another dtype (a property of the weights; None: measured here, :func:`sensitivity`)."""
    failed: dict[str, str] = {}
    largest: dict[str, float] = {}
    if not every:
        return failed, {}
    dtype = dtype_of(model)
    try:
        noise = rounding(model, device, pad, paths, rounding_length)
    except _FAILURES as exc:
        why = f"two rows in one batch failed ({_reason(exc)})"
        return {case.kind: why for case in every}, {}
    tolerance = max(FLOOR.get(dtype, FLOOR[torch.float32]), NOISE_FACTOR * noise)
    try:
        if moved is None:
            moved = sensitivity(model, [case.units[i] for case in every for i in case.compared], device)
    except _FAILURES as exc:
        why = f"a row with one key changed failed ({_reason(exc)})"
        return {case.kind: why for case in every}, {}
    if not moved >= SENSITIVITY * tolerance:
        why = (
            f"one key moved a score by {moved:.3g} nats, rounding between batch shapes is {noise:.3g}: the probe "
            "cannot tell a wrong mask from rounding"
        )
        return {case.kind: why for case in every}, {"sensitivity": moved, "rounding": noise, "tolerance": tolerance}
    for case in every:
        if case.kind in failed:
            continue
        try:
            shared = case_scores(model, case, device, pad, paths)[case.compared]
            difference = _largest(shared, unshared_scores(model, [case.units[i] for i in case.compared], device))
        except NonFiniteLogitsError:
            failed[case.kind] = NON_FINITE
            continue
        except _FAILURES as exc:
            failed[case.kind] = f"{case.what} failed ({_reason(exc)})"
            continue
        largest[case.kind] = max(largest.get(case.kind, 0.0), difference)
        if not difference <= tolerance:
            failed[case.kind] = (
                f"{case.what} gave {difference:.3g} nats from the unshared rows (tolerance {tolerance:.3g})"
            )
    return failed, {"largest_difference": largest, "tolerance": tolerance, "rounding": noise, "sensitivity": moved}


@torch.no_grad()
def head_structure(model: torch.nn.Module, device: torch.device, output_map: OutputMap) -> str | None:
    """Whether ``model``'s logits are its output head of the body's last hidden state under ``output_map`` (None)
    or why not, on one short random row (the miniature answers for the architecture)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is None:
        return "the model has no output embeddings to apply at scored positions"
    ids = torch.arange(3, 27, device=device)[None] % max(4, embedding_rows(model))
    try:
        full = at_least_float32(model(input_ids=ids, use_cache=False).logits[0])
        hidden = body_of(model)(input_ids=ids, use_cache=False).last_hidden_state[0]
        mine = output_map.apply_(at_least_float32(head(hidden)).clone())
    except _FAILURES as exc:
        return f"computing the head alone failed ({_reason(exc)})"
    limit = HEAD_TOLERANCE.get(full.dtype, HEAD_TOLERANCE[torch.float32])
    if full.shape != mine.shape or not float((full - mine).abs().max()) <= limit * max(1.0, float(full.abs().max())):
        mapped = f" under {output_map.to_dict()}" if not output_map.identity else ""
        return f"its logits are not the output head of the last hidden state{mapped}"
    return None


@torch.no_grad()
def head_map(
    model: torch.nn.Module, device: torch.device, output_map: OutputMap, pad: int | None = None
) -> tuple[str | None, dict]:
    """On the real weights, one forward: whether the model's logits are its output head's result under
    ``output_map`` (the map the configuration declares; a scale kept in the weights would show here), and the largest
    relative difference measured. Without ``pad``, of one row of 8 tokens; with it, of two rows of 16 in one batch,
    the same 8 tokens followed by 8 padding tokens in one and by 8 other tokens in the other, and the evidence also
    holds ``padding_relative_difference``: how far those 8 positions' last hidden states differ between the two rows
    (every forward distperp runs has at least 16 positions, right-padded; a causal model's do not move).

    The map is elementwise, so a plain ``Linear`` head wider than :data:`NARROW_HEAD` rows is applied to that many
    of its rows (spread over the vocabulary, the first and last included) during the forward; where that forward does
    not pass, the whole head's decides."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is None:
        return "the model has no output embeddings to apply at scored positions", {}
    vocab = max(4, embedding_rows(model))
    ids = (torch.arange(8, device=device)[None] * 7919 + 3) % vocab
    batch = ids
    if pad is not None:
        batch = torch.cat(
            [torch.cat([ids, torch.full_like(ids, pad)], 1), torch.cat([ids, (ids * 31 + 11) % vocab], 1)]
        )
    rows = _narrow_rows(head)
    why, evidence, fed = _head_forward(model, head, batch, output_map, rows)
    if why is not None and rows is not None:
        why, evidence, fed = _head_forward(model, head, batch, output_map, None)
    if why is not None and fed is None and pad is not None:  # no padded batch on this model: the row alone
        return head_map(model, device, output_map)
    if fed is not None and pad is not None and fed.dim() == 3 and fed.shape[:2] == batch.shape:
        mine, theirs = at_least_float32(fed[1, :8]), at_least_float32(fed[0, :8])
        evidence["padding_relative_difference"] = float((theirs - mine).abs().max()) / max(1.0, float(mine.abs().max()))
    return why, evidence


NARROW_HEAD = 4096
"""Rows of a wider output head the real weights' head check applies (:func:`head_map`): a 262k-row head is most of
a short row's cost."""


def _narrow_rows(head: torch.nn.Module) -> torch.Tensor | None:
    """The rows :func:`head_map` keeps of ``head``, or None where it applies the whole head: a head that is not a plain
    ``Linear`` with a plain weight (quantized, sharded or offloaded), or no wider than :data:`NARROW_HEAD`."""
    weight = getattr(head, "weight", None)
    if not (type(head) is torch.nn.Linear and type(weight) is torch.nn.Parameter and type(weight.data) is torch.Tensor):
        return None
    if hasattr(head, "_hf_hook") or weight.device.type == "meta" or weight.shape[0] <= NARROW_HEAD:
        return None
    return torch.linspace(0, weight.shape[0] - 1, NARROW_HEAD, device=weight.device).round().long().unique()


@contextlib.contextmanager
def _narrowed(head: torch.nn.Module, rows: torch.Tensor | None) -> Iterator[None]:
    """``head`` (a plain ``Linear``, :func:`_narrow_rows`) computing only ``rows`` of its output while inside; its
    own weight and bias (tied or not) are back on leaving."""
    if rows is None:
        yield
        return
    linear = cast(torch.nn.Linear, head)
    weight, bias, out = linear.weight, linear.bias, linear.out_features
    linear.weight = torch.nn.Parameter(weight.detach().index_select(0, rows), requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias.detach().index_select(0, rows), requires_grad=False)
    linear.out_features = len(rows)
    try:
        yield
    finally:
        linear.weight, linear.bias, linear.out_features = weight, bias, out


def _head_forward(
    model: torch.nn.Module, head: torch.nn.Module, ids: torch.Tensor, output_map: OutputMap, rows: torch.Tensor | None
) -> tuple[str | None, dict, torch.Tensor | None]:
    """:func:`head_map`'s forward of ``ids`` with ``head`` narrowed to ``rows`` (None: whole): ``(why the logits are
    not the head's output under the map, or None; evidence; the head's input, None where the forward failed)``."""
    seen: list[torch.Tensor] = []
    fed: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        seen.append(out.detach())
        if args:
            fed.append(args[0].detach())

    hook = head.register_forward_hook(keep)
    try:
        with _narrowed(head, rows):
            full = at_least_float32(model(input_ids=ids, use_cache=False).logits)
    except _FAILURES as exc:
        return f"the model's forward failed on the probe ({_reason(exc)})", {}, None
    finally:
        hook.remove()
    if not bool(torch.isfinite(full).all()):
        return NON_FINITE, {}, None
    if len(seen) != 1 or seen[0].shape != full.shape:
        return "its output head is not applied once to every position", {}, None
    mine = output_map.apply_(at_least_float32(seen[0]).clone())
    difference = float((full - mine).abs().max()) / max(1.0, float(full.abs().max()))
    evidence: dict[str, Any] = {"head_relative_difference": difference}
    if rows is not None:
        evidence["head_rows_checked"] = len(rows)
    if not difference <= HEAD_TOLERANCE.get(seen[0].dtype, HEAD_TOLERANCE[torch.float32]):
        why = (
            f"its logits are not its head's output under {output_map.to_dict()} (relative difference "
            f"{difference:.3g} on the probe)"
        )
        return why, evidence, fed[0] if len(fed) == 1 else None
    return None, evidence, fed[0] if len(fed) == 1 else None


def padding_refusal(model: torch.nn.Module, evidence: dict) -> str | None:
    """Why ``model`` cannot be scored at all (its positions change with the columns that follow a row, as no causal
    LM's do: it reads the columns after a position), from :func:`head_map`'s evidence; None when they do not."""
    moved = evidence.get("padding_relative_difference")
    if moved is None or moved <= PAD_TOLERANCE.get(dtype_of(model), PAD_TOLERANCE[torch.float32]):
        return None
    return (
        "its last hidden states at a row's positions change when padding columns instead of tokens follow the row "
        f"(relative difference {moved:.3g} on the probe): it reads columns after a position, and every forward of "
        "distperp has at least 16 positions, right-padded"
    )
