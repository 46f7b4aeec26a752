"""Requests → scoring units: the token sequences the model actually scores.

A :class:`Unit` is ``tokens`` (model input ``tokens[:-1]``, targets ``tokens[1:]``) of which only the last
``n_score`` targets are scored. Every request kind reduces to units:

* ``loglikelihood(context, continuation)``: one unit, ``(context + continuation)[-(max_length + 1):]``
  scoring the continuation (lm-eval's ``hf`` rule, left truncation included);
* ``loglikelihood_rolling(text)``: strided windows over ``seq = [prefix] + tokens`` (see :func:`window_units`);
  with ``stride == max_length`` these are exactly lm-eval's disjoint rolling windows.

Identical units are scored once: :class:`UnitTable` deduplicates them and fixes a canonical order
(longest first, then by token content) that depends only on the *set* of units, never on which process
found them — the basis of world-size-independent results. Everything here is pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class Unit:
    """One scored token sequence: feed ``tokens[:-1]``, score the last ``n_score`` of ``tokens[1:]``."""

    tokens: tuple[int, ...]
    n_score: int

    def __post_init__(self) -> None:
        if not 1 <= self.n_score <= len(self.tokens) - 1:
            raise ValueError(f"a unit of {len(self.tokens)} tokens cannot score {self.n_score} targets")

    @property
    def input_length(self) -> int:
        return len(self.tokens) - 1

    def key(self) -> bytes:
        """Compact identity: token ids as int64 bytes plus the scored count."""
        return np.asarray(self.tokens, dtype=np.int64).tobytes() + int(self.n_score).to_bytes(8, "little")


def continuation_unit(context: Sequence[int], continuation: Sequence[int], max_length: int) -> Unit:
    """The unit scoring ``continuation`` after ``context``, left-truncated to ``max_length`` input tokens.

    Raises:
        ValueError: if the context is empty or the continuation is empty or longer than ``max_length``.
    """
    if len(context) == 0:
        raise ValueError("a continuation needs at least one context token (lm-eval uses the prefix token)")
    if not 1 <= len(continuation) <= max_length:
        raise ValueError(
            f"continuation of {len(continuation)} tokens cannot be scored with max_length={max_length}; "
            "raise max_length or shorten the continuation"
        )
    whole = list(context) + list(continuation)
    return Unit(tuple(whole[-(max_length + 1) :]), len(continuation))


def window_units(tokens: Sequence[int], prefix_token: int, max_length: int, stride: int | None = None) -> list[Unit]:
    """Strided windows scoring every token of ``tokens`` exactly once.

    With ``seq = [prefix_token] + tokens`` and ``n = len(tokens)``, block ``k`` (``s = k * stride``,
    ``e = min(s + stride, n)``) scores ``seq[s+1 .. e]`` from the input ``seq[max(0, e - max_length) : e]``.
    ``stride == max_length`` (the default) reproduces lm-eval's rolling windows; a smaller stride gives every
    scored token at least ``max_length - stride`` tokens of context. An empty ``tokens`` gives no units.
    """
    stride = max_length if stride is None else stride
    if not 0 < stride <= max_length:
        raise ValueError(f"stride={stride} is not valid: need 0 < stride <= max_length ({max_length})")
    seq = [prefix_token, *tokens]
    n = len(tokens)
    units = []
    for s in range(0, n, stride):
        e = min(s + stride, n)
        units.append(Unit(tuple(seq[max(0, e - max_length) : e + 1]), e - s))
    return units


class UnitTable:
    """Deduplicated units in canonical order: longer inputs first, then by token content.

    The order is a function of the *set* of units only, so every process that builds a table from the same
    units (in any order, with any duplicates) gets the same ids.
    """

    def __init__(self, units: Iterable[Unit]) -> None:
        index: dict[bytes, Unit] = {}
        for unit in units:
            index.setdefault(unit.key(), unit)
        order = sorted(index, key=lambda k: (-index[k].input_length, k))
        self._position = {key: i for i, key in enumerate(order)}
        self.units: list[Unit] = [index[k] for k in order]

    def __len__(self) -> int:
        return len(self.units)

    def ids(self, units: Iterable[Unit]) -> list[int]:
        """Canonical ids of ``units`` (each must be in the table)."""
        return [self._position[u.key()] for u in units]

    @property
    def lengths(self) -> list[int]:
        """Model input length of every unit, in canonical order."""
        return [u.input_length for u in self.units]
