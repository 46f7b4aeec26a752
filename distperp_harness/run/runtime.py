"""Run-time facts about the model that the plan weighs: the cost coefficients of a batch (attention, output head),
the longest tree row, and how ``loglikelihood`` units share rows (:func:`choose_sharing`). The token budget of
``batch_size=auto`` and the rows of a generation batch: :mod:`~distperp_harness.run.budget`.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from distperp_harness.distributed.protocol import Collective
from distperp_harness.distributed.testfaults import fail_for_tests
from distperp_harness.model.layers import matmul_params
from distperp_harness.model.lengths import LengthRule
from distperp_harness.options import BatchInvariant
from distperp_harness.planning.rows import ShareMode
from distperp_harness.run.rules import Batching, CachedPrefix, Sharing
from distperp_harness.run.scoring.engine.invariance import Invariance
from distperp_harness.run.scoring.engine.probe_cases import Target
from distperp_harness.run.scoring.engine.support import ModelPaths, paths_of


def attention_coefficient(model: torch.nn.Module) -> float:
    """``n_layers * hidden / body_params``: weight of the quadratic attention term in a batch's cost.

    With it, ``padded_tokens * (1 + coef * padded_length)`` is proportional to the multiply-adds of the layers:
    ``body_params`` per position plus ``n_layers * hidden * length`` for the scores and the weighted sum.
    """
    body, _, layers, hidden = matmul_params(model)
    return float(layers * hidden) / float(body)


def head_coefficient(model: torch.nn.Module) -> float:
    """``head_params / body_params``: the cost of one *scored* token (output head and log-softmax, which distperp
    computes only at scored positions) relative to one input position through the layers. For
    :func:`distperp_harness.planning.plan.batch_cost`'s ``head_coef``."""
    body, head, _, _ = matmul_params(model)
    return float(head) / float(body)


def row_budget(batching: Batching, max_length: int, attention_coef: float) -> tuple[int, str]:
    """``(tokens, why)``: the longest tree row (:mod:`distperp_harness.planning.rows`), from the batching rule and the
    model.

    ``batch_size=N`` promises N rows of at most ``max_length`` tokens, so rows stay within ``max_length``. A token
    budget (``auto``) lets rows grow to ``m * max_length`` tokens with ``m = floor(1 / (attention_coef *
    max_length))`` in ``1 .. MAX_ROW_FACTOR``: the longest row whose dense attention costs no more than its linear
    work; never above the token budget. Sibling runs share positions, so every path stays within ``max_length``.
    """
    from distperp_harness.model.memory import MAX_ROW_FACTOR

    if batching.token_budget is None:
        return max_length, f"batch_size={batching.batch_size}: rows of at most max_length={max_length} tokens"
    factor = int(1.0 / (attention_coef * max_length)) if attention_coef > 0 else MAX_ROW_FACTOR
    factor = max(1, min(MAX_ROW_FACTOR, factor))
    tokens = max(max_length, min(batching.token_budget, factor * max_length))
    return tokens, (
        f"batch_size=auto: {factor} x max_length={max_length} (dense attention at most the linear work, "
        f"attention coefficient {attention_coef:.3g}), within the token budget {batching.token_budget}"
    )


def probe_target(
    models: list[torch.nn.Module],
    batching: Batching,
    max_length: int,
    share_prefix: bool,
    invariant: tuple[bool, ...] = (False,),
) -> Target:
    """What a run's forwards will do (:class:`~distperp_harness.run.scoring.engine.probe_cases.Target`), in each
    mode it may end in (``invariant``: ``batch_invariant`` on, off, or either until its check): tree rows as wide
    as the row budget allows (:func:`row_budget`; none without ``share_prefix``; ``max_length`` when invariant,
    whatever the batching), several rows per batch unless ``batch_size=1``, cached prefixes with ``share_prefix``
    (a batch's, or when invariant its row group's, whatever the batching)."""
    tree = 0
    if share_prefix:
        budget = row_budget(batching, max_length, attention_coefficient(models[0]))[0] if False in invariant else 0
        tree = max(budget, max_length if True in invariant else 0)
    batched = batching.token_budget is not None or (batching.batch_size or 1) > 1
    return Target(max_length, tree, batched, share_prefix)


