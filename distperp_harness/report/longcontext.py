"""Documents of the long-context tasks, built from local texts (pure Python, deterministic).

Used by ``distperp_longdocs`` and ``distperp_needle`` / ``distperp_needle_gen`` (``tasks/distperp/utils.py``):

- :func:`join_to_length`: consecutive texts joined into documents of at least ``min_chars`` characters;
- :func:`needle_docs`: a "needle" sentence (``The secret number of <name> is <digits>.``) placed at chosen depths of
  a long filler text, followed by a question, with the right number among seeded distractors.

Everything here depends only on its arguments (no clock, no global random state), so every rank of a launch and
every run builds the same documents from the same files and seed. Invalid settings raise
:class:`~distperp_harness.errors.InputError` naming the ``--metadata`` key, what was given and what is allowed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from distperp_harness.errors import InputError

DEFAULT_MIN_CHARS = 131_072
"""``distperp_longdocs``: WikiText articles are joined into documents of at least 128 Ki characters (about 32k
tokens of a typical English BPE tokenizer)."""

DEFAULT_CONTEXT_CHARS = 100_000
"""``distperp_needle``: characters of filler around the needle (about 25k tokens; fits ``max_length=32768``)."""

DEFAULT_DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)
"""``distperp_needle``: where the needle goes, in percent of the filler (0: first sentence, 100: last)."""

DEFAULT_DOCS_PER_DEPTH = 4
DEFAULT_SEED = 1234
DEFAULT_CHOICES = 4
DEFAULT_DIGITS = 7

NAMES = (
    "Ada Wrenfield", "Bastian Moll", "Corin Ashdown", "Delphine Oakes", "Emrys Talbot", "Fenna Rooke",
    "Gideon Marsh", "Hester Vail", "Ivo Brennan", "Juno Hartwell", "Kasimir Dale", "Liesel Crane",
    "Mattias Ferro", "Nerys Holt", "Osric Lowell", "Petra Quill", "Quentin Roe", "Rosalind Pike",
    "Soren Ashby", "Tamsin Greaves", "Ulric Penhale", "Verity Lake", "Wilhelm Stroud", "Yara Kestrel",
)  # fmt: skip
"""Invented names for the needles (one per document, drawn with the seed)."""

QUESTION = "\n\nQuestion: What is the secret number of {name}?\nAnswer:"
NEEDLE = "The secret number of {name} is {number}."


# ---------------------------------------------------------------------------------------------------------------
# Settings from --metadata
# ---------------------------------------------------------------------------------------------------------------


def positive_int(key: str, value: Any, *, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``; otherwise an :class:`InputError` naming ``--metadata key``.

    Accepts ints and strings of digits (``--model_args``-style values); refuses bools, floats and the rest.
    """
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value):
        number = int(value)
    allowed = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    if number is None or number < minimum or (maximum is not None and number > maximum):
        raise InputError(
            f"--metadata {key}={value!r} is not {allowed}. Fix: e.g. --metadata '{{\"{key}\": {minimum}}}'",
            same_on_every_rank=True,
        )
    return number


