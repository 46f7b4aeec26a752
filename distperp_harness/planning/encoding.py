"""Batched tokenization: many strings through one call of a fast tokenizer, the same ids as one ``encode`` each.

A fast (Rust) tokenizer encodes a batch in one call, on every core unless ``TOKENIZERS_PARALLELISM=false``; a
Python loop of ``encode`` pays the call's overhead per string and uses one core. lm-eval tokenizes request by
request; distperp collects the strings a call will need and encodes them here first (``Tokenization.pre_encode``,
generation's ``local_jobs``).

A few-shot block shared by a task's questions is tokenized once (:func:`shared_prefix_groups`,
:class:`PrefixSplit`): strings sharing a prefix of at least ``MIN_SHARED_CHARS`` characters are cut at the last
position of that prefix where the tokenizer's own pipeline provably keeps every string's ids the ids of the part
before the cut followed by those of its own tail encoded alone
(:func:`~distperp_harness.planning.tokenizer_cuts.find_cut`: a proof from the pipeline's parts, for every string,
not a sample). A group with no such position, and every string of a tokenizer whose pipeline proves none, is
encoded whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from distperp_harness.planning.rows import common_prefix_length as _common  # works on strings as on ids
from distperp_harness.planning.tokenizer_cuts import Cut, CutKind, find_cut, pipeline_of

CHUNK = 1024
"""Strings per tokenizer call (bounds the batch's transient memory)."""
MIN_SHARED_CHARS = 256
"""The shortest shared prefix worth tokenizing once."""
MIN_GROUP = 8
"""The fewest strings sharing a prefix worth it."""

log = logging.getLogger(__name__)


def encode_many(tokenizer: Any, strings: Sequence[str], **special: Any) -> list[list[int]]:
    """Token ids of each string, equal to ``tokenizer.encode(string, **special)``; a slow tokenizer encodes them one
    by one."""
    if not getattr(tokenizer, "is_fast", False):
        return [tokenizer.encode(s, **special) for s in strings]
    out: list[list[int] | None] = [None] * len(strings)
    if local_pipeline(tokenizer) is None:
        for members, shared in shared_prefix_groups(strings):
            group = [strings[i] for i in members]
            split = PrefixSplit.find(tokenizer, group, shared, special)
            if split is None:
                continue
            for i, ids in zip(members, split.encode(group)):
                out[i] = ids
    rest = [i for i, ids in enumerate(out) if ids is None]
    for i, ids in zip(rest, _batched(tokenizer, [strings[i] for i in rest], **special)):
        out[i] = ids
    return out  # type: ignore[return-value]  # every slot is filled above


def _batched(tokenizer: Any, strings: list[str], **special: Any) -> list[list[int]]:
    out: list[list[int]] = []
    for start in range(0, len(strings), CHUNK):
        out += [list(ids) for ids in tokenizer(strings[start : start + CHUNK], **special)["input_ids"]]
    return out


def local_pipeline(tokenizer: Any) -> str | None:
    """None when ``tokenizer``'s pipeline can prove cuts (:mod:`~distperp_harness.planning.tokenizer_cuts`);
    else why it cannot (its strings are then encoded whole)."""
    pipeline = pipeline_of(tokenizer)
    return pipeline if isinstance(pipeline, str) else None


def shared_prefix_groups(
    strings: Sequence[str], min_chars: int | None = None, min_group: int | None = None
) -> list[tuple[list[int], int]]:
    """Groups of at least ``min_group`` strings (their indices) that share a prefix of at least ``min_chars``
    characters, with its length: neighbours in sorted order, joined while their common prefix is long enough
    (defaults: ``MIN_GROUP``, ``MIN_SHARED_CHARS`` as they are at the call)."""
    min_chars = MIN_SHARED_CHARS if min_chars is None else min_chars
    min_group = MIN_GROUP if min_group is None else min_group
    order = sorted(range(len(strings)), key=strings.__getitem__)
    groups: list[tuple[list[int], int]] = []
    members: list[int] = []
    shared = 0
    for index in order:
        if members:
            common = _common(strings[members[-1]], strings[index])
            if common >= min_chars:
                members.append(index)
                shared = min(shared, common)
                continue
            if len(members) >= min_group:
                groups.append((members, shared))
        members, shared = [index], len(strings[index])
    if len(members) >= min_group:
        groups.append((members, shared))
    return groups


@dataclass(frozen=True)
class PrefixSplit:
    """Strings cut at character ``cut`` of their shared prefix (a position :func:`find_cut` proved): ``head`` is the
    ids of what comes before it, special tokens included; a string's ids are ``head`` + its tail's ids encoded
    alone."""

    tokenizer: Any
    head: tuple[int, ...]
    cut: int
    kind: CutKind

    @classmethod
    def find(cls, tokenizer: Any, group: list[str], shared: int, special: Mapping[str, Any]) -> PrefixSplit | None:
        """The split of ``group`` (strings sharing ``shared`` characters) at :func:`find_cut`'s position; None when
        there is none. Its one check, the shortest string against its whole encode, guards the implementation:
        exactness comes from the proof."""
        cut = cls.choose(tokenizer, group[0][:shared], special, group)
        if cut.position is None or cut.kind is None:
            return None
        head = _batched(tokenizer, [group[0][: cut.position]], **special)[0]
        split = cls(tokenizer, tuple(head), cut.position, cut.kind)
        shortest = min(group, key=len)
        if split.encode([shortest]) != _batched(tokenizer, [shortest], **special):
            log.warning("a proved cut (%s at %d) changed the ids of %r; encoding its group whole", cut.kind.value,
                        cut.position, shortest[:80])  # fmt: skip
            return None
        return split

    @staticmethod
    def choose(tokenizer: Any, prefix: str, special: Mapping[str, Any], group: Sequence[str] = ()) -> Cut:
        """:func:`find_cut` (where the split of ``group``, strings sharing ``prefix``, would cut, or why it would
        not): the group's own continuations read."""
        return find_cut(tokenizer, prefix, special, group)

    def encode(self, strings: list[str]) -> list[list[int]]:
        head = list(self.head)
        tails = _batched(self.tokenizer, [s[self.cut :] for s in strings], add_special_tokens=False)
        return [head + tail for tail in tails]
