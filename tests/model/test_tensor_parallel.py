"""Tensor parallelism (``tp_size``): the pure rules, and real ``accelerate launch`` runs (gloo on CPU).

At a fixed ``tp_size=2`` every per-document result and generated text is the same bits on 2 processes (one TP
group), 4 processes (2 data-parallel x 2 tensor-parallel; ``quantize=int4,reference=base``) and 2 loopback nodes x
2 processes (``tp_plan=auto``, lm-eval hf's spelling; fp32, sampled generation included); 4 processes resume every
batch and lane 2 processes saved. Against one process without TP, log-likelihoods agree within float32 rounding and
greedy texts are equal (a near-tie would be shown). One failing rank of a TP group is named and every rank stops.
"""

import math
import subprocess

import pytest
from helpers import (
    LaunchOutputs,
    accelerate_launch_prefix,
    distperp_args,
    load_results,
    load_samples,
    offline_env,
    run_command,
    run_two_nodes,
)

from distperp_harness.model.sharding import shard_groups
from distperp_harness.model.tensor_parallel import check_tp_plan, resolve_tp_size, rowwise_slices_too_narrow

TASKS = "dptest_rolling,dptest_mc,dptest_gen,dptest_sample"
INT4 = ",quantize=int4,group_size=32,reference=base"
INT4_TASKS = "dptest_rolling,dptest_mc,dptest_gen"


@pytest.mark.parametrize("option, world, local, expected", [
    (1, 4, 4, 1), (2, 4, 4, 2), ("node", 4, 2, 2), ("node", 2, 2, 2), ("auto", 8, 8, 8), (4, 8, 4, 4),
])  # fmt: skip
def test_resolve_tp_size(option, world, local, expected):
    assert resolve_tp_size(option, world, local) == expected


def test_a_tp_size_that_does_not_divide_the_node_fails_with_the_fix():
    with pytest.raises(
        ValueError,
        match=r"tp_size=3 is not valid with 4 process\(es\), 4 per node: tp_size must "
        r"divide .*each tensor-parallel group .*allowed here: 1, 2, 4 or 'node'. "
        r"Fix: tp_size=node",
    ):
        resolve_tp_size(3, 4, 4)


def test_tp_groups_are_consecutive_ranks():
    assert shard_groups(4, 2) == [[0, 1], [2, 3]] and shard_groups(2, 2) == [[0, 1]]


class _Config:
    model_type = "toy"

    def __init__(self, plan, heads, kv_heads):
        self.base_model_tp_plan, self.num_attention_heads, self.num_key_value_heads = plan, heads, kv_heads


def test_a_model_without_a_tp_plan_is_refused_before_loading():
    with pytest.raises(
        ValueError,
        match=r"tp_size=2: 'org/m' \(toy\) has no tensor-parallel plan.*Fix: "
        r"shard_size=2",
    ):
        check_tp_plan(_Config(None, 4, 4), 2, "org/m")


@pytest.mark.parametrize(
    "heads, kv_heads, name, count", [(6, 6, "num_attention_heads", 6), (8, 2, "num_key_value_heads", 2)]
)
def test_heads_that_do_not_divide_name_both_numbers_and_the_sizes_that_work(heads, kv_heads, name, count):
    with pytest.raises(ValueError) as info:
        check_tp_plan(_Config({"layers.*.q_proj": "colwise"}, heads, kv_heads), 4, "m")
    text = str(info.value)
    assert f"{name}={count}, which does not divide by tp_size=4" in text and "Allowed tp_size for this model: 2" in text
    check_tp_plan(_Config({"layers.*.q_proj": "colwise"}, heads, kv_heads), 2, "m")  # 2 divides both


def test_a_rowwise_slice_that_splits_a_quantization_group_stays_in_full_precision():
    """Quantizing while loading tensor-parallel quantizes each slice on its own: a row-parallel layer whose input
    slice does not divide into groups is left out (named, with the numbers); column-parallel layers keep all inputs."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    narrow = rowwise_slices_too_narrow(model, 2, 32, names)
    assert list(narrow) == ["model.layers.0.mlp.down_proj"]  # 96 / 2 = 48 inputs; o_proj's 64 / 2 = 32 divide
    assert (
        "96 inputs are split over tp_size=2 processes, and a slice of 48 does not divide into groups of 32"
        in narrow["model.layers.0.mlp.down_proj"]
    )
    assert rowwise_slices_too_narrow(model, 2, 16, names) == {}


def test_the_matrices_the_plan_splits_are_transformers_full_plan():
    """Projections and the head from the plan, the input embeddings transformers adds to it; norms stay whole."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from distperp_harness.model.tensor_parallel import planned_matrices
    from distperp_harness.run.fit import _tp_runs_on

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    names = {id(p): n for n, p in model.named_parameters()}
    split = sorted(names[i] for i in planned_matrices(model))
    assert "model.embed_tokens.weight" in split and "lm_head.weight" in split
    assert "model.layers.1.mlp.down_proj.weight" in split and len(split) == 2 + 2 * 7
    assert not any("norm" in n for n in split)
    assert [n for n in (2, 3, 4) if _tp_runs_on(config, n)] == [2]  # 2 key/value heads: only 2 divides both


