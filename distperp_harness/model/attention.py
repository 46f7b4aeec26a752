"""What a model's configuration declares about how its layers attend and how its logits follow from its output head.

Declarations only, read from transformers' own configuration (``layer_types``, ``sliding_window``,
``attention_chunk_size``, the final logit maps): :mod:`distperp_harness.run.scoring.engine.probe` confirms them on the
loaded weights before scoring relies on them.

* :class:`AttentionLayout`: the rule each layer type adds to causality (a sliding window, a chunk) and whether the
  model takes one mask per layer type (a mapping, as transformers' models with ``layer_types`` do) or one mask for
  every layer. A layer type that attends by anything but a mask (linear attention, state spaces) has no layout.
* :class:`OutputMap`: the elementwise map from the head's output to the logits (a division, a scale, a final
  soft-cap), applied in float32 at the scored positions only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MASKED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""transformers' layer types whose attention is a causal mask, possibly with a window or a chunk."""


@dataclass(frozen=True)
class LayerAttention:
    """What one layer type adds to causal attention: keys fewer than ``window`` positions back
    (``q - k < window``, transformers' ``sliding_window_overlay``), or keys in the query's chunk of ``chunk``
    positions (``q // chunk == k // chunk``). Neither: full causal attention."""

    window: int | None = None
    chunk: int | None = None

    @property
    def span(self) -> int:
        """Positions after which the rule starts to hide keys (0: never)."""
        return int(self.window or self.chunk or 0)

    def within(self, max_length: int) -> LayerAttention:
        """The same rule on paths of at most ``max_length`` positions: a window or chunk at least that long never
        hides a key there, so it is full attention."""
        return FULL if self.span >= max_length else self

    def allows(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor | None:
        """Whether a query at ``query_pos`` may see a key at ``key_pos`` (broadcast), besides causality and the
        tree; None when the rule hides nothing."""
        if self.window:
            return (query_pos - key_pos) < self.window
        if self.chunk:
            return torch.div(query_pos, self.chunk, rounding_mode="floor") == torch.div(
                key_pos, self.chunk, rounding_mode="floor"
            )
        return None

    def describe(self) -> str:
        if self.window:
            return f"window {self.window}"
        return f"chunk {self.chunk}" if self.chunk else "full"


FULL = LayerAttention()


@dataclass(frozen=True)
class AttentionLayout:
    """The masks a model's layers take: ``kinds`` is each layer type with its rule, in order of first appearance;
    ``keyed``: the model takes a mapping from layer type to mask (its layer types differ in rule), else one mask
    serves every layer."""

    kinds: tuple[tuple[str, LayerAttention], ...]
    keyed: bool

    @property
    def rules(self) -> tuple[LayerAttention, ...]:
        """The distinct rules, in order of first appearance (one mask each)."""
        return tuple(dict.fromkeys(rule for _, rule in self.kinds))

    @property
    def span(self) -> int:
        """The longest window or chunk (0: every layer attends fully)."""
        return max((rule.span for rule in self.rules), default=0)

    def within(self, max_length: int) -> AttentionLayout:
        """This layout on paths of at most ``max_length`` positions (:meth:`LayerAttention.within`); it stays keyed
        only while its rules still differ."""
        kinds = tuple((name, rule.within(max_length)) for name, rule in self.kinds)
        return AttentionLayout(kinds, self.keyed and len({rule for _, rule in kinds}) > 1)

    def without_rules(self) -> AttentionLayout:
        """Every layer type with full attention: the probe's wrong alternative, to show a window matters."""
        return AttentionLayout(tuple((name, FULL) for name, _ in self.kinds), self.keyed)

    def describe(self) -> str:
        return ", ".join(f"{name}: {rule.describe()}" for name, rule in self.kinds)

    def to_dict(self) -> dict[str, Any]:
        return {"layer_types": {name: rule.describe() for name, rule in self.kinds}, "keyed": self.keyed}


def text_config(config: Any) -> Any:
    """The decoder's text configuration of ``config`` (itself for plain causal LMs)."""
    getter = getattr(config, "get_text_config", None)
    if getter is None:
        return config
    try:
        return getter(decoder=True)
    except TypeError:  # older signatures
        return getter()


def _per_layer(config: Any) -> tuple[list[str], list[dict]]:
    """transformers' own reading of the layer types and their cache arguments (windows, chunks), or the config's
    ``layer_types`` / ``sliding_window`` / ``attention_chunk_size`` where that helper is missing."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        inferred, kwargs = get_layer_types_and_kwargs(config)
    except (ImportError, AttributeError, TypeError):
        layers = int(getattr(config, "num_hidden_layers", 0) or 0)
        window, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
        inferred = ["sliding_attention" if window else "chunked_attention" if chunk else "full_attention"] * layers
        kwargs = [{"sliding_window": window or chunk}] * layers
    names = list(getattr(config, "layer_types", None) or inferred)  # KV-sharing layers keep their own type here
    return names, list(kwargs) + [{}] * (len(names) - len(kwargs))


def declared_layout(config: Any) -> AttentionLayout | str:
    """The :class:`AttentionLayout` ``config`` declares, or why its layers cannot take a tree mask (a layer type
    other than :data:`MASKED_LAYER_TYPES`, or layers of one type with different windows)."""
    config = text_config(config)
    names, kwargs = _per_layer(config)
    if not names:
        return "its configuration declares no layers"
    rules: dict[str, LayerAttention] = {}
    for name, extra in zip(names, kwargs):
        if name not in MASKED_LAYER_TYPES:
            return f"its {name!r} layers attend by more than a mask (they take no tree mask)"
        span = extra.get("sliding_window")
        if name == "sliding_attention":
            rule = LayerAttention(window=int(span or getattr(config, "sliding_window", 0) or 0) or None)
        elif name == "chunked_attention":
            rule = LayerAttention(chunk=int(span or getattr(config, "attention_chunk_size", 0) or 0) or None)
        else:
            rule = FULL
        if name != "full_attention" and rule == FULL:
            return f"its {name!r} layers declare no window or chunk size"
        if rules.setdefault(name, rule) != rule:
            return f"its {name!r} layers have different windows ({rules[name].describe()}, {rule.describe()})"
    kinds = tuple(rules.items())
    return AttentionLayout(kinds, keyed=len(set(rules.values())) > 1)


@dataclass(frozen=True)
class OutputMap:
    """The elementwise map from the output head's result to the model's logits, in the model's order: divide by
    ``divide`` (Granite's ``logits_scaling``), multiply by ``multiply`` (Cohere's ``logit_scale``), then the final
    soft-cap ``softcap * tanh(x / softcap)`` (Gemma's ``final_logit_softcapping``)."""

    divide: float | None = None
    multiply: float | None = None
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.divide is None and self.multiply is None and self.softcap is None

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """The map applied in place to ``logits`` (float32 or wider), which it returns."""
        if self.divide is not None:
            logits.div_(self.divide)
        if self.multiply is not None:
            logits.mul_(self.multiply)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("divide", self.divide), ("multiply", self.multiply), ("softcap", self.softcap)) if v}


def declared_output_map(config: Any) -> OutputMap:
    """The :class:`OutputMap` ``config`` declares (attributes left at their neutral value count as absent)."""
    config = text_config(config)

    def number(name: str, neutral: float) -> float | None:
        value = getattr(config, name, None)
        return None if value is None or isinstance(value, bool) or float(value) == neutral else float(value)

    return OutputMap(number("logits_scaling", 1.0), number("logit_scale", 1.0), number("final_logit_softcapping", 0.0))
