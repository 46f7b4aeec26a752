"""Tests of :mod:`distperp_harness.planning.tokenizer_cuts`: a shared prefix is cut only where the tokenizer's own
pipeline proves every string's ids unchanged, on tiny tokenizers in the real layouts of GPT-2/SmolLM2, Llama 3,
Qwen2, Gemma and Metaspace families (and variants of their parts), checked on every string (no sampling): prefixes
ending inside each family's special-token literals, normalizer-sensitive text (combining accents for NFC),
whitespace and digits at the boundary, few-shot blocks and chat prompts, randomized continuations, the mixin's
``pre_encode``/``tok_encode``; the fast path is asserted taken where it should be, and refused layouts say why."""

from __future__ import annotations

import functools
import json
import random
import statistics
import time
from pathlib import Path

import pytest

from distperp_harness.commands.tiny import sample_text
from distperp_harness.commands.tiny_tokenizers import (
    BOS_IN_FRONT,
    SPECIALS,
    Family,
    family_tokenizer,
    markup_text,
    mmlu_random_prompts,
    with_markup_tokens,
)
from distperp_harness.options import Options
from distperp_harness.planning import encoding, tokenizer_cuts
from distperp_harness.planning.encoding import PieceEncoder, PrefixSplit, encode_many, local_pipeline
from distperp_harness.planning.pretoken_steps import O200K
from distperp_harness.planning.tokenizer_cuts import (
    CutKind,
    _each_matches,
    _Matches,
    _matches,
    allowed_cuts,
    find_cut,
    pipeline_of,
)
from distperp_harness.tokens import Tokenization, loglikelihood_strings

TEXT = sample_text()
WORDS = TEXT.split()
SPECIALS_ON_OFF = [{}, {"add_special_tokens": False}]
FRAGMENTS = [
    *"abeEZ0.,'()?-_/<>=", "the", "river", " ", "  ", "\n", "\n\n", "\t", "\r\n", "12", "345", "'s", "--", "é",
    "e\u0301", "\u0301", "\u0308", "ñ", "漢字", "🙂", "👍🏽", "▁", "Ġ", "ﬁ", "½", "ｶ\uff9e", "Σ", "İ", "\u1100\u1161",
    "\u11a8", "가", "<\u0338", "\u00a0", "\u3000",
]  # fmt: skip
"""Letters, spaces, newlines, digits, punctuation, accents (precomposed and combining), CJK, emoji, markers of
byte-level and SentencePiece vocabularies, compatibility characters, Hangul jamo."""


