"""The long-context tasks ``distperp_longdocs``, ``distperp_needle`` and ``distperp_needle_gen``: their loaders
(local files only, one-line errors), results per document, and one end-to-end run of each with the tiny model; and
lm-eval's own RULER ``niah_single_1`` offline at 4,096 tokens."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest

from distperp_harness.errors import InputError, MissingInput
from distperp_harness.report.wikitext import split_wikitext_articles

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"

_spec = importlib.util.spec_from_file_location(
    "distperp_long_task_utils_under_test", TASKS_DIR / "distperp" / "utils.py"
)
utils = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(utils)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(utils.WIKITEXT_PATH_ENV, raising=False)
    monkeypatch.delenv(utils.DOCS_PATH_ENV, raising=False)


def test_longdocs_join_the_wikitext_sample(sample_text_path):
    rows = utils.load_longdocs(wikitext_path="sample", min_chars=4000, pretrained="x", version=1.0)["test"]
    articles = [a for a in split_wikitext_articles(sample_text_path.read_text(encoding="utf-8")) if a.strip()]
    assert len(rows) > 1 and all(len(p) >= 4000 for p in rows["page"])
    assert "\n".join(rows["page"]) == "\n".join(articles)
    assert rows["source"][0] == f"{sample_text_path} articles 1-2 of 9" and rows["source"][-1].endswith("-9 of 9")
    assert utils.longdoc_text(rows[0]) == utils.wikitext_detokenizer(rows[0])
    # the default (128 Ki characters) is more than the sample: one document, and a warning
    assert len(utils.load_longdocs(wikitext_path="sample")["test"]) == 1


def test_longdocs_score_your_documents_as_written(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("first  long\r\ndocument", encoding="utf-8")
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    monkeypatch.setenv(utils.DOCS_PATH_ENV, str(tmp_path))
    rows = utils.load_longdocs(min_chars=10)["test"]
    assert list(rows["text"]) == ["first  long\r\ndocument", "second"]
    assert utils.longdoc_text(rows[0]) == "first  long\r\ndocument"


@pytest.mark.parametrize("loader", ["load_longdocs", "load_needle"])
def test_sources_and_their_errors_are_one_line(loader, tmp_path, monkeypatch):
    load = getattr(utils, loader)
    with pytest.raises(InputError) as info:
        load(pretrained="x")
    message = str(info.value)
    assert "needs local text" in message and '"wikitext_path"' in message and '"docs_path"' in message
    assert "\n" not in message and info.value.same_on_every_rank
    with pytest.raises(InputError, match="gives both docs_path="):
        load(docs_path="a", wikitext_path="b")
    with pytest.raises(MissingInput, match=rf"{tmp_path / 'none'} \(from --metadata wikitext_path\) does not exist"):
        load(wikitext_path=str(tmp_path / "none"))
    with pytest.raises(InputError, match=rf"{tmp_path} \(from --metadata wikitext_path\) holds no WikiText test file"):
        load(wikitext_path=str(tmp_path))
    with pytest.raises(InputError, match="--metadata key 'wikitext_pth' is not one this task reads"):
        load(wikitext_pth="sample")
    monkeypatch.setenv(utils.WIKITEXT_PATH_ENV, "sample")
    assert len(load(min_chars=3000) if loader == "load_longdocs" else load(context_chars=500, docs_per_depth=1))
    monkeypatch.setenv(utils.DOCS_PATH_ENV, str(tmp_path))
    with pytest.raises(InputError, match="both \\$DISTPERP_DOCS_PATH and \\$DISTPERP_WIKITEXT_PATH are set"):
        load()


def test_the_other_tasks_keys_are_not_misspellings():
    """One --metadata serves every task of a run: distperp_longdocs ignores the needle's keys, and the reverse."""
    assert utils.load_longdocs(wikitext_path="sample", min_chars=3000, context_chars=500, docs_per_depth=1)
    assert utils.load_needle(wikitext_path="sample", context_chars=500, docs_per_depth=1, min_chars=3000)


