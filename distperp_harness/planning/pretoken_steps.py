"""What each step of a fast tokenizer's pre-tokenizer does at a cut of its text, proved from the step's semantics.

A fast (Rust ``tokenizers``) tokenizer pre-tokenizes each piece of text between added tokens on its own, then runs
its model on each pre-token on its own. Encoding a text whole and encoding it as two texts cut at one character
position give the same ids when every step, fed the whole text's pieces on one side and the two texts' pieces on
the other, leaves them in one of these relations (a :class:`Junction` follows the cut through the steps):

* ``INSIDE``: the whole text's piece runs across the cut and the two texts see exactly its two halves (so far only
  characters were mapped one by one, or pieces were split elsewhere by rules that read only the characters around
  each split);
* ``BETWEEN``: the cut is a boundary between two pieces of the whole text, and the two texts see the same pieces;
* ``TOKEN``: an added token starts at the cut; nothing the pre-tokenizer or the model does reaches across it.

A step that cannot prove one of these returns None and the cut is refused. What the steps read is the character
just before the cut and the one just after it (``left``, ``right``; None when unknown). Character classes are only
trusted for ASCII characters, whose classes every Unicode version and regex engine agree on; anything else is
unknown, and a rule that needs its class refuses.
"""

from __future__ import annotations

import enum
import string
from dataclasses import dataclass, replace
from functools import cache
from typing import Callable, Protocol

SPACES = frozenset(" \t\n\r")
"""The whitespace the regex rules reason about (``\\s`` in every engine, Unicode White_Space)."""
RUST_WHITESPACE = SPACES | {"\x0b", "\x0c"}
"""ASCII characters Rust's ``char::is_whitespace`` holds for (0x1C–0x1F are not White_Space)."""
PUNCTUATION = frozenset(string.punctuation)


class Joint(enum.Enum):
    """How the whole text's pieces and the two texts' pieces relate at the cut (module docstring)."""

    INSIDE = "inside"
    BETWEEN = "between"
    TOKEN = "token"


@dataclass(frozen=True)
class Junction:
    """The cut as the current step sees it: the relation, and the characters on each side (None: unknown)."""

    joint: Joint
    left: str | None
    right: str | None


class Step(Protocol):
    def advance(self, at: Junction) -> Junction | None:
        """The junction after this step, or None when the step cannot be proved to keep the cut."""


class Behavior(enum.Enum):
    """``tokenizers``' ``SplitDelimiterBehavior``: what a split does with the delimiters it finds."""

    ISOLATED = "Isolated"
    REMOVED = "Removed"
    MERGED_WITH_PREVIOUS = "MergedWithPrevious"
    MERGED_WITH_NEXT = "MergedWithNext"
    CONTIGUOUS = "Contiguous"


class Scheme(enum.Enum):
    """When a step prepends its marker to a piece: to every piece, to a piece at the text's start, never."""

    ALWAYS = "always"
    FIRST = "first"
    NEVER = "never"


def ascii_class(ch: str | None) -> str | None:
    """``letter``, ``digit``, ``space`` (:data:`SPACES`) or ``punct`` (ASCII punctuation) for an ASCII character;
    None for anything else (other ASCII controls, non-ASCII characters, unknown)."""
    if ch is None or len(ch) != 1 or not ch.isascii():
        return None
    if ch.isalpha():
        return "letter"
    if ch.isdigit():
        return "digit"
    return "space" if ch in SPACES else "punct" if ch in PUNCTUATION else None


def _ascii_test(members: frozenset[str]) -> Callable[[str], bool | None]:
    return lambda ch: (ch in members) if ch.isascii() else None


is_digit = _ascii_test(frozenset(string.digits))  # Rust's char::is_numeric, on ASCII
is_punctuation = _ascii_test(PUNCTUATION)  # tokenizers' is_punc: ASCII or Unicode punctuation
is_whitespace = _ascii_test(RUST_WHITESPACE)  # char::is_whitespace