def _edit(family: Family, **parts):
    """``family``'s tokenizer with parts of its configuration replaced (``normalizer=...``, ``pre_tokenizer=...``)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = family_tokenizer(family, [TEXT], 500)
    backend = tokenizer.backend_tokenizer
    config = json.loads(backend.to_str())
    config.update(parts)
    edited = Tokenizer.from_str(json.dumps(config))
    edited.post_processor = backend.post_processor
    return PreTrainedTokenizerFast(tokenizer_object=edited, clean_up_tokenization_spaces=False)


def _split(regex: str) -> dict:
    bytes_ = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {"type": "Sequence", "pretokenizers": [_isolated(regex), bytes_]}


def _isolated(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _metaspace(scheme: str, split: bool = True) -> dict:
    return {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": split}


def _normalizers(*steps: dict) -> dict:
    return {"type": "Sequence", "normalizers": list(steps)}


def _pre_tokenizers(*steps: dict) -> dict:
    return {"type": "Sequence", "pretokenizers": list(steps)}


SPACE_TO_MARK = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
VARIANTS = {
    "o200k": (Family.LLAMA3, {"pre_tokenizer": _split(O200K)}),
    "nfkc": (Family.LLAMA3, {"normalizer": {"type": "NFKC"}}),
    "nfd": (Family.QWEN2, {"normalizer": {"type": "NFD"}}),
    "nfkd+lowercase": (Family.QWEN2, {"normalizer": _normalizers({"type": "NFKD"}, {"type": "Lowercase"})}),
    "bytelevel prefix space": (
        Family.GPT2,
        {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}},
    ),
    "metaspace always": (Family.METASPACE, {"pre_tokenizer": _metaspace("always")}),
    "metaspace never": (Family.METASPACE, {"pre_tokenizer": _metaspace("never")}),
    "metaspace unsplit": (Family.METASPACE, {"pre_tokenizer": _metaspace("first", split=False)}),
    "gemma split on spaces": (
        Family.GEMMA,
        {
            "pre_tokenizer": {
                "type": "Split",
                "pattern": {"String": " "},
                "behavior": "MergedWithPrevious",
                "invert": False,
            }
        },
    ),
    "gemma nfc": (Family.GEMMA, {"normalizer": _normalizers({"type": "NFC"}, SPACE_TO_MARK)}),
    "whitespace": (Family.METASPACE, {"pre_tokenizer": {"type": "Whitespace"}}),
    "split digits punctuation": (
        Family.METASPACE,
        {
            "pre_tokenizer": _pre_tokenizers(
                {"type": "WhitespaceSplit"},
                {"type": "Digits", "individual_digits": False},
                {"type": "Punctuation", "behavior": "Contiguous"},
            )
        },
    ),
}
"""Variants of the families' parts (other Unicode forms, o200k's pattern, Metaspace schemes, char splitters)."""


@pytest.fixture(scope="module")
def families():
    return {family: family_tokenizer(family, [TEXT], 500) for family in Family}


def _with_flagged_tokens():
    """GPT-2's layout plus added tokens whose flags read beyond them: taking the whitespace before or after them
    (contents that start or end with whitespace too), whole words only, matched after the raw ones."""
    from tokenizers import AddedToken

    tokenizer = family_tokenizer(Family.GPT2, [TEXT], 500)
    tokenizer.backend_tokenizer.add_tokens(
        [
            AddedToken("<mask>", lstrip=True, rstrip=True, special=True, normalized=False),
            AddedToken(" zq", lstrip=True, normalized=False),
            AddedToken("qz ", rstrip=True, normalized=False),
            AddedToken("zz", single_word=True, normalized=False),
            AddedToken(" the", normalized=True),
        ]
    )
    return tokenizer


@pytest.fixture(scope="module")
def layouts(families):
    variants = {name: _edit(family, **parts) for name, (family, parts) in VARIANTS.items()}
    return {**{f.value: t for f, t in families.items()}, **variants, "flagged tokens": _with_flagged_tokens()}


def _exact(tokenizer, strings, special) -> None:
    assert encode_many(tokenizer, strings, **special) == [tokenizer.encode(s, **special) for s in strings]


def _block(seed: int, shots: int = 3) -> str:
    rng = random.Random(seed)
    piece = lambda n: " ".join(WORDS[(start := rng.randrange(len(WORDS) - n)) : start + n])  # noqa: E731
    return "The following are questions.\n\n" + "".join(
        f"Question: {piece(40)}?\nAnswer: {piece(6)}. The answer is (B).\n\n" for _ in range(shots)
    )


@pytest.mark.parametrize("family", list(Family), ids=lambda f: f.value)
@pytest.mark.parametrize("special", SPECIALS_ON_OFF, ids=["default", "no-specials"])
def test_a_prefix_ending_inside_a_special_token(families, family, special):
    """The issue's case and its kin: the shared prefix ends inside each special-token literal of the family, the
    strings complete it or not; every string gets its whole encode's ids, and the prefix was still cut. Ordered by
    length, the strings that complete the token sit where a check of four samples (shortest, longest, evenly
    between) does not look, as in the report."""
    tokenizer = families[family]
    for token in SPECIALS[family]:
        for k in range(1, len(token)):
            prefix = "Question: what is the answer? " * 10 + token[:k]
            rest, n = token[k:], len(token) - k
            tails = ["a", rest + "x", "b" * (n + 2), rest + "\nxy", "c" * (n + 4), rest + "x" * 5, rest + rest + "x"]
            strings = [prefix + t for t in tails + ["d" * (2 * n + 9)]]
            _exact(tokenizer, strings, special)
            cut = find_cut(tokenizer, prefix, special)
            assert cut.position is not None and cut.position + len(max(SPECIALS[family], key=len)) <= len(prefix)


def test_the_issue_strings(families):
    """The reported strings (SmolLM2's layout): 1, 3, 5 and 6 got other ids when the cut ignored special tokens."""
    tokenizer = families[Family.GPT2]
    prefix = "Question: what is the answer? " * 10 + "<|im_"
    tails = ["a", "end|>x", "abcdefg", "end|>xyzw", "abcdefghijk", "end|>xyzwvut", "end|>xyzwvutsrq", "abcdefghijklmn"]
    for special in SPECIALS_ON_OFF:
        _exact(tokenizer, [prefix + t for t in tails], special)
    assert find_cut(tokenizer, prefix, {}).kind is CutKind.PRE_TOKEN


def _spy(monkeypatch) -> list[str]:
    seen: list[str] = []
    batched = encoding._batched
    monkeypatch.setattr(
        encoding, "_batched", lambda tok, strings, **kw: seen.extend(strings) or batched(tok, strings, **kw)
    )
    return seen


@pytest.mark.parametrize("family", list(Family), ids=lambda f: f.value)
def test_fewshot_blocks_are_tokenized_once(families, family, monkeypatch):
    """Two few-shot blocks of ten questions (context + four answers each): two groups, each cut a few characters
    before its block's end (Gemma: where no merge crosses), every string's ids exact; only the heads, the tails and
    one check string per group are encoded."""
    tokenizer = families[family]
    strings = []
    for seed in (1, 2):
        block = _block(seed)
        for q in range(10):
            context = f"{block}Question: {' '.join(WORDS[q * 7 : q * 7 + 12])}?\nAnswer:"
            strings += [context] + [f"{context} ({letter})" for letter in "ABCD"]
    seen = _spy(monkeypatch)
    for special in SPECIALS_ON_OFF:
        _exact(tokenizer, strings, special)
    groups = encoding.shared_prefix_groups(strings)
    assert [len(members) for members, _ in groups] == [50, 50]
    for members, shared in groups:
        cut = find_cut(tokenizer, strings[members[0]][:shared], {})
        assert cut.kind is (CutKind.MERGES if family is Family.GEMMA else CutKind.PRE_TOKEN)
        assert cut.position is not None and shared - cut.position < 40
    assert sum(map(len, seen)) < 0.3 * 2 * sum(map(len, strings))
    if family in BOS_IN_FRONT:
        assert all(ids[0] == tokenizer.bos_token_id for ids in encode_many(tokenizer, strings))


@pytest.mark.parametrize("family", list(Family), ids=lambda f: f.value)
def test_chat_prompts_and_boundary_characters(families, family):
    """Prompts in each family's chat markers, and prefixes ending next to spaces, newlines, digits, punctuation,
    combining accents (NFC composes ``e`` + U+0301), compatibility characters and Hangul jamo, continued by text
    that interacts with them: every string exact."""
    tokenizer = families[family]
    start, end = SPECIALS[family][-2:]
    chat = f"{start}system\nYou answer questions.{end}\n{start}user\n{_block(3, 2)}"
    endings = ["", " ", "  ", "\n", "e", "e ", "12", "(", "<", "\u1100", "ｶ", "'", f"{end}\n{start}"]
    continuations = [
        "\u0301 a", "\u0308", "\u0338x", " \u0301", "3 4", "\n\nQ", "  x", "s and", "\u1161\u11a8", "\uff9e",
        f"{end}\n", "t", "é", "漢字 🙂", "\t1",
    ]  # fmt: skip
    for ending in endings:
        strings = [chat + ending + c for c in continuations]
        for special in SPECIALS_ON_OFF:
            _exact(tokenizer, strings, special)
    assert find_cut(tokenizer, chat, {}).position is not None


def _random_text(rng: random.Random, pieces: list[str], n: int) -> str:
    return "".join(rng.choice(pieces) for _ in range(n))


@pytest.mark.parametrize("name", [f.value for f in Family] + list(VARIANTS) + ["flagged tokens"])
def test_randomized_continuations_never_change_ids(layouts, name):
    """Random prefixes and continuations over the mix of :data:`FRAGMENTS` and pieces of every added token: the last
    cut (what ``encode_many`` uses) and three other allowed cuts of each prefix, checked against whole encodes on
    every string: 0 differences; most prefixes are cut."""
    tokenizer = layouts[name]
    pipeline = pipeline_of(tokenizer)
    assert not isinstance(pipeline, str), pipeline
    rng = random.Random(0)
    tokens = [t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values()]
    pieces = (
        FRAGMENTS + [t[:i] for t in tokens for i in range(1, len(t))] + [t[i:] for t in tokens for i in range(len(t))]
    )
    cut_prefixes, differences = 0, []
    for _ in range(40):
        words = " ".join(WORDS[(i := rng.randrange(len(WORDS) - 30)) : i + rng.randrange(30)])
        prefix = (
            _random_text(rng, pieces, rng.randrange(1, 12)) + words + _random_text(rng, pieces, rng.randrange(1, 25))
        )
        cuts = list(allowed_cuts(pipeline, prefix))
        cut_prefixes += bool(cuts)
        for c, _ in cuts[:1] + rng.sample(cuts[1:], min(3, len(cuts[1:]))):
            strings = [prefix + _random_text(rng, pieces, rng.randrange(6)) for _ in range(6)]
            for special in SPECIALS_ON_OFF:
                head = tokenizer(prefix[:c], **special)["input_ids"]
                tails = tokenizer([s[c:] for s in strings], add_special_tokens=False)["input_ids"]
                wholes = tokenizer(strings, **special)["input_ids"]
                differences += [(c, s) for s, tail, whole in zip(strings, tails, wholes) if head + tail != whole]
    assert differences == []
    assert cut_prefixes >= 30


@pytest.fixture(scope="module")
def markup():
    """Gemma's layout with an added vocabulary shaped like Gemma 3's: 6,326 contents that start with ``<``."""
    return with_markup_tokens(family_tokenizer(Family.GEMMA, [TEXT], 500))


@functools.cache
def _lengths(automaton) -> tuple[frozenset[str], tuple[int, ...]]:
    return frozenset(automaton.contents), tuple(sorted({len(c) for c in automaton.contents}, reverse=True))


def _every_try(added, prefix: str) -> _Matches:
    """What the scan must find, by trying every content at every position (the definition, not the algorithm: each
    substring of a content's length looked up among the contents), then extraction's choices position by position."""
    contents, lengths = _lengths(added.automaton)
    hits = [(i, prefix[i : i + n]) for i in range(len(prefix)) for n in lengths if prefix[i : i + n] in contents]
    spans = [(i, i + len(t), t) for i, t in hits if i + len(t) <= len(prefix)]
    found = _Matches(
        blocked={p for i, e, _ in spans for p in range(i + 1, e)} | {p for i, e, t in spans
                                                                    if t in added.single_word for p in (i, e)},
        lstrip_starts={i for i, _, t in spans if t in added.lstrip},
        rstrip_ends={e for _, e, t in spans if t in added.rstrip},
    )  # fmt: skip
    longest_raw = {}
    for i, e, t in spans:  # by start, longest first
        if t in added.raw:
            longest_raw.setdefault(i, (e, t))
    for i in sorted(longest_raw):
        e, t = longest_raw[i]
        if i >= found.free:
            found.free = e
            if t not in added.single_word:
                found.starts.add(i)
                found.ends.add(e)
    return found


@pytest.mark.parametrize("name", ["flagged tokens", "markup"])
def test_the_scan_finds_what_trying_every_content_finds(layouts, markup, name):
    """One automaton pass gives the occurrences, flags and extraction's choices that trying every content at every
    position gives: random texts over pieces of every content (overlaps, flags, unfinished tokens), and texts
    continuing a shared start scanned once (what a group's continuations are proved on)."""
    tokenizer = markup if name == "markup" else layouts[name]
    added = pipeline_of(tokenizer).added
    rng = random.Random(1)
    tokens = [t for t in added.automaton.contents if not t.startswith("<unused") or rng.random() < 0.01]
    pieces = FRAGMENTS + tokens + [t[:i] for t in tokens for i in range(1, len(t))] + [" ", "  ", "zz", "x"]
    for _ in range(60):
        text = _random_text(rng, pieces, rng.randrange(1, 60))
        assert _matches(added, text) == _every_try(added, text), text
        texts = [text + _random_text(rng, pieces, rng.randrange(0, 6)) for _ in range(4)]
        assert _each_matches(added, texts, len(text)) == [_every_try(added, t) for t in texts], texts


def test_continuations_whose_tokens_start_before_the_shared_ones(families):
    """Nested raw contents across the end of a shared start: a continuation's longer token starting before a shorter
    one inside the shared characters wins extraction, as in the whole text (random joins over their pieces)."""
    from tokenizers import AddedToken

    tokenizer = family_tokenizer(Family.GPT2, [TEXT], 300)
    long, inner = "abcdefghijklmnop", "bcdefghijklmno"  # the longest contents: the join falls within their reach
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in (long, inner, "cd", "mnopq", "p")])
    added = pipeline_of(tokenizer).added
    assert added.longest == len(long)
    assert _each_matches(added, ["xxx" + long], 18) == [_every_try(added, "xxx" + long)]
    rng = random.Random(4)
    pieces = [*"xabcdmnopq", "abc", "efghijkl", "mno", long[:9], long[9:], inner, long]
    for _ in range(300):
        start = _random_text(rng, pieces, rng.randrange(1, 8))
        texts = [start + _random_text(rng, pieces, rng.randrange(0, 4)) for _ in range(3)]
        assert _each_matches(added, texts, len(start)) == [_every_try(added, t) for t in texts], texts


