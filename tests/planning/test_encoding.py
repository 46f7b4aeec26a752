"""Tests of :mod:`distperp_harness.planning.encoding`: batched encodes and a shared few-shot prefix tokenized once,
to the same ids as one ``encode`` per string on every task shape (few-shot multiple choice with shared and unshared
prefixes, rolling texts, chat-templated prompts, generation prompts, non-ASCII text), with and without a BOS the
tokenizer adds, a SentencePiece-style prefix space and a normalizer; a pipeline part no cut can be proved through
is named and its strings are encoded whole; a cut that would change ids is caught by the one-string check."""

from __future__ import annotations

import random

import pytest

from distperp_harness.commands.tiny import sample_text, train_tokenizer
from distperp_harness.commands.tiny_tokenizers import mmlu_random_prompts
from distperp_harness.planning import encoding
from distperp_harness.planning.encoding import (
    PieceEncoder,
    PrefixSplit,
    encode_many,
    local_pipeline,
    shared_prefix_groups,
)
from distperp_harness.planning.tokenizer_cuts import Cut, CutKind, find_cut

WORDS = sample_text().split()


def _piece(rng: random.Random, n: int) -> str:
    start = rng.randrange(len(WORDS) - n)
    return " ".join(WORDS[start : start + n])


def task_strings(seed: int = 0) -> list[str]:
    """What lm-eval asks a loglikelihood call to encode: per question its context and context + each answer, for
    two few-shot blocks of ten questions each (shared prefixes), zero-shot questions (no shared prefix),
    chat-templated and non-ASCII contexts, and rolling texts."""
    rng = random.Random(seed)
    out = []
    for block in range(2):
        shots = f"The following are questions about topic {block}.\n\n" + "\n\n".join(
            f"Question: {_piece(rng, 60)}\nAnswer: {_piece(rng, 8)} The answer is (B)." for _ in range(3)
        )
        chat = "<|im_start|>user\n" if block else ""
        for _ in range(10):
            context = f"{chat}{shots}\n\nQuestion: {_piece(rng, 30)} ünï 漢字\nAnswer:"
            out += [context] + [f"{context} ({letter})" for letter in "ABCD"]
    for _ in range(5):
        context = f"Question: {_piece(rng, 20)}\nAnswer:"
        out += [context, context + " yes", context + " no"]
    return out + [_piece(rng, 200) for _ in range(3)]


@pytest.fixture(scope="module")
def tokenizers():
    """Byte-level BPE tokenizers trained on the packaged sample: one adding no special tokens, one adding a BOS,
    one with a SentencePiece-style prefix space (Metaspace), one with a normalizer, one with a normalizer no cut
    is proved through (Prepend)."""
    from tokenizers import normalizers, pre_tokenizers, processors

    plain = train_tokenizer([sample_text()], 512)
    with_bos = train_tokenizer([sample_text()], 512)
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", with_bos.bos_token_id)]
    )
    metaspace = train_tokenizer([sample_text()], 512)
    metaspace.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    normalized = train_tokenizer([sample_text()], 512)
    normalized.backend_tokenizer.normalizer = normalizers.NFKC()
    prepended = train_tokenizer([sample_text()], 512)
    prepended.backend_tokenizer.normalizer = normalizers.Prepend("▁")
    return {"plain": plain, "bos": with_bos, "metaspace": metaspace, "normalized": normalized, "prepended": prepended}


@pytest.mark.parametrize("name", ["plain", "bos", "metaspace", "normalized", "prepended"])
@pytest.mark.parametrize("special", [{}, {"add_special_tokens": False}])
def test_same_ids_as_one_encode_each(tokenizers, name, special):
    tokenizer = tokenizers[name]
    strings = task_strings()
    assert encode_many(tokenizer, strings, **special) == [tokenizer.encode(s, **special) for s in strings]


@pytest.mark.parametrize("name", ["bos", "metaspace", "normalized"])
def test_a_shared_prefix_is_tokenized_once(tokenizers, name, monkeypatch):
    """The two few-shot blocks are two groups; every member of a group is encoded as the shared head plus its own
    tail (no member whole: the check string of each group runs ``CHECK_BEYOND`` characters past the shared prefix),
    and the head carries the BOS."""
    tokenizer = tokenizers[name]
    assert local_pipeline(tokenizer) is None
    seen: list[str] = []
    batched = encoding._batched
    monkeypatch.setattr(
        encoding, "_batched", lambda tok, strings, **kw: seen.extend(strings) or batched(tok, strings, **kw)
    )
    strings = task_strings()
    ids = encode_many(tokenizer, strings)
    assert ids == [tokenizer.encode(s) for s in strings]
    groups = shared_prefix_groups(strings)
    assert [len(members) for members, _ in groups] == [50, 50]
    long_ones = {strings[i] for members, _ in groups for i in members}
    assert not long_ones & set(seen)
    for members, shared in groups:
        assert min((strings[i] for i in members), key=len)[: shared + encoding.CHECK_BEYOND] in seen
    assert sum(len(s) for s in seen) < 0.3 * sum(len(s) for s in strings)
    if name == "bos":
        assert all(ids[i][0] == tokenizer.bos_token_id for members, _ in groups for i in members)