@dataclass(frozen=True)
class MapChar:
    """Replaces one character by one other everywhere (Metaspace's ``' '`` -> replacement): the pieces are kept."""

    source: str
    target: str

    def advance(self, at: Junction) -> Junction:
        return replace(at, left=self._map(at.left), right=self._map(at.right))

    def _map(self, ch: str | None) -> str | None:
        return self.target if ch == self.source else ch


@cache
def byte_chars() -> tuple[str, ...]:
    """The GPT-2 byte-to-character table of ``ByteLevel``: the character each byte value becomes."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return tuple(chr(b) if b in visible else chr(next(extra)) for b in range(256))


@dataclass(frozen=True)
class MapBytes:
    """``ByteLevel``'s byte mapping: each byte of a piece becomes one character, the pieces are kept."""

    def advance(self, at: Junction) -> Junction:
        table = byte_chars()
        left = None if at.left is None else table[at.left.encode()[-1]]
        right = None if at.right is None else table[at.right.encode()[0]]
        return replace(at, left=left, right=right)


@dataclass(frozen=True)
class Prepend:
    """Puts ``marker`` in front of a piece that does not start with it (``ByteLevel(add_prefix_space)``:
    ``ALWAYS``; ``Metaspace``: its scheme, ``FIRST`` meaning a piece at offset 0 of the encoded text).

    The left text's first piece starts where the whole text's does, so it gets the same treatment. The right text's
    first piece starts at the cut, at offset 0 of the right text: ``INSIDE`` the whole text has no piece starting
    there, so any scheme but ``NEVER`` needs the marker already there; ``BETWEEN``, ``ALWAYS`` treats both alike and
    ``FIRST`` prepends to the right text only (the whole text's piece is not at offset 0) unless the marker is there.
    """

    marker: str
    scheme: Scheme

    def advance(self, at: Junction) -> Junction | None:
        if at.joint is Joint.TOKEN or self.scheme is Scheme.NEVER or at.right == self.marker:
            return at
        return at if at.joint is Joint.BETWEEN and self.scheme is Scheme.ALWAYS else None


@dataclass(frozen=True)
class CharSplit:
    """A split on single characters that ``test`` holds for (``Split`` on a one-character string, ``Digits``,
    ``Punctuation``, ``WhitespaceSplit``, ``Metaspace``'s split), with ``behavior``.

    Whether there is a boundary between two characters depends on those two characters alone: before and after a
    delimiter (isolated, removed), after it (merged with the previous piece), before it (merged with the next), where
    being a delimiter changes (contiguous). So each text's boundaries away from the cut are the whole text's, and at
    the cut there is a boundary or the piece's halves are what each text sees (``INSIDE``)."""

    test: Callable[[str], bool | None]
    behavior: Behavior

    def advance(self, at: Junction) -> Junction | None:
        if at.joint is Joint.TOKEN:
            return at
        left = None if at.left is None else self.test(at.left)
        right = None if at.right is None else self.test(at.right)
        removes = self.behavior is Behavior.REMOVED
        if at.joint is Joint.BETWEEN:
            return replace(at, left=None if removes and left is not False else at.left,
                           right=None if removes and right is not False else at.right)  # fmt: skip
        if left is None or right is None:
            return None
        boundary = {
            Behavior.ISOLATED: left or right,
            Behavior.REMOVED: left or right,
            Behavior.MERGED_WITH_PREVIOUS: left,
            Behavior.MERGED_WITH_NEXT: right,
            Behavior.CONTIGUOUS: left != right,
        }[self.behavior]
        joint = Joint.BETWEEN if boundary else Joint.INSIDE
        return Junction(joint, None if removes and left else at.left, None if removes and right else at.right)


def _word_class(ch: str | None) -> str | None:
    kind = ascii_class(ch)
    if ch in RUST_WHITESPACE:
        return "space"
    return "word" if kind in ("letter", "digit") or ch == "_" else kind


