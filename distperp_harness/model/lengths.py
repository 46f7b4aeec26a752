"""What a model reads of a forward's *length*: the rule that keeps a shared row's numbers those of its unshared row.

transformers' rotary embeddings (``dynamic_rope_update``) choose their frequencies from the longest position a
forward is given, ``max(position_ids) + 1``, once for every row of the batch:

* ``longrope`` (Phi-3, Phi-3.5): the long factors when that length exceeds the original context, the short ones
  otherwise: a batch (or a tree row, or a row continuing a cached prefix) whose longest path lies on the other side
  of the original context than a unit's own input scores that unit with the wrong factors;
* ``dynamic`` NTK: above the configured context the frequencies are recomputed for that very length, and kept
  (``max_seq_len_cached``) for later forwards: every length above it is a rule of its own, and a forward's numbers
  would depend on the forwards before it.

:class:`LengthRule` turns that into planning keys: rows, batches and cached prefixes never mix units whose inputs
have different keys (:meth:`LengthRule.keys`), so every unit's forward takes the choice its unshared row takes.
Lengths above ``exact_above`` key to themselves (negative keys): such a unit shares a forward only with units of
its exact input length, never a tree row, padding or a cached prefix. :func:`fresh_rope_each_forward` makes each
forward start from the configured frequencies, as a freshly loaded model would.
"""

from __future__ import annotations

import bisect
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from distperp_harness.model.attention import text_config


@dataclass(frozen=True)
class LengthRule:
    """Which input lengths may share a forward (module doc). ``sides``: lengths at which a model switches its
    choice (a length ``n`` is on side ``bisect_left(sides, n)``: at most the threshold, or past it); ``exact_above``:
    lengths above it share only with their own length (None: no such limit); ``why``: one line per limit, for the
    log and the record."""

    sides: tuple[int, ...] = ()
    exact_above: int | None = None
    why: tuple[str, ...] = ()

    @property
    def uniform(self) -> bool:
        """Every length may share with every other."""
        return not self.sides and self.exact_above is None

    def key(self, length: int) -> int:
        """The key of a forward whose longest path is ``length`` tokens: a side (>= 0), or ``-length``."""
        if self.exact_above is not None and length > self.exact_above:
            return -int(length)
        return bisect.bisect_left(self.sides, int(length))

    def keys(self, lengths: np.ndarray) -> np.ndarray:
        """:meth:`key` of each of ``lengths`` (int64)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        keys = np.searchsorted(np.asarray(self.sides, dtype=np.int64), lengths, side="left").astype(np.int64)
        if self.exact_above is not None:
            keys = np.where(lengths > self.exact_above, -lengths, keys)
        return keys

    def at_most(self, length: int, why: str) -> LengthRule:
        """This rule with every length above ``length`` keyed alone too (``why``: the reason, one line)."""
        if self.exact_above is not None and self.exact_above <= length:
            return self
        return LengthRule(tuple(s for s in self.sides if s < length), int(length), (*self.why, why))

    def merged(self, other: LengthRule) -> LengthRule:
        """The rule that keeps both rules' choices (forwards computed for two models at once: a reference)."""
        limits = [x for x in (self.exact_above, other.exact_above) if x is not None]
        exact = min(limits) if limits else None
        sides = tuple(sorted({s for s in (*self.sides, *other.sides) if exact is None or s < exact}))
        return LengthRule(sides, exact, tuple(dict.fromkeys((*self.why, *other.why))))

    def describe(self) -> str:
        return "; ".join(self.why) if self.why else "every length shares"

    def to_dict(self) -> dict[str, Any]:
        return {"sides": list(self.sides), "exact_above": self.exact_above, "why": list(self.why)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LengthRule:
        """The rule :meth:`to_dict` gave (an empty dict: every length shares)."""
        exact = data.get("exact_above")
        return cls(tuple(data.get("sides", ())), None if exact is None else int(exact), tuple(data.get("why", ())))


def _rope_dicts(config: Any) -> list[dict]:
    """The rotary settings of ``config``: one dict, or one per layer type (transformers 5 ``rope_parameters``;
    older ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    if all(isinstance(v, dict) for v in params.values()) and params:
        return list(params.values())
    return [params]


def declared_lengths(config: Any) -> LengthRule:
    """The :class:`LengthRule` ``config``'s rotary settings declare (module doc); uniform for every other model."""
    config = text_config(config)
    sides: set[int] = set()
    exact: int | None = None
    why: list[str] = []
    for rope in _rope_dicts(config):
        kind = str(rope.get("rope_type") or rope.get("type") or "default")
        if kind == "longrope":
            original = rope.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            if original and int(original) not in sides:
                sides.add(int(original))
                why.append(
                    f"longrope: rows of up to {int(original)} tokens (the original context) never share a forward with "
                    "longer rows"
                )
        elif "dynamic" in kind:
            context = int(getattr(config, "max_position_embeddings", 0) or 0)
            if context and (exact is None or context < exact):
                exact = context
                why.append(f"dynamic RoPE: rows longer than {context} tokens share a forward only with rows as long")
    return LengthRule(tuple(sorted(sides)), exact, tuple(why))


def _dynamic_prefixes(module: torch.nn.Module) -> list[str]:
    """The attribute prefixes of ``module``'s dynamic rotary frequencies ("" or "<layer type>_"), if any."""
    kinds = getattr(module, "rope_type", None)
    if isinstance(kinds, str):
        return [""] if "dynamic" in kinds and hasattr(module, "original_inv_freq") else []
    if isinstance(kinds, dict):
        return [f"{name}_" for name, kind in kinds.items() if "dynamic" in str(kind)]
    return []


def _restore(module: torch.nn.Module, args: Any) -> None:
    for prefix in _dynamic_prefixes(module):
        original = getattr(module, f"{prefix}original_inv_freq", None)
        if original is None:
            continue
        module.register_buffer(f"{prefix}inv_freq", original, persistent=False)
        setattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)


