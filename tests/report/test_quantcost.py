"""quantcost: per-task KL divergence, agreement and answer flips against the reference model.

Pure tests build records by hand (ties, gold rules, tasks without gold, ranks and padding copies) and check the
entries against plain loops. Run tests go through ``lm_eval.simple_evaluate`` in-process on a tiny model whose
weights are scaled up (so int4 flips answers): flips against an independent count from two runs' logged samples
(int4 with ``reference=base``, and the unquantized model alone), the log line, and a resumed run.
"""

import logging
import math
import random

import numpy as np
import pytest
from helpers import make_lm, sharpened_model

from distperp_harness.report.quantcost import Record, choose, gold_indices, log_line, merge, task_entries, task_entry

MC_TASKS = ["dptest_mc", "dptest_rolling"]


def _record(task, doc, idx, ll, ref, length=None, gold=(0,), n=3, mc=True, n_choices=None, rng=None):
    rng = rng or np.random.default_rng(doc * 10 + idx)
    kl = rng.random(n) * 1e-3
    return Record(
        task,
        doc,
        idx,
        ll,
        ref,
        n,
        int(rng.integers(0, n + 1)),
        kl,
        mc,
        n_choices,
        None if length is None else float(length),
        gold,
    )


def _doc(lls, refs, lengths=None, gold=(0,), doc=0, **kw):
    lengths = lengths or [1.0] * len(lls)
    return [
        _record("t", doc, i, ll, ref, length, gold, **kw) for i, (ll, ref, length) in enumerate(zip(lls, refs, lengths))
    ]


# ---------------------------------------------------------------------------------------------------------------
# The choice, ties and gold
# ---------------------------------------------------------------------------------------------------------------


def test_ties_take_the_first_argmax():
    tie = choose(_doc([-1.0, -1.0, -2.0], [-1.0, -3.0, -1.0]))
    assert (tie.model, tie.reference) == (0, 0)  # both tied at index 0 first: no flip
    flip = choose(_doc([-1.0, -1.0], [-2.0, -1.0]))
    assert (flip.model, flip.reference) == (0, 1)
    # length normalisation: -2/2 == -1/1, a tie again, first wins; the raw choice differs
    norm = choose(_doc([-2.0, -1.5], [-1.0, -1.0], lengths=[2.0, 1.0]))
    assert (norm.model, norm.model_norm, norm.reference_norm) == (1, 0, 0)
    entry = task_entry(_doc([-1.0, -1.0], [-1.0, -1.0], doc=0) + _doc([-1.0, -1.0], [-2.0, -1.0], doc=1))
    assert (entry["n_flips"], entry["flips"], entry["n_docs"]) == (1, 0.5, 2)


@pytest.mark.parametrize(
    "target, gold",
    [
        (1, (1,)),
        (np.int64(2), (2,)),
        ("b", (1,)),
        ([0, 2], (0, 2)),
        (3, None),
        (-1, None),
        ("z", None),
        ([0, 9], None),
        (None, None),
        (True, None),
        (1.0, None),
    ],
)
def test_gold_indices_follow_lm_eval(target, gold):
    assert gold_indices(target, ["a", "b", "c"]) == gold


def test_a_task_without_gold_still_counts_flips():
    records = _doc([-1.0, -2.0], [-2.0, -1.0], gold=None, doc=0) + _doc([-1.0, -2.0], [-1.0, -2.0], gold=None, doc=1)
    entry = task_entry(records)
    assert entry["flips"] == 0.5 and entry["n_docs_with_gold"] == 0
    assert "correct_to_wrong" not in entry and "delta_acc" not in entry


