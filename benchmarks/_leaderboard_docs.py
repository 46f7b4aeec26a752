"""The synthetic documents of :mod:`benchmarks._leaderboard_data`, one builder per leaderboard family, each in its
family's exact schema (every field lm-eval's YAMLs and ``utils.py`` read), from WikiText text (:class:`Text`).
Deterministic in the caller's ``random.Random``."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

from benchmarks.common import WIKITEXT_TEST

# ------------------------------------------------------------------------------------------------- text source
_FILL = ["Harlow", "Kestrel", "Ambrose", "Thorne", "Velden", "Marlow", "Corrin", "Ashby", "Tamsin", "Orrell"]


class Text:
    """Detokenized WikiText words, sentence starts and article titles; passages are drawn with a caller's rng."""

    def __init__(self, path: Path | None = None):
        path = path or WIKITEXT_TEST
        if path.is_file():
            raw = path.read_text(encoding="utf-8")
        else:
            from distperp_harness.commands.tiny import sample_text

            raw = sample_text()
        self.titles = [t.replace(" @-@ ", "-") for t in re.findall(r"^ = ([^=]+?) = $", raw, re.M) if "<unk>" not in t]
        body = " ".join(ln.strip() for ln in raw.splitlines() if ln.strip() and not ln.strip().startswith("="))
        fill = iter(_FILL * (body.count("<unk>") // len(_FILL) + 1))  # WikiText's rare words, mostly names
        body = re.sub("<unk>", lambda m: next(fill), body)
        for a, b in (
            (" @-@ ", "-"),
            (" @,@ ", ","),
            (" @.@ ", "."),
            (" 's", "'s"),
            (" 't", "'t"),
            ("( ", "("),
            (" )", ")"),
            (' " ', ' "'),
        ):
            body = body.replace(a, b)
        body = re.sub(r" ([,.;:!?])", r"\1", body)
        self.words = body.split()
        self.starts = [
            i for i in range(1, len(self.words) - 1) if self.words[i - 1].endswith(".") and self.words[i][:1].isupper()
        ]

    def passage(self, rng: random.Random, n_words: int) -> str:
        """About ``n_words`` words from a sentence start, ending at a sentence end (at most 40 words later)."""
        i = rng.choice(self.starts)
        out = [self.words[(i + k) % len(self.words)] for k in range(n_words)]
        k = n_words
        while not out[-1].endswith(".") and k < n_words + 40:
            out.append(self.words[(i + k) % len(self.words)])
            k += 1
        return " ".join(out)

    def phrase(self, rng: random.Random, lo: int, hi: int) -> str:
        """``lo``..``hi`` words from a sentence start, trailing punctuation removed (an answer option)."""
        i, n = rng.choice(self.starts), rng.randint(lo, hi)
        return " ".join(self.words[(i + k) % len(self.words)] for k in range(n)).rstrip(",.;:")

    def distinct_phrases(self, rng: random.Random, count: int, lo: int, hi: int) -> list[str]:
        out: list[str] = []
        while len(out) < count:
            if (p := self.phrase(rng, lo, hi)) not in out:
                out.append(p)
        return out


# ---------------------------------------------------------------------------------------------- documents
CATEGORIES = [
    "biology",
    "business",
    "chemistry",
    "computer_science",
    "economics",
    "engineering",
    "health",
    "history",
    "law",
    "math",
    "other",
    "philosophy",
    "physics",
    "psychology",
]
_NAMES = [
    "Mackenzie",
    "Ana",
    "Winston",
    "Lena",
    "Tobias",
    "Priya",
    "Marcus",
    "Elena",
    "Rafael",
    "Greta",
    "Hugo",
    "Imani",
    "Soren",
    "Beatrix",
    "Callum",
    "Delia",
    "Ezra",
    "Farah",
    "Gideon",
    "Harriet",
]
_PLACES = [
    "the kitchen drawer",
    "the garden shed",
    "the hallway cupboard",
    "the desk in the study",
    "the attic trunk",
    "the bookshelf",
    "the car's glove box",
    "the laundry basket",
    "the cellar shelf",
]
_OBJECTS = ["keys", "notebook", "violin", "passport", "umbrella", "camera", "map", "wallet"]
_JOBS = [("cooking", "cleaning"), ("sailing", "navigation"), ("coding", "testing"), ("planting", "harvesting")]


def mmlu_pro(text: Text, rng: random.Random, i: int, category: str | None = None) -> dict:
    options = text.distinct_phrases(rng, 10, 3, 12)
    k = rng.randrange(10)
    title = rng.choice(text.titles)
    question = f"{text.passage(rng, rng.randint(30, 90))} Which of the following best describes {title}?"
    cot = f"A: Let's think step by step. {text.passage(rng, rng.randint(40, 80))} The answer is ({'ABCDEFGHIJ'[k]})."
    return {
        "question_id": i,
        "question": question,
        "options": options,
        "answer": "ABCDEFGHIJ"[k],
        "answer_index": k,
        "cot_content": cot,
        "category": category or rng.choice(CATEGORIES),
        "src": "wikitext-synthetic",
    }


def bbh(text: Text, rng: random.Random, cfg: dict) -> dict:
    """A BBH document shaped like one of the subtask's 3 exemplars: its context is replaced by WikiText of the same
    length, its final sentence (the question) and its options block are kept; the target is a random listed option.
    Exemplars without a context (a single sentence, e.g. boolean expressions) are reused as they are."""
    ex = rng.choice(cfg["fewshot_config"]["samples"])["input"]
    stem, sep, opts = ex.partition("Options:")
    sentences = re.split(r"(?<=[.?!:])\s+", stem.strip())
    context_words = sum(len(s.split()) for s in sentences[:-1])
    new_stem = f"{text.passage(rng, context_words)} {sentences[-1]}" if context_words else stem.strip()
    listed = [c for c in cfg["doc_to_choice"] if c in opts] or cfg["doc_to_choice"]  # the exemplar's own options
    return {"input": new_stem + ("\n" + sep + opts if sep else ""), "target": rng.choice(listed)}


def gpqa(text: Text, rng: random.Random, i: int) -> dict:
    right, *wrong = text.distinct_phrases(rng, 4, 2, 12)
    return {
        "Question": f"{text.passage(rng, rng.randint(60, 160))} What follows from the passage above?",
        "Correct Answer": right,
        "Incorrect Answer 1": wrong[0],
        "Incorrect Answer 2": wrong[1],
        "Incorrect Answer 3": wrong[2],
        "Explanation": text.passage(rng, 60),
        "Record ID": f"rec{i:05d}",
        "High-level domain": rng.choice(["Physics", "Chemistry", "Biology"]),
        "Subdomain": "synthetic",
    }


def math_problem(rng: random.Random, kind: str) -> tuple[str, str]:
    """(problem, solution) of MATH's kind ``kind``, with a correct ``\\boxed{}`` answer."""
    a, b, c = rng.randint(2, 9), rng.randint(1, 30), rng.randint(2, 12)
    if kind == "algebra":
        return (
            f"If ${a}x + {b} = {a * c + b}$, what is the value of $x^2 - 2x$?",
            f"Subtracting {b} from both sides gives ${a}x = {a * c}$, so $x = {c}$. "
            f"Therefore $x^2 - 2x = {c * c} - {2 * c} = \\boxed{{{c * c - 2 * c}}}$.",
        )
    if kind == "counting_and_prob":
        n, k = c + 4, min(a, c + 2)
        return (
            f"In how many ways can a committee of {k} be chosen from a club of {n} members?",
            f"The order does not matter, so the answer is $\\binom{{{n}}}{{{k}}} = \\boxed{{{math.comb(n, k)}}}$.",
        )
    if kind == "geometry":
        return (
            f"A right triangle has legs of length ${3 * c}$ and ${4 * c}$. What is the length of its hypotenuse?",
            f"By the Pythagorean theorem the hypotenuse is $\\sqrt{{{9 * c * c} + {16 * c * c}}} = "
            f"\\boxed{{{5 * c}}}$.",
        )
    if kind == "intermediate_algebra":
        s, p = a + c, a * c
        return (
            f"Let $r$ and $s$ be the roots of $x^2 - {s}x + {p} = 0$. Compute $r^2 + s^2$.",
            f"By Vieta's formulas $r + s = {s}$ and $rs = {p}$, so $r^2 + s^2 = {s}^2 - 2\\cdot {p} = "
            f"\\boxed{{{s * s - 2 * p}}}$.",
        )
    if kind == "num_theory":
        m, n = a * c, a * (c + 1)
        return (
            f"What is the greatest common divisor of ${m}$ and ${n}$?",
            f"Since ${m} = {a}\\cdot {c}$ and ${n} = {a}\\cdot {c + 1}$ with $\\gcd({c}, {c + 1}) = 1$, "
            "the answer is "
            f"$\\boxed{{{math.gcd(m, n)}}}$.",
        )
    if kind == "prealgebra":
        return (
            f"What is ${5 * a}\\%$ of ${20 * c}$?",
            f"We have $\\frac{{{5 * a}}}{{100}}\\cdot {20 * c} = \\boxed{{{a * c}}}$.",
        )
    return (
        f"Compute $\\det \\begin{{pmatrix}} {a} & {b} \\\\ {c} & {a + 1} \\end{{pmatrix}}$.",
        f"The determinant is ${a}\\cdot {a + 1} - {b}\\cdot {c} = \\boxed{{{a * (a + 1) - b * c}}}$.",
    )


_IFEVAL_KWARGS = [
    "num_highlights",
    "relation",
    "num_words",
    "num_placeholders",
    "prompt_to_repeat",
    "num_paragraphs",
    "postscript_marker",
    "forbidden_words",
    "keywords",
    "num_bullets",
    "end_phrase",
    "language",
    "let_frequency",
    "letter",
    "num_sections",
    "section_spliter",
    "first_word",
    "capital_relation",
    "capital_frequency",
    "frequency",
    "keyword",
    "nth_paragraph",
    "num_sentences",
]
IFEVAL = [  # (instruction id, kwargs or a function of (rng, text) giving them, the sentence the prompt carries)
    ("punctuation:no_comma", {}, "In your entire response, refrain from the use of any commas."),
    (
        "length_constraints:number_words",
        lambda r, t: {"relation": "at least", "num_words": r.choice([150, 300, 500])},
        "Answer with at least {num_words} words.",
    ),
    (
        "detectable_format:number_bullet_lists",
        lambda r, t: {"num_bullets": r.randint(2, 5)},
        "Your answer must contain exactly {num_bullets} bullet points. Use the markdown bullet points such as:\n"
        "* This is point 1.",
    ),
    ("change_case:english_lowercase", {}, "Your entire response should be in English, and in all lowercase letters."),
    (
        "keywords:existence",
        lambda r, t: {
            "keywords": r.sample(
                [w for w in t.passage(r, 30).lower().split() if w.isalpha() and len(w) > 4] or ["river"], 1
            )
        },
        "Include keywords {keywords} in the response.",
    ),
    (
        "startend:end_checker",
        {"end_phrase": "Is there anything else I can help with?"},
        "Finish your response with this exact phrase {end_phrase}. No other words should follow this phrase.",
    ),
    (
        "detectable_content:postscript",
        {"postscript_marker": "P.S."},
        "At the end of your response, please explicitly add a postscript starting with {postscript_marker}",
    ),
    ("detectable_format:title", {}, "Your answer must contain a title, wrapped in double angular brackets."),
    (
        "length_constraints:number_paragraphs",
        lambda r, t: {"num_paragraphs": r.randint(2, 5)},
        "There should be {num_paragraphs} paragraphs. Paragraphs are separated with the markdown divider: ***",
    ),
]


def ifeval(text: Text, rng: random.Random, i: int) -> dict:
    chosen = rng.sample(IFEVAL, rng.randint(1, 3))
    ids, kwargs, asks = [], [], []
    for iid, kw, ask in chosen:
        kw = kw(rng, text) if callable(kw) else dict(kw)
        ids.append(iid)
        kwargs.append({k: kw.get(k) for k in _IFEVAL_KWARGS})
        asks.append(ask.format(**{k: ", ".join(v) if isinstance(v, list) else v for k, v in kw.items()}))
    prompt = (
        f"Write a short article about {rng.choice(text.titles)} for a local history magazine, based on this "
        f"summary: {text.passage(rng, rng.randint(20, 60))} {' '.join(asks)}"
    )
    return {"key": 1000 + i, "prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs}


def musr(text: Text, rng: random.Random, subset: str) -> dict:
    """A MuSR document: a ~750-word (~1,000-token) WikiText narrative, a question and 2 or 3 choices."""
    people = rng.sample(_NAMES, 3)
    if subset == "murder_mysteries":
        choices = people[:2]
        head = (
            f"In {rng.choice(text.titles)}, a death was reported; Detective {people[2]} must question {people[0]} "
            f"and {people[1]}."
        )
        question = "Who is the most likely murderer?"
    elif subset == "object_placements":
        choices, obj = rng.sample(_PLACES, 3), rng.choice(_OBJECTS)
        head = f"{people[0]}, {people[1]} and {people[2]} share a house; the {obj} is moved more than once."
        question = f"Which location is the most likely place {people[0]} would look to find the {obj} given the story?"
    else:
        (t1, t2), perms = rng.choice(_JOBS), [people, people[1:] + people[:1], people[2:] + people[:2]]
        choices = [f"{t1.capitalize()}: {p[0]}, {t2.capitalize()}: {p[1]} and {p[2]}" for p in perms]
        head = f"As the manager, I had to assign {', '.join(people)} to {t1} and {t2}."
        question = (
            "Given the story, how would you uniquely allocate each person to make sure both tasks are "
            "accomplished efficiently?"
        )
    k = rng.randrange(len(choices))
    narrative = f"{head}\n\n{text.passage(rng, rng.randint(680, 820))}"
    return {
        "narrative": narrative,
        "question": question,
        "choices": repr(choices),
        "answer_index": k,
        "answer_choice": choices[k],
    }
