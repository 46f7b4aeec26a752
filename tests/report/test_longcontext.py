"""The documents of the long-context tasks (``distperp_harness/report/longcontext.py``): joining texts into long
documents, the needle's place, the choices, determinism and the settings' errors. Pure Python, no model."""

from __future__ import annotations

import re

import pytest

from distperp_harness.errors import InputError
from distperp_harness.report import longcontext as lc
from distperp_harness.report.wikitext import split_wikitext_articles

SENTENCE_END = re.compile(r"[.!?] |\n")


@pytest.fixture(scope="module")
def sample_articles(sample_text_path):
    return [a for a in split_wikitext_articles(sample_text_path.read_text(encoding="utf-8")) if a.strip()]


def test_join_to_length_keeps_order_and_reaches_the_length():
    texts = ["a" * 3, "b" * 4, " ", "c" * 2, "d" * 5, "e"]
    assert lc.join_to_length(texts, 6) == ["aaa\nbbbb", "cc\nddddd\ne"]  # the short remainder "e" joins the last
    assert lc.join_to_length(texts, 100) == ["aaa\nbbbb\ncc\nddddd\ne"]  # all together shorter: one document
    assert lc.join_to_length(texts, 1) == ["aaa", "bbbb", "cc", "ddddd", "e"]


def test_join_wikitext_sample(sample_articles):
    docs = lc.join_to_length(sample_articles, 4000)
    assert 1 < len(docs) < len(sample_articles)
    assert all(len(d) >= 4000 for d in docs)
    assert "\n".join(docs) == "\n".join(sample_articles)  # nothing lost, nothing reordered
    assert [len(split_wikitext_articles(d)) for d in docs] and sum(len(split_wikitext_articles(d)) for d in docs) == 9


def test_sentence_start_and_insert_needle():
    text = "One two. Three four.\nFive six. Seven"
    assert lc.sentence_start(text, 0) == 0
    assert lc.sentence_start(text, 12) == 9  # inside "Three four."
    assert lc.sentence_start(text, 22) == 21  # after the newline
    assert lc.sentence_start(text, len(text)) == len(text)
    assert lc.insert_needle(text, "N.", 0) == ("N. " + text, 0)
    assert lc.insert_needle(text, "N.", 100) == (text + " N.", len(text) + 1)
    assert lc.insert_needle(text, "N.", 75) == ("One two. Three four.\nN. Five six. Seven", 21)
    assert lc.insert_needle(text, "N.", 50) == ("One two. N. Three four.\nFive six. Seven", 9)


def needles(texts, **kwargs):
    settings = {"context_chars": 3000, "depths": (0, 25, 50, 75, 100), "docs_per_depth": 3, "seed": 7, **kwargs}
    return lc.needle_docs(texts, **settings)


def test_needle_at_the_chosen_depth_then_the_question(sample_articles):
    docs = needles(sample_articles)
    assert [d.depth for d in docs] == [float(p) for p in (0, 25, 50, 75, 100) for _ in range(3)]
    for doc in docs:
        filler = doc.prompt[: doc.needle_start].rstrip() + doc.prompt[doc.needle_start + len(doc.needle) :]
        filler = filler[: -len(lc.QUESTION.format(name=doc.name))]
        assert 2000 < doc.filler_chars <= 3000 and len(filler.strip()) <= doc.filler_chars + 1
        assert doc.needle == f"The secret number of {doc.name} is {doc.answer}."
        assert doc.prompt[doc.needle_start :].startswith(doc.needle) and doc.prompt.count(doc.needle) == 1
        assert doc.prompt.endswith(f"\n\nQuestion: What is the secret number of {doc.name}?\nAnswer:")
        assert doc.prompt.index("Question:") > doc.needle_start
        target = round(doc.filler_chars * doc.depth / 100)
        if doc.depth == 0:
            assert doc.needle_start == 0
        elif doc.depth == 100:
            assert doc.needle_start == doc.filler_chars + 1  # after the last sentence (and a space)
        else:  # at the start of the sentence that holds the target offset: no sentence end in between
            assert doc.needle_start <= target
            assert not SENTENCE_END.search(
                doc.prompt[doc.needle_start + len(doc.needle) + 1 : target + len(doc.needle)]
            )
            assert SENTENCE_END.search(doc.prompt[doc.needle_start - 2 : doc.needle_start]) or doc.needle_start == 0


