"""Offline data and task folder for lm-eval's Open LLM Leaderboard v2 group ``leaderboard``.

    from leaderboard_data import GROUP, build_leaderboard_include
    folder = build_leaderboard_include(Path(tmp), docs_per_subtask=2, seed=0)
    lm_eval.simple_evaluate(model=..., tasks=[GROUP], task_manager=TaskManager(include_path=str(folder)), ...)

What is written under ``root``:

* ``root/data/<family>/<task>.jsonl`` (+ ``.validation``/``.train`` files where a task reads those splits): synthetic
  documents in each family's exact schema (every field lm-eval's YAMLs and ``utils.py`` read), built from WikiText
  text (``../shared/data/wikitext-2/test.txt``, or the packaged sample when it is absent). Deterministic in ``seed``.
* ``root/tasks/`` (the folder returned, to pass as ``include_path``): one YAML per leaderboard task with the same
  ``task`` name, which ``include``s lm-eval's own task YAML (absolute path) and overrides only the data location:
  ``dataset_path: json``, ``dataset_name: null``, ``dataset_kwargs: {data_files: {split: file}, cache_dir: ...}``.
  lm-eval's ``TaskIndex.build`` indexes the built-in tasks first and ``include_path`` after them, and a later path
  overwrites a name (logging "overrides existing task"), so these definitions win; distperp's start-up hook puts its
  own folder between the two. The groups are not redefined: lm-eval's ``leaderboard`` and its subgroups (with their
  ``aggregate_metric_list``) name their members, and the names resolve to these tasks. :func:`verify_include` checks it.
* Exception: a family whose lm-eval ``utils.py`` cannot be imported here (MATH-hard needs ``math_verify``; IFEval
  needs ``langdetect``, ``immutabledict`` and nltk's ``punkt_tab``) cannot be ``include``d, since lm-eval resolves the
  included ``!function`` tags when it loads the task. Its YAML is then lm-eval's YAML read at build time (includes
  merged) with those functions pointed at a shim module in the same folder: prompt, documents and few-shot samples are
  lm-eval's own functions compiled from its source; ``process_results`` returns NaN for every metric (not computable,
  never faked). ``root/tasks/not_computable.json`` (:func:`not_computable`) maps such task names to the reason.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _wikitext import WIKITEXT_TEST

GROUP = "leaderboard"
"""The group to pass as ``tasks``: lm-eval's own name, whose member tasks the include folder overrides."""

LM_EVAL_LEADERBOARD = (
    Path(importlib.util.find_spec("lm_eval").submodule_search_locations[0]) / "tasks" / "leaderboard"
).resolve()

_BBH = dict.fromkeys(
    [
        "boolean_expressions",
        "causal_judgement",
        "date_understanding",
        "disambiguation_qa",
        "formal_fallacies",
        "geometric_shapes",
        "hyperbaton",
        "logical_deduction_five_objects",
        "logical_deduction_seven_objects",
        "logical_deduction_three_objects",
        "movie_recommendation",
        "navigate",
        "object_counting",
        "penguins_in_a_table",
        "reasoning_about_colored_objects",
        "ruin_names",
        "salient_translation_error_detection",
        "snarks",
        "sports_understanding",
        "temporal_sequences",
        "tracking_shuffled_objects_five_objects",
        "tracking_shuffled_objects_seven_objects",
        "tracking_shuffled_objects_three_objects",
        "web_of_lies",
    ],
    250,
) | {"causal_judgement": 187, "penguins_in_a_table": 146, "snarks": 178}
_MATH = {  # lm-eval task suffix: (MATH `type`, Level 5 test questions)
    "algebra": ("Algebra", 307),
    "counting_and_prob": ("Counting & Probability", 123),
    "geometry": ("Geometry", 132),
    "intermediate_algebra": ("Intermediate Algebra", 280),
    "num_theory": ("Number Theory", 154),
    "prealgebra": ("Prealgebra", 193),
    "precalculus": ("Precalculus", 135),
}
REAL_COUNTS: dict[str, dict[str, int]] = {
    "mmlu_pro": {"leaderboard_mmlu_pro": 12032},
    "bbh": {f"leaderboard_bbh_{k}": v for k, v in _BBH.items()},
    "gpqa": {"leaderboard_gpqa_diamond": 198, "leaderboard_gpqa_extended": 546, "leaderboard_gpqa_main": 448},
    "math_hard": {f"leaderboard_math_{k}_hard": v[1] for k, v in _MATH.items()},
    "ifeval": {"leaderboard_ifeval": 541},
    "musr": {
        "leaderboard_musr_murder_mysteries": 250,
        "leaderboard_musr_object_placements": 256,
        "leaderboard_musr_team_allocation": 250,
    },
}
"""Documents per task of the real suite, by family (BBH 5,761, GPQA 1,192, MATH level 5 1,324, MuSR 756: the sizes of
the Hugging Face datasets lm-eval's YAMLs name, after MATH's Level 5 filter). Requests per document are not here:
multiple choice makes one request per choice (MMLU-Pro up to 10; a few real questions have fewer options)."""
FAMILY_OF = {task: fam for fam, tasks in REAL_COUNTS.items() for task in tasks}
_SHIM_NEEDS = {"math_hard": ("math_verify", "sympy"), "ifeval": ("langdetect", "immutabledict", "nltk")}


