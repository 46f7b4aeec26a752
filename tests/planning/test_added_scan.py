"""Tests of :mod:`distperp_harness.planning.added_scan`: the automaton reports exactly the occurrences that trying every
content at every position finds (overlapping contents, contents inside others, repeated characters, non-ASCII,
regex metacharacters), in one pass whose time does not grow with the number of contents."""

from __future__ import annotations

import random
import time

from distperp_harness.planning.added_scan import ContentAutomaton

CONTENTS = [
    "a", "ab", "abc", "bc", "b", "aa", "aaa", "ca", "<|im_start|>", "<|im_end|>", "<|im", "|>", "<", "<unk>", "unk",
    "]", "[", "^", "-", "\\", "]]", "é", "e\u0301", "漢字", "字", "🙂", " ", "  ", "\n\n",
]  # fmt: skip


def _every_try(contents: list[str], text: str) -> list[tuple[int, str]]:
    return sorted(
        ((i, c) for i in range(len(text)) for c in set(contents) if c and text.startswith(c, i)),
        key=lambda hit: (hit[0], -len(hit[1]), hit[1]),
    )


def test_occurrences_are_those_of_trying_every_content_everywhere():
    rng = random.Random(0)
    pieces = CONTENTS + ["x", "yz", "<|", "im_", "start", "end", "|", "\u0301"]
    for trial in range(300):
        contents = rng.sample(CONTENTS, rng.randrange(1, len(CONTENTS)))
        automaton = ContentAutomaton(contents + [""])  # an empty content matches nothing
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 40)))
        found = [(start, automaton.contents[number]) for start, number in automaton.occurrences(text)]
        assert found == _every_try(contents, text), (trial, contents, text)


def test_a_scan_continues_from_the_state_a_shared_start_ends_in():
    """Scanning a text's start once and each continuation from the state it ends in finds, together, every
    occurrence of each whole text (those straddling the join included)."""
    rng = random.Random(1)
    automaton = ContentAutomaton(CONTENTS)
    for _ in range(200):
        start = "".join(rng.choice(CONTENTS + ["x"]) for _ in range(rng.randrange(0, 12)))
        head, state = automaton.scan(start)
        for _ in range(3):
            text = start + "".join(rng.choice(CONTENTS + ["x"]) for _ in range(rng.randrange(0, 6)))
            rest, _ = automaton.scan(text, len(start), state)
            assert sorted(head + rest) == automaton.occurrences(text)
            assert all(s + len(automaton.contents[n]) > len(start) for s, n in rest)


def test_no_contents_and_no_candidates():
    assert ContentAutomaton([]).occurrences("anything <|im_end|>") == []
    assert ContentAutomaton(["<|im_end|>"]).occurrences("plain text, nothing to find " * 50) == []


def test_time_does_not_grow_with_the_number_of_contents():
    """6,000 contents starting with ``<`` against 6: a text with 1,000 ``<`` is scanned in about the same time
    (trying each content at each ``<`` would take ~1,000 times longer)."""
    text = "".join(f"<td>{i} < x<unused{i % 50}>" for i in range(500))
    few = ContentAutomaton(["<td>", "<unused1>", "<b>", "</td>", "<x", "<unused12>"])
    many = ContentAutomaton([f"<unused{i}>" for i in range(6000)] + ["<td>", "<b>", "</td>", "<x"])
    times: dict[str, list[float]] = {"few": [], "many": []}
    for _ in range(3):
        for name, automaton in (("few", few), ("many", many)):
            start = time.perf_counter()
            automaton.occurrences(text)
            times[name].append(time.perf_counter() - start)
    assert min(times["many"]) < 5 * min(times["few"]), times
    assert len(many.occurrences(text)) == 1000  # each <td> and each <unusedN>