def _median_seconds(runs: dict, repeats: int = 3) -> dict:
    times: dict = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def test_thousands_of_added_tokens_cost_about_one_encode(markup):
    """The issue's case: a 10k-character prefix with 1,250 ``<`` against 6,326 contents that start with ``<``. The
    cut is found in about the time of encoding the prefix whole (trying each content at each ``<`` took ~250 times
    that), and a 12-string group sharing it in about the time of encoding the strings one by one (~20 times);
    every string's ids are its whole encode's."""
    prefix = markup_text(WORDS, 10_000, 1_250)
    assert len(prefix) == 10_000 and prefix.count("<") == 1_250
    group = [prefix + tail for tail in ["a", "td>", "unused7>", "<b>x", " < y", "</td>", "<unused12>", "br>", "<u"]]
    group += [prefix + " " + " ".join(WORDS[i : i + 9]) for i in range(3)]
    pipeline_of(markup)  # read once (the automaton is built then)
    seconds = _median_seconds(
        {
            "cut": lambda: find_cut(markup, prefix, {}),
            "whole": lambda: markup(prefix),
            "group": lambda: encode_many(markup, group),
            "one by one": lambda: [markup.encode(s) for s in group],
        }
    )
    assert seconds["cut"] < 5 * seconds["whole"], seconds
    assert seconds["group"] < 3 * seconds["one by one"], seconds
    assert find_cut(markup, prefix, {}).position is not None
    for special in SPECIALS_ON_OFF:
        _exact(markup, group, special)