# ------------------------------------------------------------------------------------------ real launches
@pytest.fixture(scope="module")
def tp_runs(tiny_model_dir, tasks_dir, tmp_path_factory):
    """Each run once: 1 process without TP (in this process); ``tp_size=2`` on 2 processes (saving every batch and
    lane), ``tp_plan=auto`` on 2 nodes x 2 processes, 4 processes resuming from the 2-process run; int4 with its
    unquantized reference at ``tp_size=2`` on 2 and 4 processes (both computing)."""
    root = tmp_path_factory.mktemp("tp")
    out = {name: root / name for name in ("2p", "4p", "2nodes", "2p-int4", "4p-int4")}

    def args(name, extra, tasks=TASKS):
        return [*distperp_args(tiny_model_dir, tasks_dir, out[name], extra, tasks), "--log_samples"]

    import lm_eval
    from lm_eval.tasks import TaskManager

    out["1p"] = lm_eval.simple_evaluate(  # one process without TP: in this process (no launch to wait for)
        model="distperp",
        model_args=f"pretrained={tiny_model_dir},max_length=128",
        tasks=INT4_TASKS.split(","),
        task_manager=TaskManager(include_path=str(tasks_dir)),
        batch_size=3,
        device="cpu",
        log_samples=True,
    )
    saved = root / "saved"
    run_command([*accelerate_launch_prefix(2), *args("2p", f",tp_size=2,resume_dir={saved}")], cwd=root)
    run_two_nodes(args("2nodes", ",tp_plan=auto"), cwd=root, per_node=2)
    # 2 data-parallel groups on one node: reads back what one group saved (computing there: the int4 pair below).
    # Not the sampled task: lm-eval pads 4 ranks with copies of requests, and a sampled copy is one more draw
    run_command([*accelerate_launch_prefix(4), *args("4p", f",tp_size=2,resume_dir={saved}", INT4_TASKS)], cwd=root)
    for n in (2, 4):
        run_command([*accelerate_launch_prefix(n), *args(f"{n}p-int4", f",tp_size=2{INT4}", INT4_TASKS)], cwd=root)
    return out


def _per_doc(samples):
    """Each document's first response per request (lm-eval pads a short rank with copies of its last request, so
    the number of copies depends on the world size)."""
    return {r["doc_id"]: [resp[0] for resp in r["resps"]] for r in samples}


def _one(tp_runs, task=None):
    """The one-process run's ``config.distperp``, or its per-document responses of ``task``."""
    if task is None:
        return tp_runs["1p"]["config"]["distperp"]
    return _per_doc(tp_runs["1p"]["samples"][task])


def _value(response) -> float:
    """A log-likelihood: rolling gives the value, multiple choice ``[value, is_greedy]`` (a tuple in process)."""
    return float(response[0] if isinstance(response, (list, tuple)) else response)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "family, setups, tasks", [("", ("2p", "2nodes"), TASKS), ("-int4", ("2p-int4", "4p-int4"), INT4_TASKS)]
)
def test_a_fixed_tp_size_gives_the_same_bits_on_any_number_of_data_parallel_groups_and_nodes(
    tp_runs, family, setups, tasks
):
    results = {s: load_results(tp_runs[s]) for s in setups}
    worlds = {"2p": 2, "4p": 4, "2nodes": 4, "2p-int4": 2, "4p-int4": 4}
    for setup, result in results.items():
        info = result["config"]["distperp"]
        assert info["world_size"] == worlds[setup] and info["sharding"]["tp_size"] == 2
        assert info["sharding"]["groups"] == shard_groups(worlds[setup], 2)
        assert info["fingerprint"].startswith("tp2:")
    assert len({r["config"]["distperp"]["fingerprint"] for r in results.values()}) == 1
    first = setups[0]
    for task in tasks.split(","):
        want = _per_doc(load_samples(tp_runs[first], task))
        for other in setups[1:]:
            assert _per_doc(load_samples(tp_runs[other], task)) == want, (task, other)


@pytest.mark.distributed
def test_tp_size_2_agrees_with_one_process_within_float32_and_greedy_texts_are_equal(tp_runs):
    one, two = _one(tp_runs), load_results(tp_runs["2p"])["config"]["distperp"]
    assert one["sharding"]["tp_size"] == 1 and not one["fingerprint"].startswith("tp")
    assert one["fingerprint"] != two["fingerprint"].removeprefix("tp2:")  # the sums run in another order
    for task in ("dptest_rolling", "dptest_mc"):
        base, tp = _one(tp_runs, task), _per_doc(load_samples(tp_runs["2p"], task))
        assert base.keys() == tp.keys()
        for doc, answers in base.items():
            for a, b in zip(answers, tp[doc]):
                a, b = _value(a), _value(b)
                assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-4), (task, doc, a, b)
    base, tp = _one(tp_runs, "dptest_gen"), _per_doc(load_samples(tp_runs["2p"], "dptest_gen"))
    differ = {doc: (base[doc], tp[doc]) for doc in base if base[doc] != tp[doc]}
    assert not differ, f"greedy texts differ (a near-tie of two tokens within float32 rounding?): {differ}"


