"""Where a fast tokenizer lets a shared prefix be cut: a character position ``c`` of a prefix ``P`` such that, for
every string ``s`` starting with ``P``, ``encode(s) == encode(s[:c]) + encode(s[c:], add_special_tokens=False)``.
Proved from the tokenizer's own pipeline (:mod:`~distperp_harness.planning.tokenizer_parts`), never sampled.

Each part must provably not move ``c``, whatever follows ``P`` (``p = len(P)``):

* **Added tokens** (leftmost-longest matching, on the raw text first): no occurrence of any added token's content
  in ``P`` (all found in one pass, :mod:`~distperp_harness.planning.added_scan`) straddles ``c``, and
  ``c + longest <= p``, so every occurrence starting before ``c`` lies in ``P``. Then matching ``s`` from the left
  picks, before ``c``, exactly what matching ``s[:c]`` picks (every candidate starting before ``c`` ends by ``c``),
  and from ``c`` on exactly what matching ``s[c:]`` picks. A token that takes the whitespace beside it
  (``lstrip``/``rstrip``) must not reach across ``c``; a ``single_word`` token must not start or end at ``c`` (it
  looks at the character beyond it). A raw token matched at ``c`` or ending at ``c``
  makes ``c`` a boundary between the pieces the rest of the pipeline treats apart.
* **Normalizer**: ``normalize(s) == normalize(s[:c]) + normalize(s[c:])`` (:class:`Normalization`).
* **Pre-tokenizer**: every step keeps the cut (:mod:`~distperp_harness.planning.pretoken_steps`).
* **Model**: a cut between pre-tokens is kept by any BPE; one inside a pre-token only where no merge can join its
  two sides (:meth:`MergeFacts.separable`).
* **Post-processor**: special tokens only in front of the text, or ``add_special_tokens=False``: the head keeps them.

:func:`find_cut` returns the last such position (the longest shared head), or why there is none. Given the strings
to cut (a group's members), it reads their own characters past ``P`` as known: each distinct continuation ``Q`` of
``P`` up to ``longest + AHEAD`` characters further is a prefix of its own, and a position of ``P`` every ``Q``
allows keeps every string (each starts with one ``Q``). So a cut can sit at the very end of ``P`` (a few-shot
example's last character, where the examples that follow differ), not ``longest`` characters before it.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

from distperp_harness.planning.pretoken_steps import Joint, Junction
from distperp_harness.planning.tokenizer_parts import AddedTokens, Pipeline, read_pipeline

SCAN = 4096
"""Positions tried, from the end of the shared prefix back, before giving up."""
AHEAD = 16
"""Characters of the strings' own continuations read past the shared prefix, beyond the longest added token."""
MAX_AHEAD = 64
"""The most distinct continuations read (with more, the shared prefix alone is proved on)."""


class CutKind(enum.Enum):
    BEFORE_TOKEN = "before an added token"
    AFTER_TOKEN = "after an added token"
    PRE_TOKEN = "between pre-tokens"
    MERGES = "inside a pre-token no merge crosses"


@dataclass(frozen=True)
class Cut:
    """The position chosen (None: none) and its kind, or why there is none."""

    position: int | None
    kind: CutKind | None = None
    reason: str = ""


_PIPELINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pipeline_of(tokenizer: Any) -> Pipeline | str:
    """:func:`~distperp_harness.planning.tokenizer_parts.read_pipeline`, kept per tokenizer and read again when its
    size (added tokens included), ``split_special_tokens`` or the repr of its normalizer, pre-tokenizer or
    post-processor changes (reading parses the whole vocabulary as JSON)."""
    key = _fingerprint(tokenizer)
    try:
        cached = _PIPELINES.get(tokenizer)
    except TypeError:  # not weakly referable
        return read_pipeline(tokenizer)
    if cached is None or cached[0] != key:
        cached = _PIPELINES[tokenizer] = (key, read_pipeline(tokenizer))
    return cached[1]


def _fingerprint(tokenizer: Any) -> tuple:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ()
    parts = (backend.normalizer, backend.pre_tokenizer, backend.post_processor)
    return (
        backend.get_vocab_size(with_added_tokens=True),
        *map(repr, parts),
        getattr(tokenizer, "split_special_tokens", None),
    )