def test_correct_to_wrong_and_wrong_to_correct_split_the_flips():
    docs = [
        _doc([-1.0, -2.0, -3.0], [-2.0, -1.0, -3.0], gold=(1,), doc=0),  # correct -> wrong
        _doc([-1.0, -2.0, -3.0], [-2.0, -1.0, -3.0], gold=(0,), doc=1),  # wrong -> correct
        _doc([-1.0, -2.0, -3.0], [-2.0, -1.0, -3.0], gold=(2,), doc=2),  # wrong -> another wrong
        _doc([-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0], gold=(0,), doc=3),
    ]  # no flip
    entry = task_entry([r for d in docs for r in d])
    assert entry["n_flips"] == 3 and (entry["n_correct_to_wrong"], entry["n_wrong_to_correct"]) == (1, 1)
    assert entry["correct_to_wrong"] == 0.25 and entry["acc"] == entry["ref_acc"] == 0.5
    assert entry["delta_acc"] == 0.0 and entry["delta_acc_stderr"] == pytest.approx(math.sqrt(2 / 3 / 4))


def test_unconditional_requests_are_not_choices():
    # acc_mutual_info adds one unconditional request per choice after the choices (idx >= n_choices)
    records = _doc([-2.0, -1.0, -0.1, -0.1], [-1.0, -2.0, -0.1, -0.1], n_choices=2)
    c = choose(records)
    assert (c.model, c.reference) == (1, 0)


def test_without_a_task_object_docs_with_several_requests_count_as_multiple_choice():
    mc = _doc([-1.0, -2.0], [-2.0, -1.0], mc=None, gold=None)
    assert task_entry(mc)["flips"] == 1.0
    single = [_record("t", d, 0, -1.0, -1.5, length=3, mc=None, gold=None) for d in range(3)]
    assert "flips" not in task_entry(single)


# ---------------------------------------------------------------------------------------------------------------
# Numbers against plain loops; world-size independence
# ---------------------------------------------------------------------------------------------------------------


def _random_records(seed=0, n_docs=12):
    rng = np.random.default_rng(seed)
    out = []
    for task, mc in (("mc", True), ("roll", False)):
        for doc in range(n_docs):
            gold = (int(rng.integers(0, 4)),) if doc % 3 else None
            for idx in range(4 if mc else 1):
                n = int(rng.integers(0, 6))
                kl = rng.exponential(1e-3, n)
                ll = -float(rng.exponential(3.0)) - n
                out.append(
                    Record(
                        task,
                        doc,
                        idx,
                        ll,
                        ll + float(rng.normal(0, 0.05)),
                        n,
                        int(rng.integers(0, n + 1)),
                        kl,
                        mc,
                        4 if mc else None,
                        float(rng.integers(1, 9)) if mc else None,
                        gold,
                    )
                )
    return out


def test_entry_against_plain_loops():
    records = _random_records()
    entry = task_entries(records)["mc"]
    docs = {}
    for r in records:
        if r.task == "mc":
            docs.setdefault(r.doc_id, []).append(r)
    kl = [sum(float(x) for r in d for x in r.kl) for d in docs.values()]
    n = [sum(r.n_tokens for r in d) for d in docs.values()]
    ratio = sum(kl) / sum(n)
    se = math.sqrt(len(n) / (len(n) - 1) * sum((a - ratio * b) ** 2 for a, b in zip(kl, n)) / sum(n) ** 2)
    assert entry["kl_divergence"] == pytest.approx(ratio, rel=1e-12)
    assert entry["kl_divergence_stderr"] == pytest.approx(se, rel=1e-9)
    assert entry["top1_agreement"] == pytest.approx(sum(r.top1_agree for d in docs.values() for r in d) / sum(n))
    assert entry["kl_max"] == max(float(x) for d in docs.values() for r in d for x in r.kl)
    flips = flips_norm = 0
    for d in docs.values():
        lls, refs = [r.loglikelihood for r in d], [r.ref_loglikelihood for r in d]
        lens = [r.choice_length for r in d]
        flips += max(range(4), key=lambda i: (lls[i], -i)) != max(range(4), key=lambda i: (refs[i], -i))
        flips_norm += max(range(4), key=lambda i: (lls[i] / lens[i], -i)) != max(
            range(4), key=lambda i: (refs[i] / lens[i], -i)
        )
    assert entry["n_flips"] == flips and entry["n_flips_norm"] == flips_norm and entry["n_docs"] == 12
    assert entry["n_docs_with_gold"] == 8
    assert "flips" not in task_entries(records)["roll"]