def depths_percent(value: Any) -> tuple[float, ...]:
    """The needle depths, percents in ``[0, 100]``: a list of numbers, or one number. Kept in the given order;
    duplicates are refused (they would score the same documents twice)."""
    given = [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    fix = "Fix: e.g. --metadata '{\"depths\": [0, 25, 50, 75, 100]}' (percent of the filler text)"
    if not isinstance(given, (list, tuple)) or not given:
        raise InputError(
            f"--metadata depths={value!r} is not a non-empty list of percents. {fix}", same_on_every_rank=True
        )
    out: list[float] = []
    for depth in given:
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 100:
            raise InputError(
                f"--metadata depths={value!r} holds {depth!r}; each depth is a number from 0 to 100 (percent). {fix}",
                same_on_every_rank=True,
            )
        if float(depth) in out:
            raise InputError(f"--metadata depths={value!r} names {depth!r} twice. {fix}", same_on_every_rank=True)
        out.append(float(depth))
    return tuple(out)


def depth_label(depth: float) -> str:
    """``25.0`` -> ``"25"``, ``12.5`` -> ``"12.5"``: the suffix of the per-depth metrics (``acc_depth_25``)."""
    return f"{depth:g}"


# ---------------------------------------------------------------------------------------------------------------
# Long documents
# ---------------------------------------------------------------------------------------------------------------


def join_to_length(texts: Sequence[str], min_chars: int, separator: str = "\n") -> list[str]:
    """Consecutive ``texts`` joined with ``separator`` into documents of at least ``min_chars`` characters each.

    Texts are taken in order and never split. A document closes as soon as it reaches ``min_chars``; a remainder
    shorter than ``min_chars`` joins the last document, so every document reaches ``min_chars`` unless all the
    texts together are shorter (then there is one document, all of them). Blank texts are dropped. With WikiText
    articles and ``separator="\\n"`` each document is exactly the file's text from its first article to its last.
    """
    kept = [t for t in texts if t.strip()]
    docs: list[list[str]] = []
    current: list[str] = []
    length = 0
    for text in kept:
        length += len(text) + (len(separator) if current else 0)
        current.append(text)
        if length >= min_chars:
            docs.append(current)
            current, length = [], 0
    if current:
        if docs:
            docs[-1].extend(current)
        else:
            docs.append(current)
    return [separator.join(d) for d in docs]


# ---------------------------------------------------------------------------------------------------------------
# Needles
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NeedleDoc:
    """One needle document: ``prompt`` (filler with the needle, then the question), and the answer among
    ``choices`` (strings of digits, ``choices[label] == answer``).

    ``needle_start``: the needle's character offset in ``prompt``; ``depth``: the requested depth in percent;
    ``filler_chars``: characters of filler (without needle and question); ``index``: the document's number within
    its depth (documents of the same index share filler, name and number, so depths differ only by position).
    """

    prompt: str
    choices: list[str]
    label: int
    answer: str
    name: str
    needle: str
    needle_start: int
    depth: float
    filler_chars: int
    index: int


def filler_text(texts: Sequence[str], start: int, n_chars: int, separator: str = "\n\n") -> str:
    """At most ``n_chars`` characters of ``texts`` joined with ``separator``, from ``texts[start]`` on, cycling
    back to the first text when they run out. Cut after the last sentence end (``". "``, ``"? "``, ``"! "``, a
    newline) in its second half, else at the last whitespace (no word is split), then right-stripped. ``texts``
    must hold non-blank text."""
    if not any(t.strip() for t in texts):
        raise ValueError("filler_text needs at least one non-blank text")
    parts: list[str] = []
    length, i = 0, start
    while length < n_chars + 1:
        text = texts[i % len(texts)].strip()
        if text:
            parts.append(text)
            length += len(text) + len(separator)
        i += 1
    joined = separator.join(parts)[: n_chars + 1]
    sentence = sentence_start(joined, len(joined) - 1)
    if sentence > n_chars // 2:
        return joined[:sentence].rstrip()
    cut = max(joined.rfind(" "), joined.rfind("\n"))
    return joined[: cut if cut > 0 else n_chars].rstrip()


def sentence_start(text: str, position: int) -> int:
    """The start of the sentence that holds ``position``: the last offset at or before it that follows a sentence
    end (``". "``, ``"? "``, ``"! "``, a newline), 0 when none does, ``len(text)`` for a position at the end."""
    if position >= len(text):
        return len(text)
    best = 0
    for match in re.finditer(r"(?:[.!?] +|\n+)", text[:position]):
        best = match.end()
    return best


def insert_needle(filler: str, needle: str, depth: float) -> tuple[str, int]:
    """``filler`` with ``needle`` inserted at the start of the sentence at ``depth`` percent of it (0: before the
    first sentence, 100: after the last), separated by a space where it meets text. Returns the text and the
    needle's offset in it."""
    at = sentence_start(filler, round(len(filler) * depth / 100))
    before, after = filler[:at], filler[at:]
    if before and not before[-1].isspace():
        before += " "
    if after and not after[0].isspace():
        after = " " + after
    return before + needle + after, len(before)


def _numbers(rng: random.Random, digits: int, count: int, filler: str) -> list[str]:
    """``count`` distinct numbers of ``digits`` digits, none occurring in ``filler`` (the first is the answer)."""
    numbers: list[str] = []
    for _ in range(1000 * count):
        number = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if number not in numbers and number not in filler:
            numbers.append(number)
            if len(numbers) == count:
                return numbers
    raise InputError(
        f"--metadata digits={digits} leaves too few numbers that the filler text does not already hold for "
        f"{count} choices. Fix: more digits, e.g. --metadata '{{\"digits\": {DEFAULT_DIGITS}}}'",
        same_on_every_rank=True,
    )


def needle_docs(
    texts: Sequence[str],
    *,
    context_chars: int = DEFAULT_CONTEXT_CHARS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    docs_per_depth: int = DEFAULT_DOCS_PER_DEPTH,
    seed: int = DEFAULT_SEED,
    n_choices: int = DEFAULT_CHOICES,
    digits: int = DEFAULT_DIGITS,
) -> list[NeedleDoc]:
    """``docs_per_depth`` documents for each depth, depth-major (every document of ``depths[0]`` first).

    Document ``i`` of every depth shares its filler (``context_chars`` characters of ``texts`` from a start text
    drawn with the seed, see :func:`filler_text`), its name, its number and its choices; only the needle's place
    differs. The answer and the ``n_choices - 1`` distractors are distinct numbers of ``digits`` digits that occur
    nowhere in the filler; the choices are shuffled with the seed. Same arguments, same documents: each index
    draws from a ``random.Random`` seeded with ``(seed, i)`` alone.

    Raises:
        InputError: ``texts`` hold no non-blank text.
    """
    sources = [t for t in texts if t.strip()]
    if not sources:
        raise InputError("the needle filler has no text: every source document is blank", same_on_every_rank=True)
    shared = []
    for index in range(docs_per_depth):
        rng = random.Random(f"distperp_needle:{seed}:{index}")
        filler = filler_text(sources, rng.randrange(len(sources)), context_chars)
        name = NAMES[rng.randrange(len(NAMES))]
        choices = _numbers(rng, digits, n_choices, filler)
        answer = choices[0]
        rng.shuffle(choices)
        shared.append((index, filler, name, answer, choices))
    docs = []
    for depth in depths:
        for index, filler, name, answer, choices in shared:
            needle = NEEDLE.format(name=name, number=answer)
            context, start = insert_needle(filler, needle, depth)
            docs.append(
                NeedleDoc(
                    prompt=context + QUESTION.format(name=name),
                    choices=list(choices),
                    label=choices.index(answer),
                    answer=answer,
                    name=name,
                    needle=needle,
                    needle_start=start,
                    depth=depth,
                    filler_chars=len(filler),
                    index=index,
                )
            )
    return docs


def as_columns(docs: Sequence[NeedleDoc]) -> dict[str, list[Any]]:
    """``{field: [value per document]}`` (a ``datasets.Dataset.from_dict`` input)."""
    rows = [asdict(d) for d in docs]
    return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}


def first_number(text: str) -> str | None:
    """The first run of digits in a generated answer (``" 4817263."`` -> ``"4817263"``), ``None`` if none."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else None