def find_cut(
    tokenizer: Any, prefix: str, special: Mapping[str, Any], strings: Sequence[str] = (), lowest: int = 1
) -> Cut:
    """The last position of ``prefix``, at least ``lowest``, where every string starting with it can be cut, for
    ``tokenizer.encode(s, **special)`` (``special``: at most ``add_special_tokens``), or why there is none. With
    ``strings`` (each starting with ``prefix``), every one of them: their continuations are read too (module
    docstring)."""
    pipeline = pipeline_of(tokenizer)
    if isinstance(pipeline, str):
        return Cut(None, reason=pipeline)
    if set(special) - {"add_special_tokens"}:
        return Cut(None, reason=f"encode keywords other than add_special_tokens: {sorted(special)}")
    return last_cut(pipeline, prefix, bool(special.get("add_special_tokens", True)), strings, lowest)


def last_cut(
    pipeline: Pipeline, prefix: str, add_special_tokens: bool, strings: Sequence[str] = (), lowest: int = 1
) -> Cut:
    """The last position of ``prefix`` that ``pipeline`` provably keeps for every string starting with it, or with
    ``strings`` for each of them (module docstring), among the ``SCAN`` last ones and none before ``lowest``."""
    if pipeline.text_after and add_special_tokens:
        return Cut(None, reason="the post-processor adds tokens after the text")
    texts = continuations(pipeline, prefix, strings)
    for position, kind in shared_cuts(pipeline, texts, len(prefix), SCAN, lowest):
        return Cut(position, kind)
    return Cut(None, reason=f"no provable cut in the last {SCAN} positions of the {len(prefix)}-character prefix"
                            f"{f' from {lowest} on' if lowest > 1 else ''}")  # fmt: skip


def continuations(pipeline: Pipeline, prefix: str, strings: Sequence[str]) -> list[str]:
    """The distinct starts of ``strings`` up to ``longest + AHEAD`` characters past ``prefix`` (every string starts
    with one), or ``[prefix]`` alone when there are none or more than ``MAX_AHEAD``."""
    reach = len(prefix) + max(pipeline.added.longest, 2) + AHEAD
    texts = sorted({s[:reach] for s in strings})
    if any(not text.startswith(prefix) for text in texts):
        raise ValueError(f"every string to cut must start with the {len(prefix)}-character shared prefix")
    return texts if 0 < len(texts) <= MAX_AHEAD else [prefix]


def allowed_cuts(pipeline: Pipeline, prefix: str, limit: int | None = None) -> Iterator[tuple[int, CutKind]]:
    """Every position of ``prefix`` (the last ``limit`` candidates) where ``pipeline`` provably keeps every string
    that starts with ``prefix``, from the last back, with its kind (the post-processor aside: :func:`last_cut`)."""
    return shared_cuts(pipeline, [prefix], len(prefix), limit)


def shared_cuts(
    pipeline: Pipeline, texts: Sequence[str], end: int, limit: int | None = None, lowest: int = 1
) -> Iterator[tuple[int, CutKind]]:
    """Every position from ``lowest`` up to ``end`` (``texts`` share their first ``end`` characters; the last
    ``limit`` candidates) where ``pipeline`` provably keeps every string that starts with any of ``texts``, from the
    last back, with its kind in the first text. The shared characters are scanned for added tokens once
    (:func:`_each_matches`)."""
    found = _each_matches(pipeline.added, texts, end)
    top = min(end, *(len(text) - max(pipeline.added.longest, 2) for text in texts))
    for c in range(top, max(lowest - 1, 0 if limit is None else top - limit), -1):
        kind = _kind(pipeline, found[0], texts[0], c)
        if kind is not None and all(_kind(pipeline, f, t, c) for f, t in zip(found[1:], texts[1:])):
            yield c, kind


@dataclass
class _Matches:
    """What added-token extraction can find in a prefix, by position."""

    blocked: set[int] = field(default_factory=set)  # an occurrence straddles it, or a single-word one touches it
    starts: set[int] = field(default_factory=set)  # a raw match chosen by extraction starts here
    ends: set[int] = field(default_factory=set)  # ... ends here
    lstrip_starts: set[int] = field(default_factory=set)  # an occurrence of an lstrip token starts here
    rstrip_ends: set[int] = field(default_factory=set)  # an occurrence of an rstrip token ends here
    free: int = 0  # where extraction resumes after the raw matches read so far

    def copy(self) -> _Matches:
        return _Matches(
            set(self.blocked), set(self.starts), set(self.ends), set(self.lstrip_starts), set(self.rstrip_ends),
            self.free,
        )  # fmt: skip


