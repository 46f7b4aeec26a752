"""Every occurrence of every added token's content in a text, found in one pass of an Aho-Corasick automaton.

``tokenizers`` matches added tokens with an Aho-Corasick automaton too (leftmost-longest); a cut proof
(:mod:`~distperp_harness.planning.tokenizer_cuts`) needs more than the matches it chooses: every occurrence of every
content, overlapping ones included, and which one extraction chooses where. One pass over the text reports them all
in time linear in the text plus the occurrences, whatever the number of contents (Gemma: 6,321 contents start with
``<``; trying each at every ``<`` took seconds on a 10k-character prefix).
"""

from __future__ import annotations

import re
from collections import deque
from typing import Iterable


class ContentAutomaton:
    """Aho-Corasick over a set of non-empty strings (an added vocabulary's contents).

    ``contents`` are numbered longest first (ties by text), so at one start position a lower number is a longer
    content. A node is a prefix of some content; its failure link is the node of its longest proper suffix that is
    also a node, and its output every content that ends there (itself if a content, then its failure link's)."""

    def __init__(self, contents: Iterable[str]) -> None:
        self.contents: tuple[str, ...] = tuple(sorted({c for c in contents if c}, key=lambda c: (-len(c), c)))
        goto: list[dict[str, int]] = [{}]
        own: list[list[int]] = [[]]
        for number, content in enumerate(self.contents):
            node = 0
            for ch in content:
                child = goto[node].get(ch)
                if child is None:
                    child = len(goto)
                    goto[node][ch] = child
                    goto.append({})
                    own.append([])
                node = child
            own[node].append(number)
        fail = [0] * len(goto)
        out: list[tuple[int, ...]] = [()] * len(goto)
        queue = deque(goto[0].values())
        for node in queue:
            out[node] = tuple(own[node])
        while queue:  # breadth first: a failure link is shallower, so its output is complete when read
            node = queue.popleft()
            for ch, child in goto[node].items():
                link = fail[node]
                while link and ch not in goto[link]:
                    link = fail[link]
                fail[child] = goto[link].get(ch, 0)
                out[child] = tuple(own[child]) + out[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._out = goto, fail, out
        self._lengths = tuple(map(len, self.contents))
        firsts = "".join(re.escape(ch) for ch in sorted(goto[0]))
        self._next_start = re.compile(f"[{firsts}]").search if firsts else None

    def occurrences(self, text: str) -> list[tuple[int, int]]:
        """``(start, number)`` of every occurrence of every content in ``text``, by start, longest first at one
        start."""
        return sorted(self.scan(text)[0])

    def scan(self, text: str, start: int = 0, state: int = 0) -> tuple[list[tuple[int, int]], int]:
        """Every occurrence ending after ``start`` in ``text`` read from ``start`` on, the automaton in ``state`` (the
        state :meth:`scan` of ``text[:start]`` ends in), unsorted, and the state at the end. Between occurrences the
        automaton sits at its root, where a compiled character class skips to the next character that starts any
        content."""
        search = self._next_start
        if search is None:
            return [], 0
        goto, fail, out, lengths = self._goto, self._fail, self._out, self._lengths
        found: list[tuple[int, int]] = []
        i, n = start, len(text)
        while i < n:
            if state == 0:
                hit = search(text, i)
                if hit is None:
                    break
                i = hit.start()
            ch = text[i]
            while True:
                child = goto[state].get(ch)
                if child is not None:
                    state = child
                    break
                if state == 0:
                    break
                state = fail[state]
            i += 1
            for number in out[state]:
                found.append((i - lengths[number], number))
        return found, state