def test_needle_rows_and_results(sample_text_path):
    metadata = {"wikitext_path": "sample", "context_chars": 2000, "depths": [0, 50, 100], "docs_per_depth": 2}
    rows = utils.load_needle(**metadata, seed=3, n_choices=3, digits=5, pretrained="x")["test"]
    assert len(rows) == 6 and list(rows["depth"]) == [0.0, 0.0, 50.0, 50.0, 100.0, 100.0]
    doc = rows[2]
    assert utils.needle_prompt(doc) == doc["prompt"] and utils.needle_choices(doc)[doc["label"]] == doc["answer"]
    assert "= " in doc["prompt"] and " @-@ " not in doc["prompt"]  # WikiText filler, detokenized
    assert list(utils.load_needle(**metadata, seed=3, n_choices=3, digits=5)["test"]["prompt"]) == rows["prompt"]
    wrong = (doc["label"] + 1) % 3
    lls = [(-5.0, False)] * 3
    lls[doc["label"]] = (-1.0, True)
    others = {"acc_depth_0": None, "acc_depth_25": None, "acc_depth_75": None, "acc_depth_100": None}
    assert utils.needle_mc_results(doc, lls) == {"acc": 1.0, "acc_depth_50": 1.0, **others}
    lls[wrong] = (-0.5, False)
    assert utils.needle_mc_results(doc, lls) == {"acc": 0.0, "acc_depth_50": 0.0, **others}
    gen = utils.needle_gen_results(doc, [f" {doc['answer']}."])
    assert gen["exact_match"] == gen["exact_match_depth_50"] == 1.0 and gen["exact_match_depth_0"] is None
    assert utils.needle_gen_results(doc, [" 1"])["exact_match_depth_50"] == 0.0
    assert utils.mean_present([None, 1.0, 0.0, None]) == 0.5 and math.isnan(utils.mean_present([None]))


@pytest.fixture(scope="module")
def longer_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny test model with room for 1024 positions (``max_position_embeddings`` 128 -> 1024)."""
    longer = Path(shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("long") / "model"))
    config = json.loads((longer / "config.json").read_text())
    (longer / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    return longer


METADATA = {"wikitext_path": "sample", "min_chars": 6000, "context_chars": 1200, "docs_per_depth": 1}
LONG_TASKS = ["distperp_longdocs", "distperp_needle", "distperp_needle_gen"]


@pytest.fixture(scope="module")
def one_process(longer_model):
    """The three tasks in this process (``--model distperp``, max_length 1024), samples logged."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="distperp",
        model_args=f"pretrained={longer_model},max_length=1024",
        tasks=LONG_TASKS,
        task_manager=TaskManager(include_path=str(TASKS_DIR), metadata=METADATA),
        batch_size=4,
        device="cpu",
        log_samples=True,
    )


def test_end_to_end_with_the_tiny_model(one_process):
    """Each task, scored by ``--model distperp`` at max_length 1024, on small documents of the packaged sample."""
    out = one_process
    results = out["results"]
    longdocs = results["distperp_longdocs"]
    n_docs = len(out["samples"]["distperp_longdocs"])
    assert n_docs == 3 and longdocs["n_tokens,none"] > 1024 * n_docs  # long enough for several windows each
    assert longdocs["token_perplexity,none"] > 1 and longdocs["bits_per_byte,none"] > 0
    assert isinstance(longdocs["word_perplexity_stderr,none"], float)
    for task, metric in (("distperp_needle", "acc"), ("distperp_needle_gen", "exact_match")):
        got = results[task]
        assert len(out["samples"][task]) == 5  # 5 default depths x 1 document
        assert 0 <= got[f"{metric},none"] <= 1
        assert {f"{metric}_depth_{d},none" for d in (0, 25, 50, 75, 100)} <= set(got)
    needle = out["samples"]["distperp_needle"][0]
    assert len(needle["resps"]) == 4 and needle["doc"]["prompt"].startswith("The secret number of ")
    json.dumps(results)


