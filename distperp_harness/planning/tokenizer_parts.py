"""A fast tokenizer's pipeline, read from its own configuration into the facts a proof of a cut needs
(:mod:`~distperp_harness.planning.tokenizer_cuts`), or the reason it cannot be read so.

The pipeline of ``tokenizers``: added tokens extracted (``normalized=False`` ones on the raw text first, then the
others on the normalized text), the normalizer, the pre-tokenizer's steps, the model on each pre-token, the
post-processor. Read here from ``backend_tokenizer.to_str()`` and ``get_added_tokens_decoder()``; whatever is not
understood exactly is refused (those strings are encoded whole: slower, still exact).
"""

from __future__ import annotations

import enum
import json
import unicodedata
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable, Mapping

from distperp_harness.planning.added_scan import ContentAutomaton
from distperp_harness.planning.pretoken_steps import (
    GPT2,
    PATTERNS,
    Behavior,
    CharSplit,
    MapBytes,
    MapChar,
    Prepend,
    RegexSplit,
    Scheme,
    Step,
    WordRuns,
    is_digit,
    is_punctuation,
    is_whitespace,
)


@dataclass(frozen=True)
class AddedTokens:
    """The added tokens as extraction matches them: leftmost-longest, ``raw`` ones on the text before normalizing."""

    automaton: ContentAutomaton
    """Every content, found in one pass (:meth:`ContentAutomaton.occurrences`)."""
    raw: frozenset[str]
    """Contents matched on the raw text (``normalized=False``); the others are matched after it, on each piece."""
    longest: int
    lstrip: frozenset[str]
    rstrip: frozenset[str]
    single_word: frozenset[str]


class NormKind(enum.Enum):
    NONE = "none"
    CHARWISE = "charwise"  # each character normalized alone: Lowercase, Replace of one character, a Sequence of them
    UNICODE = "unicode"  # NFC, NFD, NFKC or NFKD, optionally followed by charwise steps


@cache
def compositions() -> tuple[frozenset[str], frozenset[str]]:
    """The first and the second characters of every canonical composition pair (every two-character canonical
    decomposition in this Python's ``unicodedata``, plus Hangul's L+V and LV+T), a superset of the pairs NFC and
    NFKC compose."""
    firsts, seconds = set(), set()
    for code in range(0x110000):
        decomposition = unicodedata.decomposition(chr(code))
        if decomposition and not decomposition.startswith("<") and len(parts := decomposition.split()) == 2:
            firsts.add(chr(int(parts[0], 16)))
            seconds.add(chr(int(parts[1], 16)))
    firsts |= {chr(c) for c in range(0x1100, 0x1113)} | {chr(c) for c in range(0xAC00, 0xD7A4, 28)}  # L, LV
    seconds |= {chr(c) for c in range(0x1161, 0x1176)} | {chr(c) for c in range(0x11A8, 0x11C3)}  # V, T
    return frozenset(firsts), frozenset(seconds)


@cache
def starts_segment(ch: str, form: str) -> bool:
    """Whether Unicode normalization ``form`` of any text ``x + ch + y`` is ``form(x) + form(ch + y)``: the first
    character of ``ch``'s full decomposition is a starter (canonical combining class 0, so reordering stops at it)
    and, for the composing forms, never the second of a composition pair (nothing before it composes with it).
    Unassigned characters are refused (a newer Unicode may decompose them); for assigned ones these properties are
    stable across Unicode versions, so the Rust normalizer's tables agree."""
    if unicodedata.category(ch) == "Cn":
        return False
    first = unicodedata.normalize("NFKD" if "K" in form else "NFD", ch)[0]
    return unicodedata.combining(first) == 0 and (form in ("NFD", "NFKD") or first not in compositions()[1])


def inert(ch: str, form: str) -> bool:
    """Whether ``form(ch + y)`` is ``ch + form(y)`` for any ``y``: an ASCII character that starts a segment and,
    for the composing forms, is never the first of a composition pair (``e`` and ``<`` are, ``' '`` is not)."""
    return ch.isascii() and starts_segment(ch, form) and (form in ("NFD", "NFKD") or ch not in compositions()[0])