@pytest.mark.distributed
def test_weights_are_split_and_the_layout_recorded(tp_runs):
    base = _one(tp_runs)
    for setup in ("2p", "4p-int4"):
        info = load_results(tp_runs[setup])["config"]["distperp"]
        sharding = info["sharding"]
        assert sharding["engine"].startswith("transformers tensor-parallel plan") and sharding["mesh"][1] == 2
        if setup == "2p":
            assert info["weight_bytes"] == base["weight_bytes"]  # one whole copy, whatever the layout
            assert max(sharding["model_bytes_per_rank"]) <= 0.6 * base["weight_bytes"]
        else:
            assert max(sharding["model_bytes_per_rank"]) < info["weight_bytes"]
            assert max(sharding["reference_bytes_per_rank"]) <= 0.6 * info["reference"]["weight_bytes"]
            assert info["reference"]["tasks"]  # the reference comparison ran on the TP group
        assert all("norm" in name for name in sharding["replicated"]["model"])
        estimated = info["memory_estimate"]["model"]  # made before loading, per TP group member
        assert estimated == pytest.approx(max(sharding["model_bytes_per_rank"]), rel=0 if setup == "2p" else 0.05)


@pytest.mark.distributed
@pytest.mark.parametrize("setup", ["2p", "4p-int4"])
def test_the_bytes_counted_from_the_collectives_are_the_tp_formula(tp_runs, setup):
    """Per decode row, every rank receives the ring all-reduces of the embedding and of two projections per layer
    (``hidden`` values each) and the gathered output head (``vocab`` values), nothing per forward; per scored token
    the same (every probe position is scored)."""
    from distperp_harness.commands.tiny import TEST_SPEC as spec

    info = load_results(tp_runs[setup])["config"]["distperp"]
    traffic = info["traffic"]
    n, b = 2, {"float32": 4, "bfloat16": 2}[(info["quantization"] or {}).get("model_dtype", "float32")]
    per_row = 2 * (n - 1) / n * (2 * spec.num_layers + 1) * spec.hidden_size * b + (n - 1) / n * spec.vocab_size * b
    assert traffic["decode_step_received_bytes"] == {"fixed": 0, "per_row": per_row}
    assert traffic["scoring_received_bytes"] == {"fixed": 0, "per_token": per_row}
    assert _one(tp_runs)["traffic"] is None  # one process: no collectives


@pytest.mark.distributed
def test_a_tp_run_on_more_processes_resumes_what_another_saved(tp_runs):
    """The 2-process ``tp_size=2`` run saved every batch and lane; 4 processes at ``tp_size=2`` (2 groups) read them
    all back (leaders read, members follow without a forward): nothing recomputed, the same bits and texts."""
    again = load_results(tp_runs["4p"])["config"]["distperp"]
    assert again["resume"]["reused"] > 0 and again["resume"]["saved"] == 0, again["resume"]
    assert again["world_size"] == 4 and again["sharding"]["groups"] == [[0, 1], [2, 3]]
    for task in INT4_TASKS.split(","):
        assert _per_doc(load_samples(tp_runs["4p"], task)) == _per_doc(load_samples(tp_runs["2p"], task)), task


@pytest.mark.distributed
@pytest.mark.parametrize("procs,failing,peers", [(4, 3, (0, 1, 2)), (2, 0, (1,))], ids=["member", "leader"])
def test_one_failing_rank_of_a_tp_group_is_named_and_every_rank_stops(
    tiny_model_dir, tasks_dir, tmp_path, procs, failing, peers
):
    """``tp_size=2``, ``timeout=600`` (only the failure channel can end the others in time). Member: on 4
    processes, rank 3 (the second group's member) raises before its 2nd forward, while its leader waits in the
    forward's all-reduce and the first group computes on. Leader: on 2 processes, rank 0 raises before its 2nd
    forward, while its member waits for the leader's next decision or inside the forward. Every rank stops within
    seconds, naming the failed rank; no results are written."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*accelerate_launch_prefix(procs), *distperp_args(tiny_model_dir, tasks_dir, out, ",tp_size=2,timeout=600")],
        cwd=tmp_path,
        env=offline_env({"DISTPERP_TEST_FAIL": f"{failing}:2"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    run = LaunchOutputs([proc])
    failed_at = run.wait_for("Telling the other ranks", timeout=240)
    ended = run.wait_all(timeout=60)
    text = run.texts[0]
    assert proc.returncode != 0
    for peer in peers:
        assert f"distperp: rank {peer} stops because rank {failing} (" in text, text[-4000:]
    assert "failed while scoring: RuntimeError: injected failure for tests" in text, text[-4000:]
    assert not list(out.rglob("results_*.json"))
    assert ended - failed_at < 30
