"""Reasoning models: the answer after the thinking trace, and when a stop string may end a row.

``think_end_token`` is a string (``"</think>"``) or a token id. Pure functions (the last two take the tokenizer to
decode), so a decode loop of any shape (``model.generate`` batches of :mod:`.batchgen`, or the per-row scheduler of
:mod:`.scheduler`) calls them the same way:

* :func:`answer_of` ``(text, think_end, until)`` is the scored answer: the text after the *last* occurrence of
  ``think_end`` (left-stripped), then cut at the first stop string: exactly lm-eval's
  ``postprocess_generated_text`` for a string. For a token id, decode :func:`tokens_after_think` first and pass
  ``think_end=None`` (lm-eval ``hf``'s rule, which also left-strips).
* :func:`stop_allowed` ``(text_so_far, think_end)``: may a stop string end this row now? Only once the trace is
  finished, i.e. ``think_end`` occurs in the generated text (always, when ``think_end`` is None). A stop string
  inside an unfinished trace does not end the row: a deliberate difference from lm-eval ``hf``, whose stopping
  criteria stop there (and then score an empty or truncated answer). A row without ``think_end`` still ends at
  EOS or ``max_gen_toks``; its answer is then the text cut at its first stop string, as if it had stopped there.
* :func:`stop_hit` ``(text_so_far, think_end, until)``: a stop string occurs in the answer part (after the last
  ``think_end``), and :func:`stop_allowed`. This is the per-row stop test.
"""

from __future__ import annotations

from typing import Any, Sequence


def answer_of(text: str, think_end: str | None, until: Sequence[str] | str | None) -> str:
    """The answer lm-eval scores: after the last ``think_end`` (left-stripped), cut at the first stop string."""
    if think_end:
        text = text.split(think_end)[-1].lstrip()
    stops = [until] if isinstance(until, str) else list(until or [])
    for stop in stops:
        if stop:  # '' is no stop (lm-eval's rule for an empty EOS string)
            text = text.split(stop)[0]
    return text


def tokens_after_think(tokens: Sequence[int], think_end_id: int) -> list[int]:
    """The tokens after the last ``think_end_id`` (all of them when it does not occur)."""
    tokens = list(tokens)
    last = max((i for i, t in enumerate(tokens) if t == think_end_id), default=-1)
    return tokens[last + 1 :]


def stop_allowed(text_so_far: str, think_end: str | None) -> bool:
    """May a stop string end the row (module doc)?"""
    return not think_end or think_end in text_so_far


def stop_hit(text_so_far: str, think_end: str | None, until: Sequence[str]) -> bool:
    """Has the row reached a stop string in its answer part (module doc)?"""
    if not stop_allowed(text_so_far, think_end):
        return False
    answer = text_so_far.split(think_end)[-1] if think_end else text_so_far
    return any(stop and stop in answer for stop in until)


def answer(tokenizer: Any, tokens: Sequence[int], think_end: str | int | None, until: Sequence[str]) -> str:
    """The answer lm-eval scores from a row's new tokens: decoded, after the thinking trace (lm-eval ``hf``'s rule
    for a token id or a string ``think_end``), cut at the first stop string."""
    if isinstance(think_end, int):
        return answer_of(
            tokenizer.decode(tokens_after_think(tokens, think_end), skip_special_tokens=True).lstrip(), None, until
        )
    return answer_of(tokenizer.decode(list(tokens), skip_special_tokens=True), think_end, until)


def stop_in_answer(tokenizer: Any, think_end: str | int, until: Sequence[str], tokens: list[int]) -> bool:
    """A stop string occurs after the finished thinking trace (called only once a stop string was seen)."""
    if isinstance(think_end, int):
        return think_end in tokens and stop_hit(
            tokenizer.decode(tokens_after_think(tokens, think_end), skip_special_tokens=True), None, until
        )
    return stop_hit(tokenizer.decode(tokens, skip_special_tokens=True), think_end, until)