@pytest.mark.parametrize("name", [f.value for f in Family] + list(VARIANTS) + ["flagged tokens"])
def test_cuts_read_from_the_strings_never_change_ids(layouts, name):
    """Random shared prefixes and groups of strings continuing them over :data:`FRAGMENTS` and pieces of every added
    token: the cut chosen with the strings' own continuations read (often at the very end of the shared prefix,
    where the prefix alone allows nothing within ``longest`` characters) keeps every string's ids."""
    tokenizer = layouts[name]
    pipeline = pipeline_of(tokenizer)
    rng = random.Random(2)
    tokens = [t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values()]
    pieces = FRAGMENTS + tokens + [t[:i] for t in tokens for i in range(1, len(t))]
    late, differences = 0, []
    for _ in range(40):
        words = " ".join(WORDS[(i := rng.randrange(len(WORDS) - 30)) : i + rng.randrange(30)])
        prefix = _random_text(rng, pieces, rng.randrange(1, 12)) + words + _random_text(rng, pieces, 4)
        strings = [prefix + _random_text(rng, pieces, rng.randrange(1, 10)) for _ in range(rng.randrange(1, 8))]
        for special in SPECIALS_ON_OFF:
            cut = find_cut(tokenizer, prefix, special, strings)
            if cut.position is None:
                continue
            late += cut.position > len(prefix) - max(pipeline.added.longest, 2)
            head = tokenizer(prefix[: cut.position], **special)["input_ids"]
            tails = tokenizer([s[cut.position :] for s in strings], add_special_tokens=False)["input_ids"]
            wholes = tokenizer(strings, **special)["input_ids"]
            differences += [s for s, tail, whole in zip(strings, tails, wholes) if head + tail != whole]
    assert differences == []
    assert late >= 5


