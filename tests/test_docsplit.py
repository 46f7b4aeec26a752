"""``distperp_harness.docsplit``: every rank's requests are those one process builds for its documents.

In-process tests build real lm-eval tasks from ``tests/tasks`` and call the core (:func:`build_split`) as the
evaluator calls ``build_all_requests``; the launches at the end run lm-eval under ``accelerate launch``.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
from helpers import TASKS_DIR, load_results, load_samples, run_lm_eval

from distperp_harness import docsplit

SEED = 1234  # lm-eval's default --fewshot_random_seed


@functools.lru_cache(maxsize=1)
def _manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))  # indexing lm-eval's tasks takes seconds: once per module


def _task(name: str):
    from lm_eval.tasks import get_task_dict

    task = get_task_dict([name], _manager())[name]
    task.set_fewshot_seed(SEED)
    return task


def _original():
    from lm_eval.api.task import Task

    build = Task.build_all_requests
    return getattr(build, "__wrapped__", build)  # lm-eval's own, whether or not the wrapper is installed


def _plain(task, **kwargs):
    """lm-eval's own per-rank build, from a freshly seeded sampler: ``{doc_id: [arguments, ...]}``."""
    task.set_fewshot_seed(SEED)
    _original()(task, **kwargs)
    return _by_doc(task.instances)


def _split(task, **kwargs):
    task.set_fewshot_seed(SEED)
    entry = docsplit.build_split(task, _original(), **kwargs)
    return dataclasses.asdict(entry), _by_doc(task.instances)


def _by_doc(instances):
    out = {}
    for inst in sorted(instances, key=lambda i: (i.doc_id, i.idx)):
        out.setdefault(inst.doc_id, []).append(inst.arguments)
    return out


def test_random_fewshot_prompts_are_those_of_one_process():
    task = _task("dptest_random")
    one = _plain(task, rank=0, world_size=1)
    assert len(one) == 10
    plain_ranks, split_ranks = {}, {}
    for rank in range(3):
        plain_ranks.update(_plain(task, rank=rank, world_size=3))
        entry, mine = _split(task, rank=rank, world_size=3)
        assert sorted(mine) == list(range(rank, 10, 3))  # exactly lm-eval's documents of this rank
        assert entry["reason"].startswith("2-shot prompts from the ContextSampler sampler")
        assert (entry["documents"], entry["built_all"], entry["kept_documents"], entry["padded"]) == (
            10,
            True,
            len(mine),
            False,
        )
        split_ranks.update(mine)
    assert split_ranks == one
    assert plain_ranks != one  # lm-eval's own split changes the prompts: the task shows the problem


def test_first_n_task_with_enough_documents_runs_lm_eval_unchanged():
    task = _task("dptest_fewshot")
    assert docsplit.split_reason(task, world_size=2) == (None, 10)
    entry, mine = _split(task, rank=1, world_size=2)
    assert entry == {
        "reason": None,
        "documents": 10,
        "built_all": False,
        "kept_documents": None,
        "padded": False,
        "empty_ranks": 0,
    }
    assert mine == _plain(task, rank=1, world_size=2)
    assert sorted(mine) == [1, 3, 5, 7, 9]


@pytest.mark.parametrize(
    "limit, samples, world, expected",
    [
        (None, None, 20, (None, 20)),
        (None, None, 21, ("20 document(s) for 21 ranks", 20)),
        (1, None, 2, ("1 document(s) for 2 ranks", 1)),
        (0.0, None, 2, (None, 20)),
        (None, [3, 3, 5], 3, ("2 document(s) for 3 ranks", 2)),
        (5, None, 1, (None, 5)),
    ],
)
def test_split_reason_counts_documents_after_limit_and_samples(limit, samples, world, expected):
    assert docsplit.split_reason(_task("dptest_mc"), world_size=world, limit=limit, samples=samples) == expected


def test_rank_without_documents_keeps_fresh_copies_of_the_first_documents_instances():
    task = _task("dptest_mc")
    entry, kept = _split(task, rank=0, world_size=2, limit=1)
    assert entry == {
        "reason": "1 document(s) for 2 ranks",
        "documents": 1,
        "built_all": True,
        "kept_documents": 1,
        "padded": False,
        "empty_ranks": 1,
    }
    first = list(task.instances)
    entry, padded = _split(task, rank=1, world_size=2, limit=1)
    assert entry["padded"] and entry["kept_documents"] == 0
    assert padded == kept and list(padded) == [0]
    assert all(
        a is not b and a.resps == [] and a.filtered_resps == {} and (a.doc_id, a.idx) == (b.doc_id, b.idx)
        for a, b in zip(task.instances, first)
    )
    assert list(task.doc_iterator(rank=1, limit=1, world_size=2)) == []  # evaluate() counts no metric for them