def _same(text: str) -> str:
    return text


@dataclass(frozen=True)
class Normalization:
    """The normalizer, as the three facts a cut needs: whether it splits at a position (for every text after the
    prefix), and the normalized characters just before and just after it (None: unknown)."""

    kind: NormKind
    form: str = ""
    one: Callable[[str], str] = field(default=_same)
    """The tokenizer's own normalizer, applied to one character."""

    def boundary(self, text: str, c: int) -> bool:
        """``normalize(s) == normalize(s[:c]) + normalize(s[c:])`` for every ``s`` extending ``text[:c + 1]``."""
        return self.kind is not NormKind.UNICODE or starts_segment(text[c], self.form)

    def last_char(self, text: str, c: int) -> str | None:
        """The last character of the normalized text before ``c`` (a boundary), if exact."""
        if self.kind is NormKind.UNICODE and not starts_segment(text[c - 1], self.form):
            return None
        out = self.one(text[c - 1])
        return out[-1] if out else None

    def first_char(self, text: str, c: int, end: int) -> str | None:
        """The first character of the normalized text from ``c`` on, if exact whatever follows ``text[:end]``."""
        followed = c + 1 < end and starts_segment(text[c + 1], self.form)
        if self.kind is NormKind.UNICODE and not (inert(text[c], self.form) or followed):
            return None
        out = self.one(text[c])
        return out[0] if out else None


@dataclass(frozen=True)
class MergeFacts:
    """What the BPE model's merges allow: ``pairs`` holds (last character of ``x``, first character of ``y``) of
    every merge ``(x, y)``; None when merges cannot prove a cut (``ignore_merges``, subword affixes, unreadable)."""

    pairs: frozenset[tuple[str, str]] | None
    vocab: frozenset[str] = frozenset()
    byte_fallback: bool = False
    fuse_unk: bool = False
    unk: str | None = None

    def separable(self, left: str | None, right: str | None) -> bool:
        """Whether BPE on a word holding ``left`` then ``right`` is BPE on each side: no merge can join a symbol that
        ends with ``left``'s last initial symbol to one that starts with ``right``'s first. Merges on one side never
        change the pairs on the other, and HF applies them by rank then position, so each side's merges are those
        it makes alone."""
        if self.pairs is None or left is None or right is None:
            return False
        before, after = self._symbol(left, -1), self._symbol(right, 0)
        if before is None or after is None or (self.fuse_unk and before == after == self.unk):
            return False
        return (before[-1], after[0]) not in self.pairs

    def _symbol(self, ch: str, end: int) -> str | None:
        """The initial symbol ``ch`` gives at its ``end`` (``-1``: last): itself, a byte token, the unknown token."""
        if ch in self.vocab:
            return ch
        names = [f"<0x{b:02X}>" for b in ch.encode()]
        if self.byte_fallback and all(name in self.vocab for name in names):
            return names[end]
        return self.unk if self.unk in self.vocab else None


@dataclass(frozen=True)
class Pipeline:
    """A fast tokenizer's pipeline, as read: cuts are proved from these parts alone."""

    added: AddedTokens
    normalization: Normalization
    steps: tuple[Step, ...]
    merges: MergeFacts
    text_after: bool
    """The post-processor adds tokens after the text (only calls with ``add_special_tokens=False`` can be cut)."""