def test_what_cannot_be_proved_is_said(tokenizers):
    assert local_pipeline(tokenizers["plain"]) is None
    assert local_pipeline(tokenizers["metaspace"]) is None and local_pipeline(tokenizers["normalized"]) is None
    assert "Prepend normalizer" in local_pipeline(tokenizers["prepended"])


def test_the_check_refuses_a_split_that_changes_ids(tokenizers, monkeypatch, caplog):
    """A cut inside a word (no pre-token boundary), forced past the proof: the tails encoded alone differ, the
    one-string check finds it, says so and the group is encoded whole; the cut the proof chooses passes."""
    tokenizer = tokenizers["bos"]
    strings = task_strings()
    members, shared = shared_prefix_groups(strings)[0]
    group = [strings[i] for i in members]
    inside = group[0].index(" the ") + 2  # between "t" and "he": " the" is one token of this vocabulary
    assert len(tokenizer.encode(" the", add_special_tokens=False)) == 1
    split = PrefixSplit.find(tokenizer, group, shared, {})
    assert split is not None and 0 < split.cut < shared and split.kind is CutKind.PRE_TOKEN
    assert split.encode(group) == [tokenizer.encode(s) for s in group]
    monkeypatch.setattr(PrefixSplit, "choose", staticmethod(lambda *args: Cut(inside, CutKind.PRE_TOKEN)))
    assert PrefixSplit.find(tokenizer, group, shared, {}) is None and "changed the ids" in caplog.text
    assert encode_many(tokenizer, strings) == [tokenizer.encode(s) for s in strings]


def test_groups_of_shared_prefixes():
    head = "x" * 40
    strings = [head + f"{i}tail" for i in range(5)] + ["y" * 50, head[:10] + "z", "short"]
    assert shared_prefix_groups(strings, min_chars=30, min_group=3) == [([0, 1, 2, 3, 4], 40)]
    assert shared_prefix_groups(strings, min_chars=30, min_group=6) == []
    assert shared_prefix_groups([], min_chars=30, min_group=1) == []
    assert encoding._common("abcdef", "abcxyz") == 3 and encoding._common("", "a") == 0


@pytest.mark.parametrize("name", ["bos", "metaspace"])
def test_what_nothing_shares_costs_no_more_characters(tokenizers, name):
    """Zero-shot questions and rolling texts: no level, every string encoded once, whole. Random 5-shot prompts whose
    examples come from a pool of 300 (few recur): only the shared header is cut, and the characters encoded (checks
    included) are fewer than the strings'. Ids exact throughout."""
    tokenizer = tokenizers[name]
    rng = random.Random(3)
    unshared = [f"Question: {_piece(rng, 20)}\nAnswer:{a}" for _ in range(30) for a in ("", " yes")]
    unshared += [_piece(rng, 300) for _ in range(5)]
    encoder = PieceEncoder(tokenizer, {})
    assert encoder.encode(unshared) == [tokenizer.encode(s) for s in unshared]
    assert (encoder.levels, encoder.groups, encoder.encoded) == (0, 0, sum(map(len, unshared)))
    pooled = mmlu_random_prompts(WORDS, 1, 60, pool=300)
    encoder = PieceEncoder(tokenizer, {})
    assert encoder.encode(pooled) == [tokenizer.encode(s) for s in pooled]
    assert encoder.levels >= 1 and encoder.encoded < sum(map(len, pooled)), encoder


def test_a_piece_is_encoded_once_per_text_and_special_rule(tokenizers):
    """Two groups whose heads are the same text (with and without a BOS rule apart) share one piece."""
    tokenizer = tokenizers["bos"]
    encoder = PieceEncoder(tokenizer, {})
    first = encoder.piece("The following are questions.", {})
    assert encoder.piece("The following are questions.", {}) is first
    assert encoder.piece("The following are questions.", {"add_special_tokens": False}) == tuple(first[1:])
    assert len(encoder.pieces) == 2


def test_a_group_is_cut_only_where_it_pays_and_nothing_is_spent_elsewhere(tokenizers):
    """Eight strings sharing 300 characters whose only provable cut is after the first word: the earliest worthwhile
    cut (``PieceEncoder.split``'s bound) is far later, so no position before it is tried, no piece and no check is
    encoded, and every string is encoded once, whole; with 400 such strings the same cut pays and is taken."""
    tokenizer = tokenizers["plain"]
    prefix = "word " + "x" * 295
    assert find_cut(tokenizer, prefix, {}).position == 4
    assert find_cut(tokenizer, prefix, {}, lowest=5).position is None
    few = [prefix + f"{i} tail" for i in range(8)]  # "x" then a digit: no provable cut where they part
    encoder = PieceEncoder(tokenizer, {})
    assert encoder.encode(few) == [tokenizer.encode(s) for s in few]
    assert (encoder.groups, encoder.pieces, encoder.encoded) == (0, {}, sum(map(len, few)))
    many = [prefix + f"{i} tail" for i in range(400)]
    encoder = PieceEncoder(tokenizer, {})
    assert encoder.encode(many) == [tokenizer.encode(s) for s in many]
    assert encoder.groups == 1 and list(encoder.pieces) == [("word", True)]