def fresh_rope_each_forward(model: torch.nn.Module) -> int:
    """Every dynamic rotary embedding of ``model`` starts each forward from its configured frequencies (a forward
    pre-hook; transformers otherwise keeps the frequencies of the longest forward so far): a forward's numbers then
    depend on its own inputs alone. Returns the number of modules hooked (0 for every other model); idempotent."""
    hooked = 0
    for module in model.modules():
        if not _dynamic_prefixes(module):
            continue
        if not getattr(module, "_distperp_fresh_rope", False):
            module.register_forward_pre_hook(_restore)
            module._distperp_fresh_rope = True  # type: ignore[assignment]  # a marker on the module
        hooked += 1
    return hooked


def _length_chosen(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a rotary embedding whose frequencies follow a forward's longest position."""
    kinds = getattr(module, "rope_type", None)
    named = kinds.values() if isinstance(kinds, dict) else [kinds]
    return any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in named)


def _plain_rope_forward(module: torch.nn.Module) -> Callable | None:
    """The function under transformers' ``dynamic_rope_update`` in ``module``'s class forward (whatever other
    decorators wrap it, ``torch.no_grad`` for one): the cosines and sines of given positions without choosing the
    frequencies. None where the class does not choose through ``dynamic_rope_update`` (it chooses inline)."""
    function: Any = type(module).forward
    while function is not None:
        code = getattr(function, "__code__", None)
        if code is not None and code.co_filename.endswith("modeling_rope_utils.py"):  # dynamic_rope_update's wrapper
            return inspect.unwrap(function)
        function = getattr(function, "__wrapped__", None)
    return None


def unsteerable_ropes(model: torch.nn.Module) -> list[str]:
    """The class names of ``model``'s length-chosen rotary embeddings :func:`rope_choice_from` cannot steer (their
    choice is made inside their own code)."""
    return sorted({type(m).__name__ for m in model.modules() if _length_chosen(m) and _plain_rope_forward(m) is None})


def rope_choice_from(model: torch.nn.Module, longest: Callable[[torch.Tensor], torch.Tensor | None]) -> int:
    """Every length-chosen rotary embedding of ``model`` (longrope, dynamic NTK) chooses its frequencies from
    ``longest(position_ids)`` where that gives a position (a forward split over a group: the longest position of the
    whole forward, which no single member's columns need hold), else from its own ``position_ids`` as transformers
    does; the cosines and sines are then those of its own positions. Returns the number of modules changed (0 for
    every other model; :func:`unsteerable_ropes` names those it cannot change); idempotent."""
    changed = 0
    for module in model.modules():
        plain = _plain_rope_forward(module) if _length_chosen(module) else None
        if plain is None:
            continue
        changed += 1
        if getattr(module, "_distperp_rope_choice", False):
            continue

        def forward(x: Any, position_ids: Any, *args: Any, _module: Any = module, _plain: Any = plain, **kwargs: Any):
            top = longest(position_ids)
            if top is None:
                return type(_module).forward(_module, x, position_ids, *args, **kwargs)
            # the choice (and its buffers) of the whole forward, then this forward's own positions
            with torch.no_grad():
                type(_module).forward(_module, x, top.reshape(1, 1).to(position_ids), *args, **kwargs)
                return _plain(_module, x, position_ids, *args, **kwargs)

        module.forward = forward  # an instance's forward: a hook cannot change what the decorated call reads
        module._distperp_rope_choice = True  # type: ignore[assignment]  # a marker on the module
    return changed