def test_metrics_of_a_rank_without_documents_read_as_empty():
    record = docsplit.DocumentSplit(
        tasks={"a": docsplit.TaskSplit(None, 1, empty_ranks=1), "b": docsplit.TaskSplit(None, 2)}
    )
    metrics = [{"a": {("acc", "none"): [1.0]}, "b": {("acc", "none"): [0.0]}}, {"a": {}, "b": {}}]
    filled = docsplit.fill_empty_ranks(metrics, record)
    assert [rank["a"][("acc", "none")] for rank in filled] == [[1.0], []]
    with pytest.raises(KeyError):
        filled[1]["b"][("acc", "none")]  # a task whose every rank had documents: unchanged
    samples = [{"a": [{"doc_id": 0}]}, {"a": []}, None]
    assert docsplit.fill_empty_ranks(samples, record) == samples
    assert docsplit.fill_empty_ranks(metrics, docsplit.DocumentSplit()) is metrics


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, line, **kwargs):
        self.lines.append(("info", line, kwargs))

    def warning(self, line, **kwargs):
        self.lines.append(("warning", line, kwargs))


def _as_evaluator(lm, task, **kwargs):
    """Call ``task.build_all_requests`` from a function that looks like ``lm_eval.evaluator.evaluate``."""
    scope = {"__name__": "lm_eval.evaluator"}
    exec("def evaluate(lm, task, kwargs):\n    task.build_all_requests(**kwargs)", scope)
    task.set_fewshot_seed(SEED)
    scope["evaluate"](lm, task, kwargs)
    return _by_doc(task.instances)


def test_installed_wrapper_acts_only_for_a_distperp_lm_of_several_processes(monkeypatch):
    from types import SimpleNamespace

    from lm_eval.api.task import Task

    monkeypatch.setattr(Task, "build_all_requests", Task.build_all_requests)  # restored after the test
    monkeypatch.setattr(docsplit, "log", _Log())
    record = docsplit.install_document_split(2)
    wrapped = Task.build_all_requests
    assert record.to_dict() == {"installed": True, "problem": None, "tasks": {}}
    assert docsplit.install_document_split(2).installed and Task.build_all_requests is wrapped  # idempotent
    lm = SimpleNamespace(world_size=2, document_split=record)  # what the wrapper reads: the record, world_size
    task = _task("dptest_random")
    one = _plain(task, rank=0, world_size=1)
    assert _as_evaluator(lm, task, rank=1, world_size=2) == {d: one[d] for d in (1, 3, 5, 7, 9)}
    assert record.tasks["dptest_random"].built_all
    assert [(level, kw) for level, _, kw in docsplit.log.lines] == [("info", {"main_process_only": True})]
    lm.world_size = 1  # one process, or another model (no installed record): lm-eval's own build
    assert _as_evaluator(lm, task, rank=0, world_size=1) == one
    assert _as_evaluator(object(), task, rank=1, world_size=2) == _plain(task, rank=1, world_size=2)


def test_wrapper_is_not_installed_for_one_process_or_another_lm_eval_layout(monkeypatch):
    from lm_eval.api.task import Task

    assert docsplit.evaluator_lm() is None
    assert docsplit.layout_problem() is None
    before = Task.build_all_requests
    assert docsplit.install_document_split(1).to_dict() == {"installed": False, "problem": None, "tasks": {}}
    monkeypatch.setattr(docsplit, "layout_problem", lambda: "lm_eval's Task.doc_iterator() takes no samples")
    monkeypatch.setattr(docsplit, "log", _Log())
    record = docsplit.install_document_split(4)
    assert record.to_dict() == {
        "installed": False,
        "problem": "lm_eval's Task.doc_iterator() takes no samples",
        "tasks": {},
    }
    assert Task.build_all_requests is before
    ((level, line, kwargs),) = docsplit.log.lines
    assert level == "warning" and kwargs == {"main_process_only": False}
    assert "takes no samples" in line and "sampler: first_n" in line and "one process" in line


