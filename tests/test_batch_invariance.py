"""Batch invariance: per-document results are the same bits for ``batch_size`` 1, 3, 8, ``auto`` and ``auto`` under
another memory budget, by default (``batch_invariant=auto``, on this CPU) and with ``true``, on 1 process and on 2
(rolling windows; tree-row multiple choice, with and without a few-shot prefix shared across questions; greedy and
sampled generation), in bfloat16 at batch sizes 1 and ``auto``, and on the shared real model with ``auto``. ``false``
is checked to move with the batch size on the same tasks (so the sweep can see a difference), and the record says
which a run is."""

import sys
from pathlib import Path

import pytest
from helpers import accelerate_launch_prefix, distperp_args, load_results, load_samples, run_command

TASKS = ["dptest_rolling", "dptest_mc", "dptest_mmlu", "dptest_fewshot", "dptest_gen", "dptest_sample"]
pytestmark = pytest.mark.distributed  # the sweep includes a 2-process launch

SMALL_MEMORY = 300 << 20  # a cgroup limit that makes batch_size=auto choose a smaller token budget


def _value(response):
    """A response as comparable bits: a text, a log-likelihood, or (log-likelihood, greedy). Samples files hold a
    rolling log-likelihood as its repr (a string); a text reads the same way on both sides of a comparison."""
    if isinstance(response, str):
        try:
            return float(response)
        except ValueError:
            return response
    if isinstance(response, (list, tuple)):
        return (float(response[0]), response[1] in (True, "True"))
    return float(response)


def _per_doc(samples_by_task):
    """``{task: {doc_id: [first response per request]}}`` (lm-eval pads a short rank with copies of its last request,
    so only the first response of each request counts)."""
    return {
        task: {r["doc_id"]: [_value(resp[0]) for resp in r["resps"]] for r in samples}
        for task, samples in samples_by_task.items()
    }