@pytest.mark.parametrize("world", [2, 3, 5])
def test_any_split_over_ranks_with_padding_copies_gives_identical_entries(world):
    records = _random_records(seed=1)
    rng = random.Random(world)
    parts = [[] for _ in range(world)]
    for r in records:  # lm-eval's round robin is by document; any split must do
        parts[rng.randrange(world)].append(r)
    for part in parts:
        rng.shuffle(part)
        if part:
            part.extend([part[-1]] * 2)  # lm-eval pads short ranks with copies of their last request
    assert task_entries(merge(parts)) == task_entries(merge([records]))


# ---------------------------------------------------------------------------------------------------------------
# Real runs: flips against two runs' logged samples; the log line; a resumed run
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharp_model(tiny_model_dir, tmp_path_factory):
    return sharpened_model(tiny_model_dir, tmp_path_factory.mktemp("sharp") / "model")


@pytest.fixture(scope="module")
def mc_runs(sharp_model, tasks_dir, tmp_path_factory):
    """The unquantized model alone; int4 against it (saving batches); the same again, resumed from them."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import distperp_harness.lm  # noqa: F401 - sets up the "distperp_harness" logger before a handler is added

    manager = TaskManager(include_path=str(tasks_dir))
    resume = tmp_path_factory.mktemp("resume")
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("distperp_harness")
    logger.addHandler(handler)
    out = {}
    try:
        for name, args in [
            ("base", ""),
            ("int4", f",quantize=int4,group_size=32,reference=base,resume_dir={resume}"),
            ("resumed", f",quantize=int4,group_size=32,reference=base,resume_dir={resume}"),
        ]:
            lm = make_lm(sharp_model, f",max_length=128,batch_size=4{args}")
            out[name] = lm_eval.simple_evaluate(
                model=lm, tasks=MC_TASKS, task_manager=manager, log_samples=True, verbosity="ERROR"
            )
            del lm
    finally:
        logger.removeHandler(handler)
    out["lines"] = lines
    return out


def _choices(row):
    lls = np.array([float(resp[0]) for resp in row["filtered_resps"]])
    lengths = np.array([float(len(c)) for c in row["doc"]["choices"]])
    return int(np.argmax(lls)), int(np.argmax(lls / lengths))


def test_flips_match_an_independent_count_from_logged_samples(mc_runs):
    entry = mc_runs["int4"]["config"]["distperp"]["reference"]["tasks"]["dptest_mc"]
    base = {r["doc_id"]: r for r in mc_runs["base"]["samples"]["dptest_mc"]}
    quant = {r["doc_id"]: r for r in mc_runs["int4"]["samples"]["dptest_mc"]}
    assert base.keys() == quant.keys() and entry["n_docs"] == len(base) == 20
    flips = flips_norm = c2w = w2c = 0
    for doc_id in base:
        (b, b_norm), (q, q_norm) = _choices(base[doc_id]), _choices(quant[doc_id])
        flips += b != q
        flips_norm += b_norm != q_norm
        c2w += base[doc_id]["acc"] == 1.0 and quant[doc_id]["acc"] == 0.0
        w2c += base[doc_id]["acc"] == 0.0 and quant[doc_id]["acc"] == 1.0
    assert flips >= 2 and flips_norm >= 1 and c2w + w2c >= 1  # the scaled model does flip answers
    assert (entry["n_flips"], entry["n_flips_norm"]) == (flips, flips_norm)
    assert (entry["n_correct_to_wrong"], entry["n_wrong_to_correct"]) == (c2w, w2c)
    assert entry["flips"] == flips / 20 and entry["n_docs_with_gold"] == 20
    for suffix in ("", "_norm"):  # lm-eval's own accuracies of the two runs
        assert entry[f"acc{suffix}"] == mc_runs["int4"]["results"]["dptest_mc"][f"acc{suffix},none"]
        assert entry[f"ref_acc{suffix}"] == mc_runs["base"]["results"]["dptest_mc"][f"acc{suffix},none"]


def test_rolling_task_has_an_entry_without_flips(mc_runs):
    entries = mc_runs["int4"]["config"]["distperp"]["reference"]["tasks"]
    assert sorted(entries) == ["dptest_mc", "dptest_rolling"]
    rolling = entries["dptest_rolling"]
    assert rolling["n_docs"] == 8 and rolling["kl_divergence"] > 0 and "flips" not in rolling
    assert rolling["kl_p99"] <= rolling["kl_max"] and 0 < rolling["top1_agreement"] <= 1
    assert mc_runs["int4"]["config"]["distperp"]["reference"]["source"] == "base"


def test_one_log_line_per_task_and_call(mc_runs):
    # accelerate's logger prefixes "[RANK 0] "
    lines = [line.split("] ", 1)[-1] for line in mc_runs["lines"] if "reference vs model on " in line]
    entries = mc_runs["int4"]["config"]["distperp"]["reference"]["tasks"]
    assert len(lines) == 4  # two tasks, two runs with a reference
    assert lines[0] == log_line("dptest_mc", entries["dptest_mc"])
    assert "flips" in lines[0] and "correct→wrong" in lines[0] and "flips" not in lines[1]


def test_a_resumed_run_gives_the_same_entries(mc_runs):
    first, again = (mc_runs[k]["config"]["distperp"] for k in ("int4", "resumed"))
    assert again["resume"]["reused"] > 0 and again["resume"]["saved"] == 0
    assert again["reference"]["tasks"] == first["reference"]["tasks"]


class _FakeTask:
    """What records_from reads from an lm-eval multiple-choice task."""

    OUTPUT_TYPE = "multiple_choice"
    multiple_input = False

    def doc_to_choice(self, doc):
        return doc["choices"]

    def doc_to_target(self, doc):
        return doc["label"]  # KeyError for an unlabeled document


def test_records_read_lengths_and_gold_from_the_task_and_drop_padding_copies():
    from lm_eval.api.instance import Instance

    from distperp_harness.report.quantcost import records_from
    from distperp_harness.report.results import Score

    docs = [{"choices": ["a", "bbbb"], "label": 1}, {"choices": ["cc", "d"]}, {"choices": ["e", "f"], "label": 7}]
    requests = [
        Instance("loglikelihood", doc, ("Q:", " " + c), i, ("mc", d, 1))
        for d, doc in enumerate(docs)
        for i, c in enumerate(doc["choices"])
    ]
    scores = [Score(-1.0 - i, 1, -1.5, np.array([0.25]), 1) for i in range(len(requests))]
    records = records_from(requests + requests[-1:], scores + scores[-1:], {"mc": _FakeTask()})
    assert len(records) == 6
    assert [r.choice_length for r in records[:2]] == [1.0, 4.0]  # len(choice), not len(" " + choice)
    assert [r.gold for r in records[::2]] == [(1,), None, None]  # labelled; no label; label out of range
    entry = task_entries(records)["mc"]
    assert entry["n_docs_with_gold"] == 1 and entry["n_docs"] == 3
    no_task = records_from(requests, scores, None)  # outside lm-eval's evaluator
    assert no_task[1].choice_length == 5.0 and no_task[0].gold is None and no_task[0].multiple_choice is None


def test_requests_from_the_python_api_without_instance_fields_are_not_compared():
    """``lm.loglikelihood_rolling([obj with .args])`` (benchmarks, scripts) has no task or doc_id: nothing to
    compare per task, and no error."""
    from types import SimpleNamespace

    from distperp_harness.report.quantcost import records_from
    from distperp_harness.report.results import Score

    score = Score(-3.0, 2, -2.5, np.array([0.1, 0.2]), 1)
    assert records_from([SimpleNamespace(args=("some text",))], [score], None) == []