def test_the_answer_is_among_distinct_choices_absent_from_the_filler(sample_articles):
    docs = needles(sample_articles, n_choices=5, digits=6)
    for doc in docs:
        assert len(doc.choices) == 5 == len(set(doc.choices)) and doc.choices[doc.label] == doc.answer
        assert all(re.fullmatch(r"[1-9]\d{5}", c) for c in doc.choices)
        assert all(doc.prompt.count(c) == (2 if c == doc.answer else 0) - (c == doc.answer) for c in doc.choices)
    assert len({d.label for d in docs}) > 1  # the right answer is not always in the same place


def test_needles_are_deterministic_and_differ_only_by_place_across_depths(sample_articles):
    first, again = needles(sample_articles), needles(list(sample_articles))
    assert first == again
    assert needles(sample_articles, seed=8) != first
    by_index: dict[int, set] = {}
    for doc in first:
        filler = doc.prompt.replace(doc.needle, "").split("\n\nQuestion:")[0]
        by_index.setdefault(doc.index, set()).add((" ".join(filler.split()), doc.name, doc.answer, tuple(doc.choices)))
    assert all(len(v) == 1 for v in by_index.values()) and len(by_index) == 3
    assert len({next(iter(v))[1:3] for v in by_index.values()}) == 3  # each index its own needle
    # the filler cycles when the texts are shorter than context_chars
    short = lc.needle_docs(["Alpha beta. Gamma delta."], context_chars=200, depths=(50,), docs_per_depth=1, seed=1)
    assert short[0].filler_chars <= 200 and short[0].prompt.count("Alpha beta.") > 3


def test_filler_is_cut_after_a_sentence():
    text = lc.filler_text(["One two three. Four five six. Seven eight nine."], 0, 35)
    assert text == "One two three. Four five six."
    assert lc.filler_text(["word " * 20], 0, 12) == "word word"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("context_chars", 0, "--metadata context_chars=0 is not an integer >= 1"),
        ("context_chars", "lots", "--metadata context_chars='lots' is not an integer >= 1"),
        ("docs_per_depth", True, "--metadata docs_per_depth=True is not an integer >= 1"),
        ("n_choices", 50, "--metadata n_choices=50 is not an integer >= 2 and <= 20"),
    ],
)
def test_positive_int_names_the_key(key, value, message):
    maximum = 20 if key == "n_choices" else None
    minimum = 2 if key == "n_choices" else 1
    with pytest.raises(InputError) as info:
        lc.positive_int(key, value, minimum=minimum, maximum=maximum)
    assert str(info.value).startswith(message) and "Fix: " in str(info.value) and info.value.same_on_every_rank
    assert lc.positive_int("seed", "12", minimum=0) == 12


def test_depths():
    assert lc.depths_percent([0, 12.5, 100]) == (0.0, 12.5, 100.0) and lc.depths_percent(50) == (50.0,)
    for bad, said in [([], "non-empty list"), ([0, 120], "holds 120"), ("50", "non-empty list"), ([5, 5], "twice")]:
        with pytest.raises(InputError, match=said):
            lc.depths_percent(bad)
    assert [lc.depth_label(d) for d in (0.0, 25.0, 12.5)] == ["0", "25", "12.5"]


def test_too_few_numbers_is_one_error():
    digits = "".join(str(n) for n in range(1000, 10000))  # every 4-digit number occurs in the filler
    with pytest.raises(InputError, match="--metadata digits=4 leaves too few numbers"):
        lc.needle_docs([digits], context_chars=len(digits), depths=(0,), docs_per_depth=1, digits=4)
    with pytest.raises(InputError, match="every source document is blank"):
        lc.needle_docs([" ", "\n"])


def test_first_number():
    assert lc.first_number(" 4817263.\n") == "4817263" and lc.first_number("no idea") is None
    assert lc.first_number("It is 12, not 13") == "12"
