"""Sharded weights (``shard_size``): the pure rules, and real ``accelerate launch`` runs (gloo on CPU) whose
per-document results are bit-identical to one unsharded process, fp32 and ``quantize=int4,reference=base``, with
2 processes (``shard_size=2``) and 2 nodes x 2 processes on loopback (``shard_size=node``).
"""

import functools
import json

import pytest
from helpers import (
    accelerate_launch_prefix,
    load_results,
    load_samples,
    lora_adapter,
    run_command,
    run_two_nodes,
    side_by_side,
)

from distperp_harness.model.sharding import check_groups_within_hosts, resolve_shard_size, shard_groups

TASKS = "dptest_rolling,dptest_mc,dptest_fewshot,dptest_chain"
INT4 = ",quantize=int4,group_size=32,reference=base"
FAMILY_TASKS = {"fp32": TASKS, "int4": TASKS.replace(",dptest_chain", "")}
"""Sharded generation (a shard group decoding in step) runs in the fp32 family; in the int4 family it would be the
same lockstep again (the int4 weights stay outside FSDP either way), at a minute of make test."""


@pytest.mark.parametrize(
    "option, world, local, expected",
    [(1, 4, 4, 1), (2, 4, 4, 2), ("node", 4, 2, 2), ("node", 8, 8, 8), (4, 16, 8, 4), (1, 3, 3, 1)],
)
def test_resolve_shard_size(option, world, local, expected):
    assert resolve_shard_size(option, world, local) == expected


@pytest.mark.parametrize("option, world, local", [(3, 4, 4), (4, 4, 2), (2, 3, 3), (8, 4, 4)])
def test_shard_size_that_does_not_divide_the_node_fails_with_the_fix(option, world, local):
    with pytest.raises(ValueError) as info:
        resolve_shard_size(option, world, local)
    text = str(info.value)
    assert f"shard_size={option!r}" in text and f"{local} per node" in text and "Fix:" in text and "'node'" in text


def test_a_group_across_hosts_is_refused_with_the_fix():
    check_groups_within_hosts(["a", "a", "b", "b"], 2)
    check_groups_within_hosts(["a"] * 4, 4)  # two "nodes" on one machine, as the tests run them
    with pytest.raises(ValueError, match="ranks 0..3 spans the hosts a, b.*Fix: launch with accelerate launch"):
        check_groups_within_hosts(["a", "a", "b", "b"], 4)


def test_shard_groups_are_consecutive_ranks():
    assert shard_groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shard_groups(4, 1) == [[0], [1], [2], [3]]


# ------------------------------------------------------------------------------------------ real launches
def _args(model_dir, tasks_dir, out, model_args, tasks=TASKS):
    return [
        "-m",
        "lm_eval",
        "--model",
        "distperp",
        "--model_args",
        f"pretrained={model_dir},max_length=128{model_args}",
        "--tasks",
        tasks,
        "--include_path",
        str(tasks_dir),
        "--batch_size",
        "3",
        "--log_samples",
        "--output_path",
        str(out),
    ]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tasks_dir, tmp_path_factory):
    """Each launch once: 1 process unsharded, 2 processes ``shard_size=2``, 2 nodes x 2 ``shard_size=node``;
    fp32 (a LoRA fine-tune, merged: ``peft=`` works sharded) and int4 with the unquantized reference."""
    root = tmp_path_factory.mktemp("sharding")
    adapter = lora_adapter(tiny_model_dir, root / "lora", seed=4)
    out = {}
    families = (("fp32", f",peft={adapter}"), ("int4", INT4))

    def one_process(name, extra):
        out[f"1p-{name}"] = root / f"1p-{name}"
        run_command(
            [
                *accelerate_launch_prefix(1),
                *_args(tiny_model_dir, tasks_dir, out[f"1p-{name}"], extra, FAMILY_TASKS[name]),
            ],
            cwd=root,
        )

    side_by_side(*(functools.partial(one_process, name, extra) for name, extra in families))
    for name, extra in families:
        tasks = FAMILY_TASKS[name]
        out[f"2p-{name}"] = root / f"2p-{name}"
        run_command(
            [
                *accelerate_launch_prefix(2),
                *_args(tiny_model_dir, tasks_dir, out[f"2p-{name}"], extra + ",shard_size=2", tasks),
            ],
            cwd=root,
        )
        out[f"2nodes-{name}"] = root / f"2nodes-{name}"
        run_two_nodes(
            _args(tiny_model_dir, tasks_dir, out[f"2nodes-{name}"], extra + ",shard_size=node", tasks),
            cwd=root,
            per_node=2,
        )
    return out


def _per_doc(samples):
    return [(r["doc_id"], [resp[0] for resp in r["resps"]], r["filtered_resps"]) for r in samples]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fp32", "int4"])