def _matches(added: AddedTokens, prefix: str) -> _Matches:
    """Every occurrence of every content in ``prefix`` (one pass of the added vocabulary's automaton), and the raw
    matches leftmost-longest extraction chooses (:func:`_read`)."""
    return _read(added, _Matches(), added.automaton.occurrences(prefix))


def _each_matches(added: AddedTokens, texts: Sequence[str], end: int) -> list[_Matches]:
    """:func:`_matches` of each of ``texts`` (sharing their first ``end`` characters): the shared characters scanned
    and the occurrences starting more than ``longest`` before ``end`` read once, each text's own continuing from the
    automaton's state there."""
    automaton = added.automaton
    shared, state = automaton.scan(texts[0][:end])
    shared.sort()
    settled = end - added.longest + 1  # an occurrence starting before this ends by ``end``: in every text alike
    first = _read(added, _Matches(), (o for o in shared if o[0] < settled))
    rest = [o for o in shared if o[0] >= settled]
    return [_read(added, first.copy(), sorted(rest + automaton.scan(text, end, state)[0])) for text in texts]


def _read(added: AddedTokens, found: _Matches, occurrences: Iterable[tuple[int, int]]) -> _Matches:
    """``found`` with ``occurrences`` (by start, longest first at one start, after those already read) added: the
    positions they block or strip, and the raw matches leftmost-longest extraction chooses (it resumes after each
    match, single-word ones included, which only then are kept or dropped)."""
    contents = added.automaton.contents
    for start, number in occurrences:
        content = contents[number]
        end = start + len(content)
        found.blocked.update(range(start + 1, end))
        if content in added.single_word:
            found.blocked.update((start, end))
        if content in added.lstrip:
            found.lstrip_starts.add(start)
        if content in added.rstrip:
            found.rstrip_ends.add(end)
        if content in added.raw and start >= found.free:  # the longest raw content at the first free start
            found.free = end
            if content not in added.single_word:
                found.starts.add(start)
                found.ends.add(end)
    return found


def _strips_kept(added: AddedTokens, found: _Matches, prefix: str, c: int) -> bool:
    """No ``lstrip`` token after ``c`` takes whitespace before it (one starting anywhere in the run of whitespace
    that holds ``c - 1`` and ``c``), no ``rstrip`` token before ``c`` takes whitespace after it."""
    if added.lstrip and prefix[c - 1].isspace():
        end = c
        while end < len(prefix) and prefix[end].isspace():
            end += 1
        if end + added.longest > len(prefix) or not found.lstrip_starts.isdisjoint(range(c, end + 1)):
            return False
    if added.rstrip and prefix[c].isspace():
        start = c
        while start > 0 and prefix[start - 1].isspace():
            start -= 1
        if not found.rstrip_ends.isdisjoint(range(start, c + 1)):
            return False
    return True


def _kind(pipeline: Pipeline, found: _Matches, prefix: str, c: int) -> CutKind | None:
    """How ``prefix`` can be cut at ``c`` (``c + max(longest, 2) <= len(prefix)``), or None."""
    if c in found.blocked or not _strips_kept(pipeline.added, found, prefix, c):
        return None
    norm = pipeline.normalization
    if c in found.starts:
        kind, at = CutKind.BEFORE_TOKEN, Junction(Joint.TOKEN, None, None)
    elif c in found.ends:
        kind, at = CutKind.AFTER_TOKEN, Junction(Joint.BETWEEN, None, norm.first_char(prefix, c, len(prefix)))
    elif norm.boundary(prefix, c):
        right = norm.first_char(prefix, c, len(prefix))
        kind, at = CutKind.PRE_TOKEN, Junction(Joint.INSIDE, norm.last_char(prefix, c), right)
    else:
        return None
    for step in pipeline.steps:
        advanced = step.advance(at)
        if advanced is None:
            return None
        at = advanced
    if at.joint is not Joint.INSIDE:
        return kind
    return CutKind.MERGES if pipeline.merges.separable(at.left, at.right) else None
