"""Run-time facts about the model that the plan weighs: the cost coefficients of a batch (attention, output head),
the longest tree row, and how ``loglikelihood`` units share rows (:func:`choose_sharing`). The token budget of
``batch_size=auto`` and the rows of a generation batch: :mod:`~distperp_harness.run.budget`.
"""

from __future__ import annotations

import torch

from distperp_harness.planning.rows import ShareMode
from distperp_harness.run.rules import Batching, Sharing


def _matmul_params(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """``(body params, head params, layers, hidden)``: parameters every input position multiplies through (all but
    the input and output embeddings), those of the output head alone, and the config's depth and width."""
    config = getattr(model, "config", None)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    params = sum(p.numel() for p in model.parameters())
    embeddings: dict[int, int] = {}  # by object identity: tied input/output weights are one parameter
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):  # quantized (tensor subclass) weights too; numel is the logical size
            embeddings[id(weight)] = weight.numel()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    head_weight = getattr(head, "weight", None)
    head_params = int(head_weight.numel()) if isinstance(head_weight, torch.Tensor) else 0
    body = params - sum(embeddings.values())
    return max(body, 1), head_params, layers, hidden


def attention_coefficient(model: torch.nn.Module) -> float:
    """``n_layers * hidden / body_params``: weight of the quadratic attention term in a batch's cost.

    With it, ``padded_tokens * (1 + coef * padded_length)`` is proportional to the multiply-adds of the layers:
    ``body_params`` per position plus ``n_layers * hidden * length`` for the scores and the weighted sum.
    """
    body, _, layers, hidden = _matmul_params(model)
    return float(layers * hidden) / float(body)


def head_coefficient(model: torch.nn.Module) -> float:
    """``head_params / body_params``: the cost of one *scored* token (output head and log-softmax, which distperp
    computes only at scored positions) relative to one input position through the layers. For
    :func:`distperp_harness.planning.plan.batch_cost`'s ``head_coef``."""
    body, head, _, _ = _matmul_params(model)
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


def choose_sharing(
    share_prefix: bool,
    models: list[torch.nn.Module],
    batching: Batching,
    max_length: int,
    batch_invariant: bool = False,
) -> tuple[Sharing, str | None, str | None, str | None]:
    """How ``loglikelihood`` units share rows (``models``: the model and the reference, if any): ``(sharing, why
    tree rows are off when a model cannot take their mask, how the row budget was chosen, the line to log at the
    first loglikelihood call)``. ``batch_invariant``: rows of at most ``max_length`` tokens whatever the batching,
    and no prefix shared across a batch's rows (each row is computed alone)."""
    from distperp_harness.run.scoring.engine.support import cached_prefix_unsupported, packed_rows_unsupported

    if not share_prefix:
        return Sharing(ShareMode.OFF), None, None, None
    why = next((r for r in (packed_rows_unsupported(m, max_length) for m in models) if r), None)
    if why is not None:
        line = (
            f"shared-prefix rows are off: {why}; units with the same input still share a row, every other answer "
            "gets a row of its own"
        )
        return Sharing(ShareMode.INPUTS, max_length), why, None, line
    if batch_invariant:
        tokens, how = max_length, f"batch_invariant=true: rows of at most max_length={max_length} tokens, each alone"
        return Sharing(ShareMode.PREFIX, tokens, cached_prefix=False), None, how, f"tree rows ({how})"
    tokens, how = row_budget(batching, max_length, attention_coefficient(models[0]))
    cached = not any(cached_prefix_unsupported(m) for m in models)
    line = f"tree rows of at most {tokens} tokens ({how})" + (
        "" if cached else "; " + next(r for r in map(cached_prefix_unsupported, models) if r)
    )
    return Sharing(ShareMode.PREFIX, tokens, cached), None, how, line