def test_continuations_read_and_their_limits(families):
    """A cut at the end of the shared prefix needs the strings; strings not starting with the prefix are refused;
    more than ``MAX_AHEAD`` distinct continuations fall back to the prefix alone."""
    tokenizer = families[Family.GPT2]
    prefix = _block(8) + "Question: what is it?\nAnswer: B"
    strings = [prefix + f"\n\n{word} and more text after it" for word in WORDS[:20]]
    alone = find_cut(tokenizer, prefix, {})
    read = find_cut(tokenizer, prefix, {}, strings)
    assert alone.position is not None and alone.position < len(prefix) - 10
    assert read.position == len(prefix) and read.kind is CutKind.PRE_TOKEN
    with pytest.raises(ValueError, match="must start with"):
        find_cut(tokenizer, prefix, {}, strings + ["elsewhere"])
    many = [prefix + f"\n\nq{i}" for i in range(tokenizer_cuts.MAX_AHEAD + 1)]
    assert find_cut(tokenizer, prefix, {}, many) == alone


def _refused_layouts(families):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    class Overriding(PreTrainedTokenizerFast):
        def encode(self, text, *args, **kwargs):
            return super().encode(text, *args, **kwargs)

    llama2 = _normalizers({"type": "Prepend", "prepend": "▁"}, SPACE_TO_MARK)
    roberta = family_tokenizer(Family.GPT2, [TEXT], 500)
    roberta.backend_tokenizer.post_processor = processors.RobertaProcessing(("<|im_end|>", 2), ("<|im_start|>", 1))
    split_special = family_tokenizer(Family.QWEN2, [TEXT], 500)
    split_special.split_special_tokens = True
    unknown_regex = _edit(Family.LLAMA3, pre_tokenizer=_split(r"\s+|\S+"))
    return {
        "a Prepend normalizer": _edit(Family.GEMMA, normalizer=llama2),
        "a Split pre-tokenizer on a regex without a proved cut rule": unknown_regex,
        "the post-processor adds tokens after the text": roberta,
        "special tokens are encoded as text": split_special,
        "Overriding overrides encode": Overriding(tokenizer_object=families[Family.GPT2].backend_tokenizer),
    }  # fmt: skip


