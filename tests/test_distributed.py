"""Real multi-process runs: ``accelerate launch`` with 1, 2 and 3 processes, 2 "nodes" on loopback and
``torchrun`` give byte-equal per-document results and equal metrics; faults end in bounded, named errors.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import (
    REPO_ROOT,
    accelerate_launch_prefix,
    free_port,
    load_results,
    load_samples,
    lora_adapter,
    offline_env,
    run_command,
    run_two_nodes,
    side_by_side,
)

pytestmark = pytest.mark.distributed

TASKS = "dptest_rolling,dptest_mc,dptest_mmlu,dptest_fewshot,dptest_gen,dptest_chain,dptest_sample,distperp_wikitext2"
INT4_TASKS = "distperp_wikitext2,dptest_mc,dptest_mmlu,dptest_fewshot,dptest_rolling,distperp_local_docs"
ROLLING_DOCS = REPO_ROOT / "tests" / "tasks" / "dptest_rolling.jsonl"  # distperp_local_docs on dptest_rolling's texts
EXACT_METRICS = {
    "dptest_mc": ["acc,none", "acc_norm,none"],
    "dptest_mmlu": ["acc,none"],
    "dptest_fewshot": ["acc,none", "acc_norm,none"],
    "dptest_gen": ["exact_match,none"],
    "dptest_chain": ["exact_match,none"],
}


@pytest.fixture(scope="module")
def tasks_dir(tasks_dir, tmp_path_factory):
    """One --include_path holding the test tasks and the shipped distperp tasks."""
    both = tmp_path_factory.mktemp("tasks")
    shutil.copytree(tasks_dir, both / "dptest")  # lm-eval's task index does not follow symbolic links
    shutil.copytree(REPO_ROOT / "tasks" / "distperp", both / "distperp")
    return both


def _lm_eval_args(model_dir, tasks_dir, out, extra=(), model_args="", tasks=TASKS):
    from distperp_harness.commands.tiny import sample_text_path

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
        "--metadata",
        json.dumps({"wikitext_path": str(sample_text_path()), "docs_path": str(ROLLING_DOCS)}),
        "--output_path",
        str(out),
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tasks_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    out = {name: root / name for name in ("1p", "2p", "3p", "2nodes", "1p-int4", "2p-int4", "torchrun")}
    adapter = lora_adapter(tiny_model_dir, root / "lora", seed=3)
    # a LoRA fine-tune merged, then quantized, against its base without the adapter: same exactness
    int4 = {
        "model_args": f",peft={adapter},quantize=int4,group_size=32,reference=pretrained,int4_prefill=64",
        "tasks": INT4_TASKS,
    }

    def launch(n, name, extra):
        run_command(
            [*accelerate_launch_prefix(n), *_lm_eval_args(tiny_model_dir, tasks_dir, out[name], **extra)], cwd=root
        )

    side_by_side(lambda: launch(1, "1p", {}), lambda: launch(1, "1p-int4", int4))  # the one-process runs
    for n in (2, 3):
        launch(n, f"{n}p", {})
    # 2 nodes at batch_size=auto against 1 process at 3: the default batch_invariant=auto across nodes and batchings
    run_two_nodes(_lm_eval_args(tiny_model_dir, tasks_dir, out["2nodes"], ["--batch_size", "auto"]), cwd=root)
    launch(2, "2p-int4", int4)
    run_command(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            *_lm_eval_args(tiny_model_dir, tasks_dir, out["torchrun"]),
        ],
        cwd=root,
    )
    return out


@pytest.mark.parametrize("setup, world, nodes", [("2p", 2, 1), ("3p", 3, 1), ("2nodes", 2, 2), ("torchrun", 2, 1)])
def test_identical_to_one_process(runs, setup, world, nodes):
    base, other = load_results(runs["1p"]), load_results(runs[setup])
    info = other["config"]["distperp"]
    assert info["world_size"] == world and info["num_nodes"] == nodes
    assert info["fingerprint"] == base["config"]["distperp"]["fingerprint"]
    for task in TASKS.split(","):  # the samples files, every field of every document (resps included)
        assert load_samples(runs[setup], task) == load_samples(runs["1p"], task), task
    for task, metrics in EXACT_METRICS.items():
        for metric in metrics:
            assert other["results"][task][metric] == base["results"][task][metric]
    wikitext = {k: v for k, v in base["results"]["distperp_wikitext2"].items() if k not in ("alias", "name")}
    assert "token_perplexity_stderr,none" in wikitext
    assert {k: other["results"]["distperp_wikitext2"][k] for k in wikitext} == wikitext  # every metric, exactly
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        # lm-eval's built-in weighted_perplexity sums per-rank lists in rank order: equal up to summation order.
        assert other["results"]["dptest_rolling"][metric] == pytest.approx(
            base["results"]["dptest_rolling"][metric], rel=1e-12
        )


def test_sampled_generations_are_samples(runs):
    """dptest_sample (temperature 1, lm-eval's default --seed) is compared per document on every world size by
    test_identical_to_one_process; here: those are real samples, not one repeated text or the greedy one."""
    sampled = [r["resps"][0] for r in load_samples(runs["1p"], "dptest_sample")]
    greedy = [r["resps"][0] for r in load_samples(runs["1p"], "dptest_gen")]
    assert len(sampled) == 10 and len({json.dumps(r) for r in sampled}) > 5 and sampled != greedy


def test_quantized_identical_across_world_sizes(runs):
    one, two = load_results(runs["1p-int4"]), load_results(runs["2p-int4"])
    assert two["config"]["distperp"]["quantization"]["config_name"] == "PrototypeInt4WeightOnlyConfig"
    products = two["config"]["distperp"]["int4_products"]  # products of >= 64 rows dense, smaller ones the kernel
    assert products == one["config"]["distperp"]["int4_products"] | {"seconds": products["seconds"]}
    assert products["rows"] == 64 and products["layers"] == len(two["config"]["distperp"]["quantization"]["quantized"])
    assert two["config"]["distperp"]["fingerprint"] == one["config"]["distperp"]["fingerprint"]
    assert two["results"]["distperp_wikitext2"] == one["results"]["distperp_wikitext2"]
    assert two["results"]["distperp_wikitext2"]["kl_divergence,none"] > 0
    for task in INT4_TASKS.split(","):
        assert load_samples(runs["2p-int4"], task) == load_samples(runs["1p-int4"], task), task


def test_adapter_identity_identical_across_world_sizes(runs):
    """peft= under 2 processes: every rank merged the same adapter before quantizing, and the results name it."""
    one, two = load_results(runs["1p-int4"])["config"], load_results(runs["2p-int4"])["config"]
    for key in ("model_sha", "peft_sha"):
        assert two[key] == one[key] and two[key].startswith("sha256:")
    adapter = two["distperp"]["adapter"]
    assert adapter == one["distperp"]["adapter"] and adapter["merged"] and adapter["peft_type"] == "LORA"
    assert any("merged into the weights before quantize=int4" in n for n in two["distperp"]["quantization"]["notes"])
    assert two["distperp"]["reference"]["source"] == "pretrained"


def test_reference_entries_identical_across_world_sizes(runs):
    one, two = (load_results(runs[k])["config"]["distperp"]["reference"] for k in ("1p-int4", "2p-int4"))
    assert sorted(one["tasks"]) == sorted(INT4_TASKS.split(","))
    assert two["tasks"] == one["tasks"]  # every field of every task, exactly
    assert one["tasks"]["dptest_mc"]["n_docs"] == 20 and "flips" in one["tasks"]["dptest_mc"]


@pytest.mark.parametrize(
    "entry_task, metrics_task",
    [
        ("distperp_wikitext2", "distperp_wikitext2"),
        ("dptest_rolling", "distperp_local_docs"),
        ("distperp_local_docs", "distperp_local_docs"),
    ],
)
def test_reference_entries_equal_the_distperp_task_metrics(runs, entry_task, metrics_task):
    """A plain rolling YAML (lm-eval's own metrics) gets the same KL numbers as distperp's task on the same texts."""
    results = load_results(runs["2p-int4"])
    entry = results["config"]["distperp"]["reference"]["tasks"][entry_task]
    metrics = results["results"][metrics_task]
    assert entry["n_docs"] == len(load_samples(runs["2p-int4"], metrics_task))
    assert entry["n_tokens"] == metrics["n_tokens,none"]
    for name in ("kl_divergence", "top1_agreement", "ln_ppl_ratio"):
        assert entry[name] == metrics[f"{name},none"] and entry[f"{name}_stderr"] == metrics[f"{name}_stderr,none"]
    assert entry["kl_p99"] == metrics["kl_p99,none"] and entry["kl_max"] == metrics["kl_max,none"]


def test_flips_match_the_logged_samples_of_an_unquantized_run(runs):
    """Flips of the quantized fine-tune against its base (reference=pretrained), counted from the samples of the
    plain unquantized run of the base ("1p")."""
    import numpy as np

    entry = load_results(runs["2p-int4"])["config"]["distperp"]["reference"]["tasks"]["dptest_mc"]
    pick = {
        k: {
            r["doc_id"]: int(np.argmax([float(resp[0][0]) for resp in r["resps"]]))
            for r in load_samples(runs[k], "dptest_mc")
        }
        for k in ("1p", "2p-int4")
    }
    assert entry["n_flips"] == sum(pick["1p"][d] != pick["2p-int4"][d] for d in pick["1p"])


def test_work_is_shared_across_ranks(runs):
    info = load_results(runs["2p"])["config"]["distperp"]
    rolling = [c for c in info["calls"] if c["kind"] == "loglikelihood_rolling"][0]
    assert len(rolling["padded_tokens_per_rank"]) == 2 and min(rolling["padded_tokens_per_rank"]) > 0
    assert rolling["max_over_mean"] >= 1.0
    choice = [c for c in info["calls"] if c["kind"] == "loglikelihood"][0]  # multiple choice in shared rows
    assert choice["share_mode"] == "prefix" and choice["rows"] < choice["units"] and choice["tokens_saved"] > 0
    generation = [c for c in info["calls"] if c["kind"] == "generate_until"][0]  # lanes planned once, claimed
    assert generation["claiming"] == "dynamic" and generation["lanes"] >= 3 and generation["shared_lanes"] >= 2
    assert sum(r["lanes"] for r in generation["per_rank"]) == generation["lanes_computed"] == generation["lanes"]
    assert all(r["lanes"] > 0 for r in generation["per_rank"])


def test_collective_timeout_names_the_missing_rank(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent("""
        import sys, time, torch
        from distperp_harness.distributed.collective import AccelerateCollective, CollectiveError
        c = AccelerateCollective(timeout_s=4, cpu=True)
        sys.stdout.write(f"CONTROL {c.rank} {c.control_backend}\\n"); sys.stdout.flush()  # one write: no interleaving
        c.all_gather_tensor(torch.zeros(2))            # everyone arrives once
        if c.rank == 1:
            time.sleep(120)                            # then rank 1 hangs
        try:
            c.all_gather_tensor(torch.ones(2), name="gather scores")
        except CollectiveError as exc:
            print("ERROR:", exc, flush=True)
            sys.exit(3)
    """)
    )
    t0 = time.monotonic()
    proc = run_command([*accelerate_launch_prefix(2), str(script)], cwd=tmp_path, check=False, timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "rank(s) [1] never arrived" in proc.stdout + proc.stderr
    assert "gather scores" in proc.stdout + proc.stderr
    # the exchanges ran on the dedicated gloo control group (the path NCCL runs take too), with its timeout
    assert "CONTROL 0 gloo" in proc.stdout and "CONTROL 1 gloo" in proc.stdout
    assert elapsed < 90


def test_killed_rank_fails_the_run_without_results(tiny_model_dir, tasks_dir, tmp_path):
    out = tmp_path / "out"
    cmd = [*accelerate_launch_prefix(2), *_lm_eval_args(tiny_model_dir, tasks_dir, out)]
    cmd[cmd.index("--model_args") + 1] += ",timeout=30"
    launcher = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=offline_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        victim = _wait_for_rank(launcher.pid, rank=1, timeout=120)
        time.sleep(2.0)  # let it get into model loading / scoring
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=90)
        assert time.monotonic() - t0 < 90
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode != 0, output[-2000:]
    assert not list(out.rglob("results_*.json"))


def _wait_for_rank(launcher_pid, rank, timeout):
    """PID of the launched process, a descendant of ``launcher_pid``, whose environment says RANK=<rank> (other
    launches on the machine, e.g. a second test run, are never matched)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == launcher_pid or not _descends_from(int(pid), launcher_pid):
                continue
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"RANK={rank}".encode() in env and b"lm_eval" in cmdline and "MAIN_PROCESS_PORT".encode() not in cmdline:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never started")


def _descends_from(pid, ancestor):
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
        except (OSError, ValueError, IndexError):
            return False
        if pid == ancestor:
            return True
    return False


def test_use_cache_with_several_processes_is_refused(tiny_model_dir, tasks_dir, tmp_path):
    cmd = [
        *accelerate_launch_prefix(2),
        *_lm_eval_args(tiny_model_dir, tasks_dir, tmp_path / "out", ["--use_cache", str(tmp_path / "cache")]),
    ]
    proc = run_command(cmd, cwd=tmp_path, check=False, timeout=300)
    assert proc.returncode != 0
    assert "--use_cache with 2 processes is not supported" in proc.stdout + proc.stderr


def test_ctrl_c_on_the_launcher_stops_every_rank(tiny_model_dir, tasks_dir, tmp_path):
    cmd = [*accelerate_launch_prefix(2), *_lm_eval_args(tiny_model_dir, tasks_dir, tmp_path / "out")]
    launcher = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=offline_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        ranks = [_wait_for_rank(launcher.pid, rank=r, timeout=120) for r in (0, 1)]
        os.killpg(launcher.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole foreground group
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and _alive(p) for p in ranks):
            time.sleep(0.2)
        assert not any(_alive(p) for p in ranks)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode != 0


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_per_document_kl_values_read_back_from_the_samples_file(runs):
    """``--log_samples`` holds each document's per-token KL values as JSON numbers (not an array's truncated repr):
    read back, they give the run's own aggregates bit for bit (the 99th percentile over every token, each
    document's KL sum)."""
    import math

    import numpy as np

    samples = load_samples(runs["1p-int4"], "distperp_wikitext2")
    results = load_results(runs["1p-int4"])["results"]["distperp_wikitext2"]
    values = [s["kl_p99"] for s in samples]
    assert values and all(isinstance(v, list) and all(isinstance(x, float) for x in v) for v in values)
    for sample, kl in zip(samples, values):
        total, n_tokens = sample["kl_divergence"]
        assert len(kl) == n_tokens == sample["n_tokens"] and math.fsum(kl) == total
    assert float(np.percentile(np.concatenate([np.asarray(v) for v in values]), 99)) == results["kl_p99,none"]