def read_pipeline(tokenizer: Any) -> Pipeline | str:
    """``tokenizer``'s pipeline, or why no cut of its texts can be proved."""
    why = _python_layer(tokenizer)
    if why:
        return why
    try:
        backend = tokenizer.backend_tokenizer
        config = json.loads(backend.to_str())
        tokens = list(backend.get_added_tokens_decoder().values())
    except (AttributeError, TypeError, ValueError):
        return "no tokenizers configuration to read"
    normalization = _normalization(config.get("normalizer"), backend)
    if isinstance(normalization, str):
        return normalization
    added = _added(tokens, normalization.kind)
    steps = _steps(config.get("pre_tokenizer"))
    text_after = _text_after(config.get("post_processor"))
    for part in (added, steps, text_after):
        if isinstance(part, str):
            return part
    merges = _merges(config.get("model") or {})  # read last: the slowest part
    if isinstance(merges, str):
        return merges
    return Pipeline(added, normalization, steps, merges, text_after)  # type: ignore[arg-type]  # no str left


def _python_layer(tokenizer: Any) -> str | None:
    """Why ``tokenizer.encode`` may do more than the Rust pipeline (a subclass overriding the encode path, special
    tokens split as text); None when it does not."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return "not a transformers fast tokenizer"
    if getattr(tokenizer, "split_special_tokens", False):
        return "special tokens are encoded as text (split_special_tokens)"
    for name in ("__call__", "encode", "_encode_plus", "_batch_encode_plus"):
        if getattr(type(tokenizer), name, None) is not getattr(PreTrainedTokenizerFast, name, None):
            return f"{type(tokenizer).__name__} overrides {name}"
    return None


def _flatten(config: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    if config.get("type") != "Sequence":
        return [config]
    return [step for inner in config.get(key) or [] for step in _flatten(inner, key)]


def _charwise(step: Mapping[str, Any]) -> bool:
    pattern = step.get("pattern") or {}
    return step.get("type") == "Lowercase" or (step.get("type") == "Replace" and len(pattern.get("String", "")) == 1)


def _normalization(config: Mapping[str, Any] | None, backend: Any) -> Normalization | str:
    """NONE; CHARWISE (each step maps one character at a time); UNICODE (a normalization form, then charwise steps);
    anything else (Prepend, Strip, Precompiled, a regex or several-character Replace, ...) is refused."""
    if config is None:
        return Normalization(NormKind.NONE)
    steps = _flatten(config, "normalizers")
    forms = [i for i, step in enumerate(steps) if step.get("type") in ("NFC", "NFD", "NFKC", "NFKD")]
    odd = [step for i, step in enumerate(steps) if i not in forms and not _charwise(step)]
    if odd:
        detail = " (of a regex or several-character pattern)" if odd[0].get("type") == "Replace" else ""
        return f"a {odd[0].get('type')} normalizer{detail}"
    if forms not in ([], [0]):
        return "a normalizer sequence with a Unicode form after another step"
    cached = cache(backend.normalizer.normalize_str)
    if not forms:
        return Normalization(NormKind.CHARWISE, "", cached)
    return Normalization(NormKind.UNICODE, steps[0]["type"], cached)


def _steps(config: Mapping[str, Any] | None) -> tuple[Step, ...] | str:
    out: list[Step] = []
    for step in [] if config is None else _flatten(config, "pretokenizers"):
        parsed = _step(step)
        if isinstance(parsed, str):
            return parsed
        out += parsed
    return tuple(out)


def _step(config: Mapping[str, Any]) -> list[Step] | str:
    """One pre-tokenizer as steps of :mod:`~distperp_harness.planning.pretoken_steps`, or why it is refused."""
    kind = config.get("type")
    try:
        if kind == "ByteLevel":
            prefix: list[Step] = [Prepend(" ", Scheme.ALWAYS)] if config.get("add_prefix_space") else []
            return prefix + ([RegexSplit(PATTERNS[GPT2])] if config.get("use_regex", True) else []) + [MapBytes()]
        if kind == "Split":
            return _split(config)
        if kind == "Metaspace":
            return _metaspace(config)
        if kind == "Digits":
            individual = config.get("individual_digits")
            return [CharSplit(is_digit, Behavior.ISOLATED if individual else Behavior.CONTIGUOUS)]
        if kind == "Punctuation":
            return [CharSplit(is_punctuation, Behavior(config.get("behavior", "Isolated")))]
        if kind == "WhitespaceSplit":
            return [CharSplit(is_whitespace, Behavior.REMOVED)]
        if kind == "Whitespace":
            return [WordRuns()]
    except ValueError:
        return f"a {kind} pre-tokenizer with an unknown option"
    return f"a {kind} pre-tokenizer"


def _split(config: Mapping[str, Any]) -> list[Step] | str:
    pattern = config.get("pattern") or {}
    behavior = Behavior(config.get("behavior"))
    if config.get("invert"):
        return "an inverted Split pre-tokenizer"
    if "Regex" in pattern:
        if pattern["Regex"] in PATTERNS and behavior is Behavior.ISOLATED:
            return [RegexSplit(PATTERNS[pattern["Regex"]])]
        return "a Split pre-tokenizer on a regex without a proved cut rule"
    text = pattern.get("String", "")
    if len(text) != 1:
        return "a Split pre-tokenizer on a several-character string"
    return [CharSplit(lambda ch: ch == text, behavior)]


def _metaspace(config: Mapping[str, Any]) -> list[Step] | str:
    """``Metaspace`` on a piece: every ``' '`` becomes the replacement, the replacement is prepended by the scheme,
    and with ``split`` the piece is split before each replacement."""
    mark = config.get("replacement", "▁")
    legacy = "always" if config.get("add_prefix_space", True) else "never"
    scheme = Scheme(config.get("prepend_scheme") or legacy)
    if len(mark) != 1:
        return "a Metaspace pre-tokenizer with a several-character replacement"
    steps: list[Step] = [MapChar(" ", mark), Prepend(mark, scheme)]
    return steps + ([CharSplit(lambda ch: ch == mark, Behavior.MERGED_WITH_NEXT)] if config.get("split", True) else [])


def _merges(model: Mapping[str, Any]) -> MergeFacts | str:
    if model.get("type") != "BPE":
        return f"a {model.get('type')} model"
    if model.get("dropout"):
        return "BPE dropout (ids vary from call to call)"
    affixes = model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")
    pairs = None if model.get("ignore_merges") or affixes else _pairs(model.get("merges") or [])
    return MergeFacts(
        pairs, frozenset(model.get("vocab") or ()) if pairs is not None else frozenset(),
        bool(model.get("byte_fallback")), bool(model.get("fuse_unk")), model.get("unk_token"),
    )  # fmt: skip


def _pairs(merges: list[Any]) -> frozenset[tuple[str, str]] | None:
    out = set()
    for merge in merges:
        parts = merge.split(" ") if isinstance(merge, str) else merge
        if len(parts) != 2 or not parts[0] or not parts[1]:
            return None
        out.add((parts[0][-1], parts[1][0]))
    return frozenset(out)


def _text_after(config: Mapping[str, Any] | None) -> bool | str:
    """Whether the post-processor adds tokens after the text (True), only before it (False), or why unknown."""
    if config is None or config.get("type") == "ByteLevel":
        return False
    if config.get("type") == "TemplateProcessing":
        single = config.get("single") or []
        return bool(single) and "Sequence" not in single[-1]
    if config.get("type") in ("RobertaProcessing", "BertProcessing"):
        return True
    if config.get("type") == "Sequence":
        parts = [_text_after(inner) for inner in config.get("processors") or []]
        return next((p for p in parts if isinstance(p, str)), any(parts))
    return f"a {config.get('type')} post-processor"


def _added(tokens: list[Any], kind: NormKind) -> AddedTokens | str:
    tokens = [t for t in tokens if t.content]
    if kind is not NormKind.NONE and any(t.normalized for t in tokens):
        return "added tokens matched on normalized text, under a normalizer"
    return AddedTokens(
        ContentAutomaton(t.content for t in tokens),
        frozenset(t.content for t in tokens if not t.normalized),
        max((len(t.content) for t in tokens), default=0),
        *(frozenset(t.content for t in tokens if getattr(t, flag)) for flag in ("lstrip", "rstrip", "single_word")),
    )