@pytest.mark.parametrize("setup, world, shard", [("2p", 2, 2), ("2nodes", 4, 2)])
def test_sharded_runs_give_the_same_bits_as_one_unsharded_process(runs, name, setup, world, shard):
    base, other = load_results(runs[f"1p-{name}"]), load_results(runs[f"{setup}-{name}"])
    info = other["config"]["distperp"]
    assert info["world_size"] == world and info["sharding"]["shard_size"] == shard
    assert info["sharding"]["groups"] == [list(range(g, g + shard)) for g in range(0, world, shard)]
    decided = ("packed_rows", "cached_prefix", "head_only_where_scored")
    assert {k: info["paths"]["model"][k] for k in decided} == {k: True for k in decided}, info["paths"]
    assert info["paths"] == base["config"]["distperp"]["paths"], "a sharded probe must decide as an unsharded one"
    assert info["fingerprint"] == base["config"]["distperp"]["fingerprint"]
    for task in FAMILY_TASKS[name].split(","):
        assert _per_doc(load_samples(runs[f"1p-{name}"], task)) == _per_doc(load_samples(runs[f"{setup}-{name}"], task))
    for metric in ("acc,none", "acc_norm,none"):
        assert other["results"]["dptest_mc"][metric] == base["results"]["dptest_mc"][metric]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        # lm-eval's weighted_perplexity (and stderr) sum per-rank lists in rank order: equal up to summation order
        assert other["results"]["dptest_rolling"][metric] == pytest.approx(
            base["results"]["dptest_rolling"][metric], rel=1e-12
        )


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fp32", "int4"])
def test_bytes_per_rank_at_most_0_6_of_unsharded(runs, name):
    base = load_results(runs[f"1p-{name}"])["config"]["distperp"]
    for setup in ("2p", "2nodes"):
        info = load_results(runs[f"{setup}-{name}"])["config"]["distperp"]
        sharding, whole = info["sharding"], base["sharding"]
        assert whole["shard_size"] == 1 and whole["model_bytes_per_rank"] == [base["weight_bytes"]]
        assert info["weight_bytes"] == base["weight_bytes"]  # one whole copy, whatever the layout
        per_rank = [
            m + (r or 0) for m, r in zip(sharding["model_bytes_per_rank"], sharding["reference_bytes_per_rank"])
        ]
        unsharded = whole["model_bytes_per_rank"][0] + (whole["reference_bytes_per_rank"][0] or 0)
        assert max(per_rank) <= 0.6 * unsharded
        if name == "fp32":
            assert max(sharding["model_bytes_per_rank"]) <= 0.6 * base["weight_bytes"]
            assert sharding["replicated"] == {"model": []}
            assert info["adapter"]["merged"] and info["adapter"] == base["adapter"]  # merged, then sharded
        else:
            ref = info["reference"]
            assert ref["weight_bytes"] == base["reference"]["weight_bytes"] == whole["reference_bytes_per_rank"][0]
            assert max(sharding["reference_bytes_per_rank"]) <= 0.6 * ref["weight_bytes"]
            # torchao's quantized weights stay replicated, and the results say so
            assert len(sharding["replicated"]["model"]) == len(info["quantization"]["quantized"])
            assert any("stay replicated" in note for note in sharding["notes"])
            assert sharding["replicated"]["reference"] == []


@pytest.mark.distributed
def test_the_bytes_counted_from_the_collectives_are_the_whole_weights_once_per_forward(runs):
    """FSDP2 gathers every weight once per forward, whatever its rows or tokens: each rank receives (n-1)/n of them
    (a ring all-gather), per decode step and per scoring forward alike."""
    info = load_results(runs["2p-fp32"])["config"]["distperp"]
    whole = (2 - 1) / 2 * info["weight_bytes"]
    assert info["traffic"]["decode_step_received_bytes"] == {"fixed": whole, "per_row": 0}
    assert info["traffic"]["scoring_received_bytes"] == {"fixed": whole, "per_token": 0}


@pytest.mark.distributed
def test_load_memory_is_reported_per_rank(runs):
    info = load_results(runs["2nodes-int4"])["config"]["distperp"]
    peaks = info["load_memory_per_rank"]
    assert len(peaks) == 4 and all(p["device"] == "cpu" and p["device_peak_bytes"] is None for p in peaks)
    assert all(
        p["host_peak_rss_bytes"] is None or p["host_peak_rss_bytes"] >= p["host_rss_before_bytes"] for p in peaks
    )
    json.dumps(info)  # everything recorded is plain JSON


@pytest.mark.distributed
def test_a_rank_that_hangs_mid_scoring_is_named_within_the_timeout(tiny_model_dir, tasks_dir, tmp_path):
    """Rank 1 stalls after its second batch; rank 0's next gather of sharded weights fails at ``timeout`` and the
    control group names rank 1. No results file."""
    out = tmp_path / "out"
    proc = run_command(
        [*accelerate_launch_prefix(2), *_args(tiny_model_dir, tasks_dir, out, ",shard_size=2,timeout=15")],
        cwd=tmp_path,
        env={"DISTPERP_TEST_HOLD": "1:2"},
        check=False,
        timeout=300,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "rank(s) [1] never arrived" in text and "gather of sharded weights" in text, text[-3000:]
    assert not list(out.rglob("results_*.json"))


@pytest.mark.distributed
def test_a_sharded_run_resumes_from_an_unsharded_one(tiny_model_dir, tasks_dir, tmp_path):
    """Batches saved by one unsharded process are reused by 2 sharded ones (every forward of theirs is then an
    idle one, matched across the group): same bits, nothing recomputed."""
    saved = tmp_path / "saved"
    for n, extra, out in ((1, "", tmp_path / "first"), (2, ",shard_size=2", tmp_path / "again")):
        run_command(
            [*accelerate_launch_prefix(n), *_args(tiny_model_dir, tasks_dir, out, f",resume_dir={saved}{extra}")],
            cwd=tmp_path,
        )
    again = load_results(tmp_path / "again")["config"]["distperp"]
    assert again["resume"]["reused"] > 0 and again["resume"]["saved"] == 0
    assert again["fingerprint"] == load_results(tmp_path / "first")["config"]["distperp"]["fingerprint"]
    for task in TASKS.split(","):
        assert _per_doc(load_samples(tmp_path / "again", task)) == _per_doc(load_samples(tmp_path / "first", task))