def decide_paths(
    collective: Collective, models: list[torch.nn.Module], device: torch.device, pad_token_id: int, target: Target
) -> list[ModelPaths]:
    """Each model's :class:`~distperp_harness.run.scoring.engine.support.ModelPaths` for a run doing ``target``,
    probed by every rank (a miniature of the model; on its real weights one short forward, every rank of a shard
    group together), merged so that every rank takes the same decision, and recorded for the forwards that follow."""
    from distperp_harness.model.sharding import gathered
    from distperp_harness.run.scoring.engine.probe import merge_paths, probe
    from distperp_harness.run.scoring.engine.support import record_paths

    decided = []
    for model in models:
        fail_for_tests(collective.rank, "probe")
        with gathered(model):
            mine = probe(model, device, pad_token_id, target)
        everyone = collective.all_gather_object(mine.to_dict(), "agree on the scoring paths")
        paths = merge_paths(everyone, mine)
        record_paths(model, paths)
        decided.append(paths)
    return decided


def invariance_blocked(
    wanted: BatchInvariant,
    compile_mode: str,
    cp_size: int | str,
    device_type: str,
    models: Sequence[torch.nn.Module] = (),
) -> str | None:
    """Why ``batch_invariant=auto`` is off before any check (``compile``, a context-parallel group, a device whose
    cost was not measured, a model with routed experts), or None (``true`` and ``false`` were validated with the
    options)."""
    from distperp_harness.model.row_products import routed_products

    if wanted is not BatchInvariant.AUTO:
        return None
    if compile_mode != "false":
        return f"compile={compile_mode} (a compiled graph's kernels depend on the shapes compiled before it)"
    if cp_size != 1:
        return f"cp_size={cp_size} (context parallelism splits rows over a group)"
    if device_type != "cpu":
        return (
            f"its cost and the kernels' row invariance on {device_type} are unmeasured (batch_invariant=true forces it)"
        )
    return next((why for why in map(routed_products, models) if why is not None), None)


def invariance_modes(wanted: BatchInvariant, blocked: str | None) -> tuple[bool, ...]:
    """Whether a run may end batch-invariant (``True``) or not (``False``), before its check: what
    :func:`probe_target` vouches for."""
    if wanted is BatchInvariant.ON:
        return (True,)
    return (True, False) if wanted is BatchInvariant.AUTO and blocked is None else (False,)


def decide_invariance(
    collective: Collective,
    models: list[torch.nn.Module],
    device: torch.device,
    pad_token_id: int,
    max_length: int,
    wanted: BatchInvariant,
    blocked: str | None = None,
) -> tuple[Invariance, str | None]:
    """How forwards hold their rows (:class:`~distperp_harness.run.scoring.engine.invariance.Invariance`) and why
    they are not batched with every row attending alone: batches as usual with ``batch_invariant=false`` or where
    ``auto`` is ``blocked`` (:func:`invariance_blocked`); else rows in batches, each attending alone, where every
    rank's :func:`~distperp_harness.run.scoring.engine.invariance.rows_check` passes on the loaded model(s); where a
    rank's does not, a forward per row (``true``) or batches as usual (``auto``), the same on every rank. Where rows
    go alone, every rank also measures which products of fewer than 16 rows compute as 16 do
    (:func:`~distperp_harness.model.row_products.measure_row_sizes`), and the sizes exact on every rank are recorded
    on every model for its decode steps (:func:`~distperp_harness.model.row_products.record_row_sizes`)."""
    from distperp_harness.model.row_products import RowSizes, measure_row_sizes, record_row_sizes
    from distperp_harness.model.sharding import gathered
    from distperp_harness.run.scoring.engine.invariance import merged, rows_check

    if wanted is BatchInvariant.OFF or blocked is not None:
        return Invariance.OFF, blocked
    fail_for_tests(collective.rank, "invariance")
    with gathered(*models):
        mine = rows_check(models[0], device, pad_token_id, max_length, models[1] if len(models) > 1 else None)  # type: ignore[arg-type]
        sizes = functools.reduce(RowSizes.merged, map(measure_row_sizes, models))
    everyone = collective.all_gather_object(
        (mine, sorted(sizes.exact)), "agree on how batch_invariant batches its rows"
    )
    invariance, why = merged([reason for reason, _ in everyone])
    agreed = functools.reduce(RowSizes.merged, (RowSizes(frozenset(exact)) for _, exact in everyone))
    for model in models:
        record_row_sizes(model, agreed)
    if invariance is Invariance.EACH_ROW and wanted is BatchInvariant.AUTO:  # auto never pays a forward per row
        return Invariance.OFF, why
    return invariance, why


