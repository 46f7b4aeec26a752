"""Batched tokenization: many strings through one call of a fast tokenizer, the same ids as one ``encode`` each.

A fast (Rust) tokenizer encodes a batch in one call, on every core unless ``TOKENIZERS_PARALLELISM=false``; a
Python loop of ``encode`` pays the call's overhead per string and uses one core. lm-eval tokenizes request by
request; distperp collects the strings a call will need and encodes them here first (``Tokenization.pre_encode``,
generation's ``local_jobs``).

Text that many strings share is tokenized once (:class:`PieceEncoder`): strings sharing a prefix of at least
``MIN_SHARED_CHARS`` characters (:func:`shared_prefix_groups`) are cut at the last position of that prefix where the
tokenizer's own pipeline provably keeps every string's ids the ids of the part before the cut followed by those of
its tail encoded alone (:func:`~distperp_harness.planning.tokenizer_cuts.find_cut`: a proof from the pipeline's
parts, for every string, not a sample); the part before is a *piece*, encoded once. The tails are grouped again the
same way, level after level, all groups' tails together: a few-shot block whose examples lm-eval's default sampler
draws in a random order per document (MMLU's five dev examples) shares only its header at the first level, then
each example starts a group of its own at the next, whatever came before it, so every example is encoded about once
per level instead of once per string. What no group covers is encoded whole (tails without special tokens); a
tokenizer whose pipeline proves no cut encodes every string whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Callable, Mapping, Sequence

from distperp_harness.planning.rows import common_prefix_length as _common  # works on strings as on ids
from distperp_harness.planning.tokenizer_cuts import Cut, CutKind, find_cut, pipeline_of

CHUNK = 1024
"""Strings per tokenizer call (bounds the batch's transient memory)."""
MIN_SHARED_CHARS = 64
"""The shortest shared prefix a group is formed on."""
MIN_GROUP = 8
"""The fewest strings sharing a prefix worth it."""
WORTH = 2
"""A group is cut only where the characters it spares are at least ``WORTH`` times those it encodes for it (its piece
and its check): :meth:`PieceEncoder.split`."""
CHECK_BEYOND = 64
"""How far past a group's shared prefix its check string runs."""
MAX_LEVELS = 256
"""Levels of grouping tails, at most (each level cuts every string it groups by at least one character)."""
TAIL = {"add_special_tokens": False}
"""How everything after a cut is encoded: special tokens are the first piece's."""

log = logging.getLogger(__name__)


def encode_many(tokenizer: Any, strings: Sequence[str], **special: Any) -> list[list[int]]:
    """Token ids of each string, equal to ``tokenizer.encode(string, **special)``; a slow tokenizer encodes them one
    by one."""
    if not getattr(tokenizer, "is_fast", False):
        return [tokenizer.encode(s, **special) for s in strings]
    return PieceEncoder(tokenizer, special).encode(strings)


@dataclass
class PieceEncoder:
    """Encodes strings as pieces shared by groups of them plus their own tails (module docstring), and counts what
    it did: ``levels`` of grouping, ``groups`` cut, ``pieces`` (the distinct pieces encoded, by text and whether
    with special tokens; a piece two groups share is encoded once), characters encoded in all (``encoded``, the
    checks included)."""

    tokenizer: Any = field(repr=False)
    special: Mapping[str, Any]
    pieces: dict[tuple[str, bool], tuple[int, ...]] = field(default_factory=dict, repr=False)
    levels: int = 0
    groups: int = 0
    encoded: int = 0

    def encode(self, strings: Sequence[str]) -> list[list[int]]:
        texts = list(strings)
        heads: list[list[tuple[int, ...]]] = [[] for _ in texts]
        active = list(range(len(texts))) if local_pipeline(self.tokenizer) is None else []
        special = dict(self.special)
        while active and self.levels < MAX_LEVELS:
            cut: list[int] = []
            for members, shared in shared_prefix_groups([texts[i] for i in active]):
                chosen = [active[m] for m in members]
                split = self.split([texts[i] for i in chosen], shared, special)
                if split is not None:
                    for i in chosen:
                        heads[i].append(split.head)
                        texts[i] = texts[i][split.cut :]
                    cut += chosen
            active, special = cut, TAIL
            self.levels += bool(cut)
        whole = [i for i, h in enumerate(heads) if not h]
        tails = [i for i, h in enumerate(heads) if h]
        out: list[list[int]] = [[] for _ in texts]
        for i, ids in zip(whole, self._batched([texts[i] for i in whole], self.special)):
            out[i] = ids
        for i, ids in zip(tails, self._batched([texts[i] for i in tails], TAIL)):
            out[i] = [*chain.from_iterable(heads[i]), *ids]
        return out

    def split(self, group: list[str], shared: int, special: Mapping[str, Any]) -> PrefixSplit | None:
        """:meth:`PrefixSplit.find` at a cut worth it, its piece read from or put in ``pieces``: a cut at ``c``
        spares ``(n - 1) c`` characters of ``n`` strings and costs its piece (``c``) and its check (``2 probe -
        c``), so it must be at least ``2 WORTH probe / (n - 1 - WORTH)``; no earlier position is tried."""
        probe = min(min(map(len, group)), shared + CHECK_BEYOND)
        room = len(group) - 1 - WORTH
        lowest = -(-2 * WORTH * probe // room) if room > 0 else shared + 1  # rounded up
        if lowest > shared:
            return None
        split = PrefixSplit.find(self.tokenizer, group, shared, special, self.piece, lowest)
        if split is None:
            return None
        self.groups += 1
        self.encoded += 2 * probe - split.cut  # the check: its string whole, and its tail
        return split

    def piece(self, text: str, special: Mapping[str, Any]) -> tuple[int, ...]:
        key = (text, bool(special.get("add_special_tokens", True)))
        if key not in self.pieces:
            self.pieces[key] = tuple(self._batched([text], special)[0])
        return self.pieces[key]

    def _batched(self, strings: list[str], special: Mapping[str, Any]) -> list[list[int]]:
        self.encoded += sum(map(len, strings))
        return _batched(self.tokenizer, strings, **special)


def _batched(tokenizer: Any, strings: list[str], **special: Any) -> list[list[int]]:
    out: list[list[int]] = []
    for start in range(0, len(strings), CHUNK):
        batch = tokenizer(strings[start : start + CHUNK], **special)["input_ids"]
        out += [ids if type(ids) is list else list(ids) for ids in batch]  # a fresh list per call already
    return out


def local_pipeline(tokenizer: Any) -> str | None:
    """None when ``tokenizer``'s pipeline can prove cuts (:mod:`~distperp_harness.planning.tokenizer_cuts`);
    else why it cannot (its strings are then encoded whole)."""
    pipeline = pipeline_of(tokenizer)
    return pipeline if isinstance(pipeline, str) else None


def shared_prefix_groups(
    strings: Sequence[str], min_chars: int | None = None, min_group: int | None = None
) -> list[tuple[list[int], int]]:
    """Groups of at least ``min_group`` strings (their indices, in sorted order of the strings) that share a prefix
    of at least ``min_chars`` characters, with its length; the groups in sorted order (defaults: ``MIN_GROUP``,
    ``MIN_SHARED_CHARS`` as they are at the call). These are the runs of neighbours in sorted order whose common
    prefix is that long: strings with the same first ``min_chars`` characters, found by hashing them; a group's
    shared prefix is the common prefix of its least and greatest string."""
    min_chars = MIN_SHARED_CHARS if min_chars is None else min_chars
    min_group = MIN_GROUP if min_group is None else min_group
    buckets: dict[str, list[int]] = {}
    for index, string in enumerate(strings):
        if len(string) >= min_chars:
            buckets.setdefault(string[:min_chars], []).append(index)
    groups = []
    for members in buckets.values():
        if len(members) >= min_group:
            members.sort(key=strings.__getitem__)
            groups.append((members, _common(strings[members[0]], strings[members[-1]])))
    groups.sort(key=lambda group: strings[group[0][0]])
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
    def find(
        cls, tokenizer: Any, group: list[str], shared: int, special: Mapping[str, Any],
        piece: Callable[[str, Mapping[str, Any]], Sequence[int]] | None = None, lowest: int = 1,
    ) -> PrefixSplit | None:  # fmt: skip
        """The split of ``group`` (strings sharing ``shared`` characters) at :func:`find_cut`'s position (none before
        ``lowest``); None when there is none. ``piece(text, special)`` gives the head's ids (default: encode it).
        Its one check, the shortest string up to ``CHECK_BEYOND`` characters past the shared prefix (a string the
        proof covers too) against its whole encode, guards the implementation: exactness comes from the proof."""
        cut = cls.choose(tokenizer, group[0][:shared], special, group, lowest)
        if cut.position is None or cut.kind is None:
            return None
        text = group[0][: cut.position]
        head = piece(text, special) if piece is not None else _batched(tokenizer, [text], **special)[0]
        split = cls(tokenizer, tuple(head), cut.position, cut.kind)
        probe = min(group, key=len)[: shared + CHECK_BEYOND]
        if split.encode([probe]) != _batched(tokenizer, [probe], **special):
            log.warning("a proved cut (%s at %d) changed the ids of %r; encoding its group whole", cut.kind.value,
                        cut.position, probe[:80])  # fmt: skip
            return None
        return split

    @staticmethod
    def choose(
        tokenizer: Any, prefix: str, special: Mapping[str, Any], group: Sequence[str] = (), lowest: int = 1
    ) -> Cut:
        """:func:`find_cut` (where the split of ``group``, strings sharing ``prefix``, would cut, none before
        ``lowest``, or why it would not)."""
        return find_cut(tokenizer, prefix, special, group, lowest)

    def encode(self, strings: list[str]) -> list[list[int]]:
        head = list(self.head)
        tails = _batched(self.tokenizer, [s[self.cut :] for s in strings], add_special_tokens=False)
        return [head + tail for tail in tails]