@pytest.mark.distributed
def test_the_long_tasks_under_context_parallelism(one_process, longer_model, tmp_path):
    """The three tasks on 2 processes with ``cp_size=2,cp_min_tokens=1000``: windows of 1,000 tokens and more on the
    group, shorter rows data parallel; per-document log-likelihoods within float32 rounding of one process's,
    the same greedy answers, and both kinds of rows in the calls."""
    from helpers import accelerate_launch_prefix, load_results, load_samples, run_command

    out = tmp_path / "out"
    run_command(
        [
            *accelerate_launch_prefix(2),
            "-m",
            "lm_eval",
            "--model",
            "distperp",
            "--model_args",
            f"pretrained={longer_model},max_length=1024,cp_size=2,cp_min_tokens=1000",
            "--tasks",
            ",".join(LONG_TASKS),
            "--include_path",
            str(TASKS_DIR),
            "--metadata",
            json.dumps(METADATA),
            "--batch_size",
            "4",
            "--output_path",
            str(out),
            "--log_samples",
        ],
        cwd=tmp_path,
    )
    info = load_results(out)["config"]["distperp"]
    assert info["fingerprint"].startswith("cp2:")
    calls = [c for c in info["calls"] if c.get("rows")]
    assert sum(c["context_parallel_rows"] for c in calls) > 0
    assert sum(c["rows"] - c["context_parallel_rows"] for c in calls) > 0
    for task in LONG_TASKS:
        mine = {s["doc_id"]: s["resps"] for s in load_samples(out, task)}
        theirs = {s["doc_id"]: s["resps"] for s in one_process["samples"][task]}
        assert mine.keys() == theirs.keys(), task
        for doc, answers in theirs.items():
            for a, b in zip(answers, mine[doc]):
                a, b = a[0], b[0]
                if task == "distperp_needle_gen":
                    assert a == b, (task, doc)
                else:
                    a, b = (a[0], b[0]) if isinstance(a, (list, tuple)) else (a, b)
                    assert abs(float(a) - float(b)) <= 1e-4 * max(1.0, abs(float(a))), (task, doc, a, b)


@pytest.mark.distributed
def test_a_ruler_task_and_the_needle_generate_offline_on_one_process_and_on_a_context_parallel_group(
    tiny_model_dir, tmp_path
):
    """lm-eval's ``niah_single_1`` (RULER: a needle in a haystack of one repeated sentence, no download; sized with
    the model's own tokenizer, ``wonderwords`` installed) at 4,096 tokens and ``distperp_needle_gen`` at ~3,400
    through ``--model distperp``, offline: every RULER prompt about 4,096 tokens and a score per length; then on 2
    processes with ``cp_size=2`` (every prompt generated by the group: prefill split, cache split) the same texts as
    one process's, marked ``cp2:``."""
    from helpers import accelerate_launch_prefix, load_results, load_samples, run_command, run_lm_eval
    from transformers import AutoTokenizer

    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4608}))
    out, grouped = tmp_path / "out", tmp_path / "grouped"
    tasks = ["niah_single_1", "distperp_needle_gen"]
    metadata = {"max_seq_lengths": [4096], "wikitext_path": "sample", "context_chars": 7000, "docs_per_depth": 1}
    args = ["--model", "distperp", "--tasks", ",".join(tasks), "--include_path", str(TASKS_DIR), "--limit", "2"]
    args += ["--metadata", json.dumps(metadata), "--batch_size", "2", "--log_samples"]
    single = f"pretrained={model},max_length=4608"
    run_lm_eval([*args, "--model_args", single, "--output_path", str(out)], cwd=tmp_path, timeout=900)
    got = load_results(out)["results"]["niah_single_1"]
    assert 0 <= got["4096,none"] <= 1
    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = {
        task: [len(tokenizer(s["arguments"]["gen_args_0"]["arg_0"])["input_ids"]) for s in load_samples(out, task)]
        for task in tasks
    }
    assert len(lengths["niah_single_1"]) == 2 and all(3500 <= n <= 4096 for n in lengths["niah_single_1"]), lengths
    assert len(lengths["distperp_needle_gen"]) == 2 and all(n >= 2048 for n in lengths["distperp_needle_gen"]), lengths
    options = f"{single},cp_size=2,cp_min_tokens=2048"
    launch = [*accelerate_launch_prefix(2), "-m", "lm_eval", *args, "--model_args", options]
    run_command([*launch, "--output_path", str(grouped)], cwd=tmp_path, timeout=900)
    info = load_results(grouped)["config"]["distperp"]
    generated = [c for c in info["calls"] if c["kind"] == "generate_until"]
    assert sum(c["context_parallel_jobs"] for c in generated) == 4 and info["fingerprint"].startswith("cp2:")
    for task in tasks:
        texts = {s["doc_id"]: s["resps"] for s in load_samples(out, task)}
        assert {s["doc_id"]: s["resps"] for s in load_samples(grouped, task)} == texts, task