def choose_sharing(
    share_prefix: bool,
    models: list[torch.nn.Module],
    batching: Batching,
    max_length: int,
    invariance: Invariance = Invariance.OFF,
) -> tuple[Sharing, str | None, str | None, str | None]:
    """How ``loglikelihood`` units share rows (``models``: the model and the reference, if any, their paths decided
    by :func:`decide_paths`): ``(sharing, why tree rows are off when a model cannot take their mask, how the row
    budget was chosen, the line to log at the first loglikelihood call)``. Under ``invariance``
    (``batch_invariant=true``): rows of at most ``max_length`` tokens whatever the batching, and the prefix a batch
    computes once is its row group's (:attr:`CachedPrefix.GROUP`; none where each row is a forward of its own)."""
    lengths = length_rule(models)
    if not share_prefix:
        return Sharing(ShareMode.OFF, lengths=lengths), None, None, None
    paths = [paths_of(m) for m in models]
    widest = min((p.tree_tokens for p in paths if p.tree_tokens), default=None)
    why = next((p.packed_rows for p in paths if p.packed_rows), None)
    if why is not None:
        line = (
            f"shared-prefix rows are off: {why}; units with the same input still share a row, every other answer "
            "gets a row of its own"
        )
        return Sharing(ShareMode.INPUTS, max_length, lengths=lengths), why, None, line
    uncached = next((p.cached_prefix for p in paths if p.cached_prefix), None)
    if invariance is not Invariance.OFF:
        tokens = min(max_length, widest or max_length)
        how = f"batch-invariant: rows of at most {tokens} tokens (max_length={max_length}) whatever the batching"
        cached = CachedPrefix.GROUP if uncached is None and not invariance.row_at_a_time else CachedPrefix.NONE
        line = f"tree rows ({how}; cached prefix: {cached.value})"
        return Sharing(ShareMode.PREFIX, tokens, cached, lengths), None, how, line
    tokens, how = row_budget(batching, max_length, attention_coefficient(models[0]))
    if widest is not None and widest < tokens:
        tokens, how = widest, f"{how}; at most {widest} tokens, the widest tree row the probe vouched for"
    line = f"tree rows of at most {tokens} tokens ({how})" + ("" if uncached is None else f"; {uncached}")
    cached = CachedPrefix.BATCH if uncached is None else CachedPrefix.NONE
    return Sharing(ShareMode.PREFIX, tokens, cached, lengths), None, how, line


def length_rule(models: list[torch.nn.Module]) -> LengthRule:
    """The :class:`~distperp_harness.model.lengths.LengthRule` every forward of ``models`` keeps (their decided
    paths' rules merged): a call's rows, batches and cached prefixes follow it, rolling windows included."""
    rule = LengthRule()
    for model in models:
        rule = rule.merged(paths_of(model).lengths)
    return rule