def count_real_suite() -> dict[str, int]:
    """Documents per family of the real suite: {family: count}; the sum is 21,606."""
    return {fam: sum(tasks.values()) for fam, tasks in REAL_COUNTS.items()}


# ------------------------------------------------------------------------------------------------- text source
_FILL = ["Harlow", "Kestrel", "Ambrose", "Thorne", "Velden", "Marlow", "Corrin", "Ashby", "Tamsin", "Orrell"]


class _Text:
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
_CATEGORIES = [
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


def _mmlu_pro(text: _Text, rng: random.Random, i: int, category: str | None = None) -> dict:
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
        "category": category or rng.choice(_CATEGORIES),
        "src": "wikitext-synthetic",
    }


def _bbh(text: _Text, rng: random.Random, cfg: dict) -> dict:
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


def _gpqa(text: _Text, rng: random.Random, i: int) -> dict:
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


def _math(rng: random.Random, kind: str) -> tuple[str, str]:
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
_IFEVAL = [  # (instruction id, kwargs or a function of (rng, text) giving them, the sentence the prompt carries)
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


def _ifeval(text: _Text, rng: random.Random, i: int) -> dict:
    chosen = rng.sample(_IFEVAL, rng.randint(1, 3))
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


def _musr(text: _Text, rng: random.Random, subset: str) -> dict:
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


# ----------------------------------------------------------------------------------------- lm-eval's task files
def _lm_eval_tasks() -> dict[str, tuple[Path, dict]]:
    """{task name: (lm-eval's YAML, its config with includes merged and ``!function`` tags left as path strings)}."""
    from lm_eval.tasks._yaml_loader import load_yaml

    out = {}
    for path in sorted(LM_EVAL_LEADERBOARD.glob("*/*.yaml")):
        cfg = load_yaml(path, resolve_func=False)
        if "task" in cfg and "group" not in cfg:
            out[cfg["task"]] = (path, cfg)
    return out


def _missing(family: str) -> str | None:
    """Why lm-eval's ``utils.py`` of ``family`` cannot be imported without side effects here, or None."""
    absent = [m for m in _SHIM_NEEDS.get(family, ()) if importlib.util.find_spec(m) is None]
    if family == "ifeval" and "nltk" not in absent:
        import nltk

        try:
            nltk.data.find("tokenizers/punkt_tab")
        except LookupError:  # lm-eval would try to download it at import time
            absent.append("nltk data punkt_tab")
    if family == "math_hard" and importlib.util.find_spec("antlr4") is None:  # sympy's parse_latex needs it: with
        absent += ["antlr4 (exact_match_original)"] if absent else []  # math_verify alone, lm-eval scores it 0
    return f"not installed here: {', '.join(absent)}" if absent else None


_SHIM = '''"""Written by benchmarks/leaderboard_data.py: lm-eval's {family} functions compiled from
{src}
(which cannot be imported here: {reason}); process_results returns NaN: the metrics are not computable here."""
import ast, datasets, logging, math, pathlib, re  # noqa: F401 - names lm-eval's functions use
from typing import Dict, List  # noqa: F401 - names lm-eval's functions use

_SRC = pathlib.Path({src!r})
_tree = ast.parse(_SRC.read_text(encoding="utf-8"))
_tree.body = [n for n in _tree.body if getattr(n, "name", None) in {keep!r}
              or isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) in {keep!r}]
exec(compile(_tree, str(_SRC), "exec"), globals())
NOT_COMPUTABLE = {reason!r}


def process_results(doc, results):
    return {results}
'''
_SHIM_PARTS = {
    "math_hard": (
        {
            "doc_to_text",
            "process_docs",
            "list_fewshot_samples",
            "last_boxed_only_string",
            "remove_boxed",
            "INVALID_ANSWER",
        },
        '{"exact_match": math.nan, "exact_match_original": math.nan}',
    ),
    "ifeval": (
        {"agg_inst_level_acc"},
        "{m: math.nan if m.startswith('prompt') else [math.nan] * len("
        "doc['instruction_id_list']) for m in ('prompt_level_strict_acc', 'inst_level_strict_acc', "
        "'prompt_level_loose_acc', 'inst_level_loose_acc')}",
    ),
}


class _Fn(str):
    """A ``!function`` reference when dumped to YAML."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Fn, lambda d, v: d.represent_scalar("!function", str(v)))


def _retarget(value, src_prefix: str, shim: str):
    """``value`` with lm-eval's function references (``<family dir>/utils.NAME`` strings) pointed at ``shim.NAME``."""
    if isinstance(value, dict):
        return {k: _retarget(v, src_prefix, shim) for k, v in value.items()}
    if isinstance(value, list):
        return [_retarget(v, src_prefix, shim) for v in value]
    if isinstance(value, str) and value.startswith(src_prefix):
        return _Fn(f"{shim}.{value[len(src_prefix) :]}")
    return value


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _documents(task: str, cfg: dict, text: _Text, n: int, seed: int, data: Path) -> dict[str, str]:
    """Write ``task``'s documents; returns {split name lm-eval reads: jsonl path}."""
    rng, fam = random.Random(f"{seed}:{task}"), FAMILY_OF[task]
    base = data / fam / task
    if fam == "mmlu_pro":
        return {
            "test": _write_jsonl(base.with_suffix(".jsonl"), [_mmlu_pro(text, rng, i) for i in range(n)]),
            "validation": _write_jsonl(
                base.with_suffix(".validation.jsonl"),
                [_mmlu_pro(text, rng, 70000 + j, c) for j, c in enumerate(_CATEGORIES)],
            ),
        }
    if fam == "bbh":
        return {"test": _write_jsonl(base.with_suffix(".jsonl"), [_bbh(text, rng, cfg) for _ in range(n)])}
    if fam == "gpqa":
        return {"train": _write_jsonl(base.with_suffix(".jsonl"), [_gpqa(text, rng, i) for i in range(n)])}
    if fam == "ifeval":
        return {"train": _write_jsonl(base.with_suffix(".jsonl"), [_ifeval(text, rng, i) for i in range(n)])}
    if fam == "musr":
        subset = cfg["test_split"]
        return {subset: _write_jsonl(base.with_suffix(".jsonl"), [_musr(text, rng, subset) for _ in range(n)])}
    kind = task.removeprefix("leaderboard_math_").removesuffix("_hard")
    rows = [
        {"problem": p, "solution": s, "level": "Level 5", "type": _MATH[kind][0]}
        for p, s in (_math(rng, kind) for _ in range(n + 4))
    ]
    rows.insert(n // 2, {**rows[0], "level": "Level 3"})  # exercises process_docs' Level 5 filter
    return {
        "test": _write_jsonl(base.with_suffix(".jsonl"), rows[: n + 1]),
        "train": _write_jsonl(base.with_suffix(".train.jsonl"), rows[n + 1 :]),
    }


def build_leaderboard_include(
    root: Path, docs_per_subtask: int, seed: int = 0, text_path: Path | None = None, min_family_docs: int = 0
) -> Path:
    """Write data under ``root/data`` and the include folder ``root/tasks``; return the include folder.

    Pass it as ``TaskManager(include_path=str(folder))`` (or ``--include_path``) with ``tasks=[GROUP]``: every one of
    the group's 39 tasks then reads ``docs_per_subtask`` local documents (MMLU-Pro is one task), or more where
    ``min_family_docs`` asks each family for at least that many (spread evenly over its subtasks). Deterministic in
    ``seed`` (and the WikiText file: ``text_path``, default ``../shared/data/wikitext-2/test.txt``, else the packaged
    sample). Rewrites the files of an existing ``root``. Raises KeyError if lm-eval's leaderboard tasks changed names.
    """
    root, text = Path(root).resolve(), _Text(text_path)
    tasks_dir, data = root / "tasks", root / "data"
    tasks_dir.mkdir(parents=True, exist_ok=True)
    lm_tasks, not_comp = _lm_eval_tasks(), {}
    ids = set(
        re.findall(
            r'^\s*(_[A-Z_]+) \+ "(\w+)"',
            (LM_EVAL_LEADERBOARD / "ifeval" / "instructions_registry.py").read_text(encoding="utf-8"),
            re.M,
        )
    )
    prefixes = dict(
        re.findall(
            r'^(_[A-Z_]+) = "([\w-]+:)"',
            (LM_EVAL_LEADERBOARD / "ifeval" / "instructions_registry.py").read_text(),
            re.M,
        )
    )
    registry = {prefixes[p] + name for p, name in ids}
    assert all(iid in registry for iid, _, _ in _IFEVAL), "an IFEval instruction id is not in lm-eval's registry"
    for task, fam in FAMILY_OF.items():
        yaml_path, cfg = lm_tasks[task]
        n = max(docs_per_subtask, math.ceil(min_family_docs / len(REAL_COUNTS[fam])))
        files = _documents(task, cfg, text, n, seed, data)
        override = {
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": files, "cache_dir": str(root / "hf_datasets_cache")},
        }
        reason = _missing(fam)
        if reason is None:
            body = {"include": str(yaml_path), "task": task, **override}
        else:
            shim = f"lb_{fam}_shim"
            keep, results = _SHIM_PARTS[fam]
            src = yaml_path.parent / "utils.py"
            shim_text = _SHIM.format(family=fam, src=str(src), reason=reason, keep=tuple(sorted(keep)), results=results)
            (tasks_dir / f"{shim}.py").write_text(shim_text, encoding="utf-8")
            body = {**_retarget(cfg, str(yaml_path.parent / "utils") + ".", shim), **override}
            not_comp[task] = f"{reason} (lm-eval's {fam} metrics: NaN)"
        (tasks_dir / f"{task}.yaml").write_text(yaml.dump(body, Dumper=_Dumper, sort_keys=False), encoding="utf-8")
    (tasks_dir / "not_computable.json").write_text(json.dumps(not_comp, indent=1) + "\n", encoding="utf-8")
    return tasks_dir


def not_computable(folder: Path) -> dict[str, str]:
    """{task name: why its metrics are NaN} for the include folder ``folder`` (empty when everything is computable)."""
    return json.loads((Path(folder) / "not_computable.json").read_text(encoding="utf-8"))


def verify_include(folder: Path) -> None:
    """Raise AssertionError unless ``TaskManager(include_path=folder)`` resolves every leaderboard task to ``folder``
    and the group ``leaderboard`` (with its subgroups) to lm-eval's YAMLs. Indexes all of lm-eval's tasks (seconds)."""
    from lm_eval.tasks import TaskManager

    index, folder = TaskManager(include_path=str(folder)).task_index, Path(folder).resolve()
    wrong = [t for t in FAMILY_OF if index[t].yaml_path is None or folder not in Path(index[t].yaml_path).parents]
    assert not wrong, f"not overridden by {folder}: {wrong}"
    assert GROUP in index and Path(index[GROUP].yaml_path).resolve().parent == LM_EVAL_LEADERBOARD, index.get(GROUP)