# ------------------------------------------------------------------------------------------- real launches
def _args(model_dir, out, *extra):
    return [
        "--model",
        "distperp",
        "--model_args",
        f"pretrained={model_dir},max_length=128",
        "--include_path",
        str(TASKS_DIR),
        "--batch_size",
        "3",
        "--log_samples",
        "--output_path",
        str(out),
        *extra,
    ]


def _per_doc(rows):
    return [(r["doc_id"], r["arguments"], r["resps"], r["acc"], r["acc_norm"]) for r in rows]


@pytest.mark.distributed
def test_two_processes_give_one_process_documents_prompts_and_results(tiny_model_dir, tmp_path):
    picks = ["--tasks", "dptest_mc,dptest_random", "--samples", json.dumps({"dptest_mc": [0]})]
    for n in (1, 2):
        run_lm_eval(_args(tiny_model_dir, tmp_path / f"{n}p", *picks), num_processes=n, cwd=tmp_path)
    for task in ("dptest_mc", "dptest_random"):
        assert _per_doc(load_samples(tmp_path / "2p", task)) == _per_doc(load_samples(tmp_path / "1p", task)), task
    one, two = load_results(tmp_path / "1p"), load_results(tmp_path / "2p")
    assert two["results"]["dptest_random"]["acc,none"] == one["results"]["dptest_random"]["acc,none"]
    split = two["config"]["distperp"]["document_split"]
    assert split["installed"] and split["tasks"]["dptest_mc"]["reason"] == "1 document(s) for 2 ranks"
    assert split["tasks"]["dptest_random"]["built_all"] and split["tasks"]["dptest_random"]["documents"] == 10
    assert one["config"]["distperp"]["document_split"] == {"installed": False, "problem": None, "tasks": {}}

    # lm-eval's own --limit 1 on two processes (rank 1 raised "did not find any docs!"): now one document,
    # the one process's prompt and answer (other requests in the plan: scores to float rounding only)
    run_lm_eval(
        _args(tiny_model_dir, tmp_path / "limit", "--tasks", "dptest_mc", "--limit", "1"), num_processes=2, cwd=tmp_path
    )
    (row,), (base,) = load_samples(tmp_path / "limit", "dptest_mc"), load_samples(tmp_path / "1p", "dptest_mc")
    assert (row["doc_id"], row["arguments"], row["acc"], row["acc_norm"]) == (
        base["doc_id"],
        base["arguments"],
        base["acc"],
        base["acc_norm"],
    )
    assert [float(r[0][0]) for r in row["resps"]] == pytest.approx(
        [float(r[0][0]) for r in base["resps"]], rel=1e-6, abs=1e-6
    )


def test_lm_evals_padding_requests_get_responses_of_their_own():
    """lm-eval's ``evaluate()`` pads a rank with fewer instances with more references to the call's last request
    and appends every answer to its request's ``resps`` (its loop, replayed here): without ``detach_padding`` that
    request's ``resps`` holds its value twice on the padded rank (what a 2-process samples file showed), with it
    once, as on one process; the padding copies take the extra answers and share nothing with it."""
    from lm_eval.api.instance import Instance

    from distperp_harness.docsplit import detach_padding

    def requests():
        return [Instance("loglikelihood_rolling", {}, (f"doc {i}",), 0, ("t", i, 1)) for i in range(2)] + [
            Instance("generate_until", {}, ("q", {}), 0, ("g", 0, 2))
        ]

    def evaluate(reqs, numpad, detach):
        cloned = [r for r in reqs for _ in range(r.repeats)]
        cloned.extend([reqs[-1]] * reqs[-1].repeats * numpad)  # lm-eval's padding: the last request again
        answers = [f"answer {i}" for i in range(len(cloned))]  # what the model returns, one per entry
        for answer, req in zip(answers, detach_padding(cloned) if detach else cloned, strict=True):
            req.resps.append(answer)
        return reqs

    padded = evaluate(requests(), numpad=1, detach=False)
    assert padded[-1].resps == ["answer 2", "answer 3", "answer 4", "answer 5"]  # lm-eval alone: twice its repeats
    ours = evaluate(requests(), numpad=1, detach=True)
    assert [r.resps for r in ours] == [["answer 0"], ["answer 1"], ["answer 2", "answer 3"]]  # as one process
    assert [r.resps for r in evaluate(requests(), numpad=0, detach=True)] == [r.resps for r in ours]