def test_what_cannot_be_proved_is_refused_and_encoded_whole(families):
    """A refused pipeline part is named, and its strings are still exact (encoded whole); a post-processor that
    adds tokens after the text is cut only without special tokens."""
    strings = [_block(5) + f"Question {i}: <|im_" + tail for i in range(3) for tail in ("end|>", "start|>x", "a b")]
    for reason, tokenizer in _refused_layouts(families).items():
        cut = find_cut(tokenizer, _block(5), {})
        assert cut.position is None and reason in cut.reason
        for special in SPECIALS_ON_OFF:
            _exact(tokenizer, strings * 3, special)
    roberta = _refused_layouts(families)["the post-processor adds tokens after the text"]
    assert local_pipeline(roberta) is None
    assert find_cut(roberta, _block(5), {"add_special_tokens": False}).position is not None
    assert "other than add_special_tokens" in find_cut(families[Family.GPT2], _block(5), {"truncation": True}).reason


def test_a_cut_the_proof_refuses_would_change_ids(families):
    """Inside a word (no pre-token boundary) the tails encoded alone differ: the proof never allows it, and the
    split it does allow is exact."""
    tokenizer = families[Family.LLAMA3]
    block = _block(6)
    strings = [block + f"Question {i}?" for i in range(8)]
    inside = block.index(" the ") + 2
    assert inside not in {c for c, _ in allowed_cuts(pipeline_of(tokenizer), block)}
    head = tuple(tokenizer(block[:inside])["input_ids"])
    assert PrefixSplit(tokenizer, head, inside, CutKind.PRE_TOKEN).encode(strings) != encode_many(tokenizer, strings)
    split = PrefixSplit.find(tokenizer, strings, len(block), {})
    assert split is not None and split.encode(strings) == [tokenizer.encode(s) for s in strings]