def _evaluate(model_dir, tasks_dir, batch_size, invariant=True, mode=None, dtype=None):
    """``mode``: ``batch_invariant``'s value (None: ``true`` if ``invariant`` else ``false``; ``""``: the default);
    ``dtype``: the model's (None: the default float32)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    mode = ("true" if invariant else "false") if mode is None else mode
    out = lm_eval.simple_evaluate(
        model="distperp",
        model_args=f"pretrained={model_dir},max_length=128"
        + (f",batch_invariant={mode}" if mode else "")
        + (f",dtype={dtype}" if dtype else ""),
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(tasks_dir)),
        batch_size=batch_size,
        device="cpu",
        log_samples=True,
    )
    return out["config"]["distperp"], _per_doc({t: out["samples"][t] for t in TASKS})


@pytest.fixture(scope="module")
def sweep(tiny_model_dir, tasks_dir, tmp_path_factory):
    """``{setup: (config.distperp, per-document results)}`` for each batching, in this process, plus a 2-process
    launch at batch size 8 with sharded weights and the default mode at batch sizes 1 and 8."""
    from distperp_harness.model import memory

    runs = {bs: _evaluate(tiny_model_dir, tasks_dir, bs, mode="") for bs in ("1", "3", "8", "auto")}  # the default
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory, "_cgroup_memory", lambda: (SMALL_MEMORY, 0))
        runs["auto-small"] = _evaluate(tiny_model_dir, tasks_dir, "auto")  # batch_invariant=true
    runs["bf16-1"] = _evaluate(tiny_model_dir, tasks_dir, "1", mode="", dtype="bfloat16")
    runs["bf16-auto"] = _evaluate(tiny_model_dir, tasks_dir, "auto", mode="", dtype="bfloat16")
    runs["false-1"] = _evaluate(tiny_model_dir, tasks_dir, "1", invariant=False)
    runs["false-8"] = _evaluate(tiny_model_dir, tasks_dir, "8", invariant=False)
    out = tmp_path_factory.mktemp("invariant-2p")
    # one shard group of 2 (FSDP2): each rank computes its own batches, a row per forward, and matches the other's
    # forwards with idle ones; the data-parallel path is the same launch with the weights whole
    extra = ",batch_invariant=true,shard_size=2"
    args = distperp_args(tiny_model_dir, tasks_dir, out, extra, ",".join(TASKS), batch_size=8)
    run_command([*accelerate_launch_prefix(2), *args, "--log_samples"], cwd=out)
    runs["2p-8"] = (load_results(out)["config"]["distperp"], _per_doc({t: load_samples(out, t) for t in TASKS}))
    return runs


def test_the_sweep_covers_different_batch_plans(sweep):
    budgets = {name: sweep[name][0]["batching"]["token_budget"] for name in ("auto", "auto-small")}
    assert budgets["auto-small"] < budgets["auto"], budgets
    assert sweep["2p-8"][0]["world_size"] == 2 and sweep["2p-8"][0]["sharding"]["shard_size"] == 2
    # batch_invariant=false's bits move with the batch plan on these tasks, so equal results below are no coincidence
    false_1, false_8 = sweep["false-1"][1], sweep["false-8"][1]
    moved = [t for t in TASKS if false_1[t] != false_8[t]]
    assert {"dptest_mc", "dptest_fewshot"} <= set(moved), moved


@pytest.mark.parametrize("setup", ["3", "8", "auto", "auto-small", "2p-8"])
@pytest.mark.parametrize("task", TASKS)
def test_every_document_has_the_bits_of_batch_size_1(sweep, setup, task):
    one, other = sweep["1"][1][task], sweep[setup][1][task]
    assert other.keys() == one.keys()
    differ = {doc: (one[doc], other[doc]) for doc in one if one[doc] != other[doc]}
    assert not differ, (
        f"{len(differ)} of {len(one)} documents differ from batch_size=1, e.g. {next(iter(differ.items()))}"
    )


@pytest.mark.parametrize("task", TASKS)
def test_in_bfloat16_too_every_document_has_the_bits_of_batch_size_1(sweep, task):
    """bfloat16 weights under the default: ``auto`` batches rows (the check passes for bfloat16's products on this
    CPU) and every document has batch size 1's bits; the bits differ from float32's (so the dtype took effect)."""
    one, other = sweep["bf16-1"][1][task], sweep["bf16-auto"][1][task]
    assert other == one
    assert sweep["bf16-auto"][0]["batch_invariance"]["mode"] == "batched"
    assert sweep["bf16-1"][0]["fingerprint"] == sweep["bf16-auto"][0]["fingerprint"] != sweep["1"][0]["fingerprint"]


def test_equal_results_give_equal_fingerprints(sweep):
    assert len({sweep[name][0]["fingerprint"] for name in ("1", "3", "8", "auto", "auto-small", "2p-8")}) == 1


def test_the_record_says_what_the_bits_depend_on(sweep):
    invariant, default = sweep["1"][0], sweep["false-1"][0]  # "1": the default (auto); false-1: batch_invariant=false
    assert invariant["batch_invariant"] is True and default["batch_invariant"] is False
    assert not any("batch plan" in fact for fact in invariant["bits_depend_on"])
    assert any("batch plan" in fact for fact in default["bits_depend_on"])
    assert invariant["sharing"]["max_row_length"] == 128  # rows of at most max_length, whatever the batching
    # a row group's prefix is computed once per batch whatever the batching, batch_size=1 included
    assert invariant["sharing"]["cached_prefix"] == "group" and default["sharing"]["cached_prefix"] == "batch"
    for name in ("1", "8", "auto"):
        shared = sum(c.get("batches_sharing_a_prefix") or 0 for c in sweep[name][0]["calls"])
        assert shared > 0, name
    # rows in batches, each attending alone: the check of this CPU's kernels passed (on both ranks of the launch)
    small = invariant["batch_invariance"]["small_products"]  # products computed as they are below 16 rows
    assert isinstance(small, list) and all(0 < n < 16 for n in small)
    for name in ("1", "8", "auto", "auto-small", "2p-8"):
        asked = "true" if name in ("auto-small", "2p-8") else "auto"
        # sharded weights (2p-8: shard_size=2) are not measured: their decode steps pad every product to 16 rows
        expected = {"asked": asked, "mode": "batched", "why": None, "small_products": [] if name == "2p-8" else small}
        assert sweep[name][0]["batch_invariance"] == expected, name
    assert default["batch_invariance"] == {"asked": "false", "mode": "off", "why": None, "small_products": None}


SHARED_SMOLLM2 = Path(__file__).resolve().parents[2] / "shared" / "models" / "smollm2-135m-instruct"


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_SMOLLM2.is_dir(), reason="the shared SmolLM2 GGUF is not on this machine")
def test_the_shared_real_model_gives_the_same_bits_at_any_batch_size_with_auto(tasks_dir, tmp_path):
    """SmolLM2-135M (a real pretrained model, written as a float32 HF folder by its README's ``to_hf.py``) with
    ``batch_invariant=auto``: rolling, multiple choice (tree rows, a few-shot prefix shared across questions), greedy
    and sampled generation give every document the same bits at batch sizes 1, 8 and ``auto``; the record says auto
    went batched on this CPU."""
    folder = tmp_path / "smollm2"
    run_command([sys.executable, str(SHARED_SMOLLM2 / "to_hf.py"), str(folder)], cwd=tmp_path)
    runs = {bs: _evaluate(folder, tasks_dir, bs, mode="auto") for bs in ("1", "8", "auto")}
    for name, (info, _) in runs.items():
        assert {k: info["batch_invariance"][k] for k in ("asked", "mode", "why")} == {
            "asked": "auto",
            "mode": "batched",
            "why": None,
        }, name
        assert info["batch_invariant"] is True and not any("batch plan" in f for f in info["bits_depend_on"])
    one = runs["1"][1]
    for name in ("8", "auto"):
        for task in TASKS:
            assert runs[name][1][task] == one[task], (name, task)
    assert len({info["fingerprint"] for info, _ in runs.values()}) == 1
