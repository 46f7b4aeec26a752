"""What scoring and generation may do with a model: :class:`ModelPaths`, decided at load by probing the weights
(:mod:`~distperp_harness.run.scoring.engine.probe`) and kept here per model for every forward that follows.

Three questions, each answered ``None`` (yes) or with why not:

* **packed rows**: does a tree attention mask with position ids (:mod:`~distperp_harness.run.scoring.engine.masks`,
  one mask per layer type where the layers differ) give the results of unshared rows? Else every answer gets a row of
  its own (units with the same input still share one);
* **cached prefix**: can rows continue a prefix's key/value cache (all layers kept whole, windows applied by the
  mask)? Else each row computes its batch's common prefix itself;
* **head**: are the logits the output head of the last hidden state under the config's elementwise map
  (:class:`~distperp_harness.model.attention.OutputMap`)? Then only scored positions go through the head; else the
  model's full logits are computed and the scored positions read from them.

A model nobody probed (a direct caller of the engine) gets :func:`declared_paths`: transformers' declarations taken
at their word. ``DistPerpLM`` always probes.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from distperp_harness.model.attention import AttentionLayout, OutputMap, declared_layout, declared_output_map
from distperp_harness.model.lengths import LengthRule, declared_lengths

DENSE_IMPLEMENTATIONS = ("sdpa", "eager")
"""Attention implementations that take a dense 4D mask (flex attention takes a block mask; flash attention none)."""


@dataclass(frozen=True)
class ModelPaths:
    """What the engine may do with one model (module doc). ``layout``: the masks its layers take (None when no
    layer takes a tree mask); ``packed_rows``, ``cached_prefix``, ``head_only``: None when allowed, else why not;
    ``output_map``: the map from head to logits; ``lengths``: which input lengths may share a forward
    (:class:`~distperp_harness.model.lengths.LengthRule`); ``tree_tokens``: the widest tree row the probe vouched
    for (None: no limit of its own); ``probed``: decided by a probe (False: declarations only); ``evidence``: what
    the probe measured (largest differences, in nats), for the record."""

    layout: AttentionLayout | None
    packed_rows: str | None
    cached_prefix: str | None
    head_only: str | None
    output_map: OutputMap = OutputMap()
    lengths: LengthRule = LengthRule()
    tree_tokens: int | None = None
    probed: bool = False
    evidence: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def dense_masks(self) -> bool:
        """Whether generation may pass this model its own 4D masks (packed rows allowed: the model takes them)."""
        return self.packed_rows is None and self.layout is not None

    def line(self) -> str:
        """The one log line of the decision."""
        how = "probed on a float64 miniature" if self.probed else "from the model's declarations"
        widest = f" of at most {self.tree_tokens} tokens" if self.tree_tokens else ""
        parts = [
            "packed rows" + widest + (f" ({self.layout.describe()})" if self.layout and self.layout.span else "")
            if self.packed_rows is None
            else f"no packed rows ({self.packed_rows})",
            "cached prefix" if self.cached_prefix is None else f"no cached prefix ({self.cached_prefix})",
            ("head only where scored" + (f" with {self.output_map.to_dict()}" if not self.output_map.identity else ""))
            if self.head_only is None
            else f"full logits ({self.head_only})",
        ]
        if not self.lengths.uniform:
            parts.append(self.lengths.describe())
        return f"scoring paths, {how}: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "probed": self.probed,
            "layout": self.layout.to_dict() if self.layout else None,
            "packed_rows": self.packed_rows is None,
            "packed_rows_fallback": self.packed_rows,
            "cached_prefix": self.cached_prefix is None,
            "cached_prefix_fallback": self.cached_prefix,
            "head_only_where_scored": self.head_only is None,
            "head_fallback": self.head_only,
            "output_map": self.output_map.to_dict(),
            "lengths": self.lengths.to_dict(),
            "tree_tokens": self.tree_tokens,
            "evidence": self.evidence,
        }


def implementation_refuses(model: torch.nn.Module) -> str | None:
    """Why ``model``'s attention implementation cannot take a tree mask at all (None: it can be probed): sdpa and
    eager take a dense mask; flex attention a block mask where transformers implements it for the model, and not on
    CUDA (tree rows there chose other answers than sdpa's, unresolved); flash attention takes no custom mask."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl == "flex_attention" and getattr(getattr(model, "device", None), "type", None) == "cuda":
        return (
            "flex_attention on CUDA: its tree rows chose other answers than sdpa's there (log-likelihoods up to "
            "0.084 apart, one H200), so each answer gets a row of its own; attn_implementation=sdpa shares prefixes"
        )
    if impl == "flex_attention" and not getattr(model, "_supports_flex_attn", False):
        name = type(model).__name__
        return f"transformers has no flex_attention for {name} (attn_implementation=sdpa takes the mask)"
    if impl not in (*DENSE_IMPLEMENTATIONS, "flex_attention"):
        return (
            f"attention implementation {impl!r} does not take a custom attention mask (sdpa and eager take a "
            f"dense one, flex_attention a block mask)"
        )
    return None


def implementation_refuses_cache(model: torch.nn.Module) -> str | None:
    """Why rows cannot continue a cached prefix under ``model``'s attention implementation (None: they may, if the
    probe agrees). flex_attention: its block mask over queries that continue a cached prefix gave non-finite logits
    (transformers 5.24, torch 2.13, CPU), so those rows carry the prefix themselves (same results, more tokens)."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "flex_attention":
        return "flex_attention: each tree row computes the batch's common prefix itself (not from a cached prefix)"
    return None


def declared_paths(model: torch.nn.Module, max_length: int | None = None) -> ModelPaths:
    """:class:`ModelPaths` from transformers' declarations alone (no forward): the declared layout (within
    ``max_length`` when given) if the attention implementation takes a mask, the declared output map."""
    config = getattr(model, "config", None)
    layout = declared_layout(config) if config is not None else "no configuration"
    packed = implementation_refuses(model) or (layout if isinstance(layout, str) else None)
    usable = None if isinstance(layout, str) else layout
    if usable is not None and max_length:
        usable = usable.within(max_length)
    has_head = getattr(model, "get_output_embeddings", lambda: None)() is not None
    return ModelPaths(
        layout=usable,
        packed_rows=packed,
        cached_prefix=implementation_refuses_cache(model) or packed,
        head_only=None if has_head else "the model has no output embeddings to apply at scored positions",
        output_map=declared_output_map(config) if config is not None else OutputMap(),
        lengths=declared_lengths(config) if config is not None else LengthRule(),
    )


_PATHS: weakref.WeakKeyDictionary[torch.nn.Module, ModelPaths] = weakref.WeakKeyDictionary()


def record_paths(model: torch.nn.Module, paths: ModelPaths) -> None:
    """Keep ``paths`` as ``model``'s for every later forward (:func:`paths_of`)."""
    _PATHS[model] = paths


def recorded_paths(model: torch.nn.Module) -> ModelPaths | None:
    """``model``'s recorded :class:`ModelPaths` (None: none, or an object that cannot be weakly referenced)."""
    try:
        return _PATHS.get(model)
    except TypeError:
        return None


def paths_of(model: torch.nn.Module) -> ModelPaths:
    """``model``'s recorded :class:`ModelPaths`, or :func:`declared_paths` when none was recorded."""
    recorded = recorded_paths(model)
    return recorded if recorded is not None else declared_paths(model)


@contextlib.contextmanager
def trying_paths(model: torch.nn.Module, paths: ModelPaths) -> Iterator[None]:
    """Within the block, ``model``'s forwards follow ``paths`` (the probe trying a verdict); the recorded paths, if
    any, come back after it."""
    before = _PATHS.get(model)
    _PATHS[model] = paths
    try:
        yield
    finally:
        if before is None:
            _PATHS.pop(model, None)
        else:
            _PATHS[model] = before
