"""Offline data and task folder for lm-eval's Open LLM Leaderboard v2 group ``leaderboard``.

    from benchmarks._leaderboard_data import GROUP, build_leaderboard_include
    folder = build_leaderboard_include(Path(tmp), docs_per_subtask=2, seed=0)
    lm_eval.simple_evaluate(model=..., tasks=[GROUP], task_manager=TaskManager(include_path=str(folder)), ...)

What is written under ``root``:

* ``root/data/<family>/<task>.jsonl`` (+ ``.validation``/``.train`` files where a task reads those splits): synthetic
  documents in each family's exact schema (every field lm-eval's YAMLs and ``utils.py`` read), built from WikiText
  text (``../shared/data/wikitext-2/test.txt``, or the packaged sample when it is absent) by
  :mod:`benchmarks._leaderboard_docs`. Deterministic in ``seed``.
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
from pathlib import Path

import yaml

from benchmarks._leaderboard_docs import CATEGORIES, IFEVAL, Text, bbh, gpqa, ifeval, math_problem, mmlu_pro, musr

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


_SHIM = '''"""Written by benchmarks/_leaderboard_data.py: lm-eval's {family} functions compiled from
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


def _documents(task: str, cfg: dict, text: Text, n: int, seed: int, data: Path) -> dict[str, str]:
    """Write ``task``'s documents; returns {split name lm-eval reads: jsonl path}."""
    rng, fam = random.Random(f"{seed}:{task}"), FAMILY_OF[task]
    base = data / fam / task
    if fam == "mmlu_pro":
        return {
            "test": _write_jsonl(base.with_suffix(".jsonl"), [mmlu_pro(text, rng, i) for i in range(n)]),
            "validation": _write_jsonl(
                base.with_suffix(".validation.jsonl"),
                [mmlu_pro(text, rng, 70000 + j, c) for j, c in enumerate(CATEGORIES)],
            ),
        }
    if fam == "bbh":
        return {"test": _write_jsonl(base.with_suffix(".jsonl"), [bbh(text, rng, cfg) for _ in range(n)])}
    if fam == "gpqa":
        return {"train": _write_jsonl(base.with_suffix(".jsonl"), [gpqa(text, rng, i) for i in range(n)])}
    if fam == "ifeval":
        return {"train": _write_jsonl(base.with_suffix(".jsonl"), [ifeval(text, rng, i) for i in range(n)])}
    if fam == "musr":
        subset = cfg["test_split"]
        return {subset: _write_jsonl(base.with_suffix(".jsonl"), [musr(text, rng, subset) for _ in range(n)])}
    kind = task.removeprefix("leaderboard_math_").removesuffix("_hard")
    rows = [
        {"problem": p, "solution": s, "level": "Level 5", "type": _MATH[kind][0]}
        for p, s in (math_problem(rng, kind) for _ in range(n + 4))
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
    root, text = Path(root).resolve(), Text(text_path)
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
    assert all(iid in registry for iid, _, _ in IFEVAL), "an IFEval instruction id is not in lm-eval's registry"
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