@dataclass(frozen=True)
class WordRuns:
    """``Whitespace``: the pieces are the runs of ``\\w+`` and of ``[^\\w\\s]+``, whitespace removed. A boundary
    between two characters depends on their classes alone (word, other, space), as for :class:`CharSplit`."""

    def advance(self, at: Junction) -> Junction | None:
        left, right = _word_class(at.left), _word_class(at.right)
        if at.joint is Joint.TOKEN:
            return at
        if at.joint is Joint.BETWEEN:
            return replace(at, right=at.right if right not in (None, "space") else None)
        if left is None or right is None:
            return None
        joint = Joint.BETWEEN if left != right or left == "space" else Joint.INSIDE
        return Junction(joint, None if left == "space" else at.left, None if right == "space" else at.right)


GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
"""``ByteLevel(use_regex=True)``'s built-in pattern (GPT-2, SmolLM2)."""
CL100K = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
"""Llama 3's ``Split`` pattern (tiktoken's cl100k)."""
QWEN2 = CL100K.replace(r"\p{N}{1,3}", r"\p{N}")
"""Qwen2, Qwen2.5 and Qwen3's ``Split`` pattern."""
O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""tiktoken's o200k (gpt-oss)."""
PATTERNS = {GPT2: "GPT-2", CL100K: "cl100k", QWEN2: "Qwen2", O200K: "o200k"}
"""The regex patterns whose cut rule (:func:`regex_boundary`) is proved; any other pattern is refused."""


def regex_boundary(left: str | None, right: str | None) -> bool:
    """Whether a cut between ``left`` and ``right`` is a boundary between pre-tokens of each pattern of
    :data:`PATTERNS` (``Isolated``, not inverted), whatever precedes and follows: ``left`` an ASCII letter or digit
    and ``right`` a space, tab, CR or LF, or ``left`` ASCII punctuation and ``right`` a space.

    Proof, for a piece ``T`` cut at ``J`` (``T[J-1]`` is ``left``, ``T[J]`` is ``right``), each pattern alike:

    1. Every character starts a match (a letter, a number, whitespace or none of these each has an alternative of
       one character or more starting with it), no alternative matches the empty string and none looks behind. So
       the pre-tokens are the matches ``find_iter`` finds from 0, each starting where the previous one ended, and
       the match at a position depends only on the text from that position on: the matches from ``J`` on are those
       of ``T[J:]`` alone, once a match ends at ``J``.
    2. No alternative matches a string in which a letter, digit or punctuation character is followed by whitespace,
       except ``[\\r\\n]*`` (o200k: ``[\\r\\n/]*``) after punctuation, which takes CR and LF only: the letters of
       ``\\p{L}+`` (o200k: with marks and an optional contraction) end the match, ``\\p{N}`` runs hold numbers only,
       a contraction is an apostrophe and letters, and whitespace alternatives hold whitespace only. So the match
       holding ``T[J-1]`` cannot hold ``T[J]``: it ends at ``J``.
    3. The matches before ``J`` are those of ``T[:J]`` alone. A match is the first path, in the pattern's priority
       order, that succeeds from its start. The whole text and ``T[:J]`` differ only for paths that read position
       ``J``: consuming it (impossible in ``T[:J]``) or looking ahead there with ``(?!\\S)``, which only follows
       ``\\s+`` and so needs ``T[J-1]`` to be whitespace, which it is not. So every path that fails on the whole
       text fails on ``T[:J]``, and the path chosen on the whole text, which ends by ``J`` (2) and reads nothing
       at ``J``, succeeds on ``T[:J]``.
    """
    kind = ascii_class(left)
    if ascii_class(right) != "space":
        return False
    return kind in ("letter", "digit") or (kind == "punct" and right == " ")


@dataclass(frozen=True)
class RegexSplit:
    """A ``Split`` (``Isolated``, not inverted) on a pattern of :data:`PATTERNS`, or ``ByteLevel``'s own regex:
    ``INSIDE`` only :func:`regex_boundary` keeps a cut; ``BETWEEN``, each text's piece at the cut is the whole
    text's, split alike (no look-behind)."""

    pattern: str

    def advance(self, at: Junction) -> Junction | None:
        if at.joint is not Joint.INSIDE:
            return at
        return replace(at, joint=Joint.BETWEEN) if regex_boundary(at.left, at.right) else None