class _Tokenizing(Tokenization):
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.options = Options(pretrained="unused")


@pytest.mark.parametrize("family", list(Family), ids=lambda f: f.value)
def test_pre_encode_then_tok_encode_are_exact(families, family):
    """Through the mixin: ``pre_encode`` fills the call's memo with cut strings (contexts that complete a marker the
    shared prefix ends inside, continuations, lm-eval's trailing-space move), ``tok_encode`` reads the same ids one
    encode each gives."""
    lm = _Tokenizing(families[family])
    marker = SPECIALS[family][-1]
    prefix = _block(7) + marker[:3]
    pairs = [(prefix + rest, answer) for rest in (marker[3:] + "\n", "xy ", marker[3:]) for answer in (" A", "B")]
    pairs += [(prefix + f"z{i} ", " C") for i in range(8)] + [("", " alone")]
    keys = list(dict.fromkeys(loglikelihood_strings(pairs)))
    keys += [(s, add) for s, _ in keys for add in (False, True)]
    alone = {key: lm.tok_encode(*key) for key in keys}
    with lm.one_call():
        lm.pre_encode(keys)
        assert {key: lm.tok_encode(*key) for key in keys} == alone


SMOLLM2 = Path.home() / ".cache" / "distperp" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's real tokenizer, converted from ``../shared`` (its README: ``to_hf.py``)."""
    if not (SMOLLM2 / "tokenizer.json").exists():
        pytest.skip("no local SmolLM2 tokenizer (../shared/models/smollm2-135m-instruct/README.md: to_hf.py)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM2)


def test_the_issue_case_on_the_real_smollm2_tokenizer(smollm2):
    tokenizer = smollm2
    prefix = "Question: what is the answer? " * 10 + "<|im_"
    tails = ["a", "end|>x", "abcdefg", "end|>xyzw", "abcdefghijk", "end|>xyzwvut", "end|>xyzwvutsrq"]
    strings = [prefix + t for t in tails + ["abcdefghijklmnopqrstuvwxyz"]]
    for special in SPECIALS_ON_OFF:
        _exact(tokenizer, strings, special)
    assert find_cut(tokenizer, prefix, {}).kind is CutKind.PRE_TOKEN


@pytest.mark.parametrize("name", [f.value for f in Family] + ["smollm2"])
def test_random_fewshot_prompts_are_cut_at_their_examples(request, families, name, monkeypatch):
    """lm-eval's default sampler (each question draws its subject's five examples in a random order), MMLU's template,
    2 subjects x 40 questions x 4 answers: every string's ids are its whole encode's, with and without special
    tokens. The tails are grouped again level after level (the header, then one example per level); a piece cut by
    several groups is encoded once (``pieces`` < ``groups``); each example is in under a quarter as many strings
    encoded as prompts holding it, and the characters encoded are under a third of the strings'."""
    tokenizer = request.getfixturevalue("smollm2") if name == "smollm2" else families[Family(name)]
    strings = mmlu_random_prompts(WORDS, 2, 40)
    for special in SPECIALS_ON_OFF:
        _exact(tokenizer, strings, special)
    seen = _spy(monkeypatch)
    encoder = PieceEncoder(tokenizer, {})
    assert encoder.encode(strings) == [tokenizer.encode(s) for s in strings]
    assert encoder.levels >= 6 and len(encoder.pieces) < encoder.groups, encoder
    examples = {example for s in strings for example in s.split("\n\n")[1:-1]}
    assert len(examples) == 2 * 5
    for example in examples:
        holding = sum(example in s for s in strings)
        encoded = sum(example in s for s in seen)
        assert 4 * encoded < holding, (example[:40], encoded, holding)
    assert encoder.encoded == sum(map(len, seen)) < sum(map(len, strings)) / 3
