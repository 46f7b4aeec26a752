"""Smoke tests: every benchmark runs end to end on the tiny test model and the packaged sample, in a dry-sized
configuration (no timing assertions — the numbers of a shared test machine mean nothing). Each runs as its users run
it, ``python -m benchmarks.<name>`` from the repository root, or in this process where that costs nothing more than
a function call (pure simulations, and runs that leave no global state behind)."""

import os
import sys
from types import SimpleNamespace

import pytest
from helpers import REPO_ROOT, run_command


@pytest.fixture(autouse=True)
def _environment_restored():
    """Importing :mod:`benchmarks` sets its offline and quiet variables in ``os.environ``; the tests after these
    (and the processes they start) see the environment the session had."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def bench(module: str, *args, timeout: float = 600, **kwargs):
    """``python -m benchmarks.<module> args...`` from the repository root (offline); its CompletedProcess."""
    return run_command([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=REPO_ROOT, timeout=timeout, **kwargs)


def test_bench_scoring_runs_end_to_end(tiny_model_dir, sample_text_path, tmp_path):
    out = tmp_path / "bench.json"
    proc = bench(
        "bench_scoring",
        "--models",
        tiny_model_dir,
        "--text",
        sample_text_path,
        "--scorers",
        "hf,distperp,bare,int4",
        "--tokens",
        "300",
        "--repeats",
        "1",
        "--max-length",
        "64",
        "--batch-size",
        "2",
        "--memory-tokens",
        "128",
        "--memory-scorers",
        "hf,distperp",
        "--json",
        out,
    )
    table = proc.stdout
    assert "| model | scorer | tokens/s | vs hf | vs bare forward | peak scoring memory | vs hf |" in table
    for label in ("lm-eval hf", "distperp", "bare forward", "distperp int4 (float32 compute)"):
        assert f"| {label} |" in table, table
    assert "MiB" in table and "max |hf - distperp| per document" in table
    assert "memory of" not in table  # both memory workers (python -m benchmarks.bench_scoring) ran
    assert out.is_file()


def test_bench_scoring_profile_mode(tiny_model_dir, sample_text_path):
    proc = bench(
        "bench_scoring",
        "--profile",
        "--models",
        tiny_model_dir,
        "--text",
        sample_text_path,
        "--tokens",
        "200",
        "--max-length",
        "64",
        "--batch-size",
        "2",
    )
    assert "post-processing" in proc.stdout and "bare forward" in proc.stdout


def test_bench_scoring_sweep_mode(tiny_model_dir):
    """``bench_scoring --sweep`` (what ``batch_sweep.py`` measured): tokens/s of ``score_batch`` per row count."""
    from benchmarks import bench_scoring
    from benchmarks._scoring_sweep import sweep_rows

    args = bench_scoring.parse_args(["--sweep", "1,2", "--models", str(tiny_model_dir), "--max-length", "32"])
    args.tokens = 64
    assert args.repeats == 3  # the sweep's default rounds
    args.repeats = 1
    table = sweep_rows(tiny_model_dir, args)
    assert "| rows x 32 | tokens per batch | tokens/s | vs fastest |" in table
    assert "\n| 1 | 32 | " in table and "\n| 2 | 64 | " in table


def test_balance_runs_end_to_end(tiny_model_dir, sample_text_path):
    proc = bench(
        "balance",
        "--model",
        tiny_model_dir,
        "--text",
        sample_text_path,
        "--max-length",
        "64",
        "--ranks",
        "2,4",
        "--batch-sizes",
        "1,2",
        "--sim-ranks",
        "8",
        "--sim-tokens",
        "100000",
        timeout=300,
    )
    out = proc.stdout
    assert "batch size 1:" in out and "batch size 2:" in out
    assert "| ranks | lm-eval tokens | ours tokens |" in out
    assert "Simulation: 8 ranks" in out and "planning wall time" in out


def test_bench_mc_runs_end_to_end(tiny_model_dir, sample_text_path):
    proc = bench(
        "bench_mc",
        "--model",
        tiny_model_dir,
        "--text",
        sample_text_path,
        "--questions",
        "3",
        "--repeats",
        "1",
        "--max-length",
        "128",
        "--batch-size",
        "2",
        timeout=300,
    )
    out = proc.stdout
    assert "| shape | scorer | scoring s | tokens/s | vs hf | vs unshared | rows | tokens computed |" in out
    for shape in ("mmlu0", "mmlu5", "hellaswag", "mmlupro5", "mmlu3", "bbh3"):
        assert f"| {shape} (3 q, " in out, out
        assert f"- {shape}: " in out
    assert "| distperp share_prefix=false |" in out and "DIFFER" not in out


def test_bench_compile_dry(tiny_model_dir, sample_text_path):
    """``bench_compile`` with its cheapest scorers (``hf`` and eager distperp, each a fresh ``--worker`` process) on
    the hellaswag shape: the table and the hf-vs-eager check (compiling itself is left to the compile tests)."""
    proc = bench(
        "bench_compile",
        "--model",
        tiny_model_dir,
        "--work",
        "mc",
        "--scorers",
        "hf,eager",
        "--questions",
        "2",
        "--max-length",
        "128",
        "--batch-size",
        "2",
        "--mc-text",
        sample_text_path,
    )
    out = proc.stdout
    assert "| hellaswag shape (2 q, " in out and "| distperp eager |" in out, out
    assert "- mc: max |hf - eager| per request" in out


def test_random_shape_llama_1b_is_llama_3_2_1b():
    """``--random-shape llama-1b`` (bench_scoring, bench_mc, gpu_all.sh) has Llama-3.2-1B's parameters: 1,235,814,400
    with the output head tied to the embeddings (built on the meta device: nothing allocated)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks._scoring_common import RANDOM_SHAPES

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**RANDOM_SHAPES["llama-1b"]))
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_scale_benchmark_small_configuration(capsys):
    """``benchmarks.scale`` at 2 % of MMLU 5-shot and HellaSwag for 8 and 64 ranks: it runs, and what a rank
    receives for its tokens shrinks as ranks are added while the records stay a few bytes per unit."""
    import dataclasses

    from benchmarks import scale

    assert scale.main(["--fraction", "0.02", "--ranks", "8,64", "--shapes", "mmlu5,hellaswag"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("MMLU", "HellaSwag"))]
    assert len(rows) == 4, out
    small = dataclasses.replace(scale.SHAPES["hellaswag"], docs=1000)
    at8, at64 = scale.simulate(small, 8, 8), scale.simulate(small, 64, 8)
    assert at8["batches"] == at64["batches"] > 64
    assert at64["tokens_mb"] < at8["tokens_mb"]
    assert at64["records_mb"] * 1e6 / at64["units"] < 200  # a fixed-size record and a few prefix hashes per unit
    assert at64["records_mb"] < 1.3 * at8["records_mb"]  # records do not grow with the number of ranks


def test_scale_generate_small_configuration(capsys):
    """``benchmarks.scale --generate`` (was ``scale_generate.py``): rank 0 receives records and the prompts of its
    lanes, far less than the all-gather of every prompt; records stay a few bytes per job and per 16-token block."""
    import dataclasses

    from benchmarks import _scale_generate, scale

    assert scale.main(["--generate", "--fraction", "0.01", "--ranks", "8", "--shapes", "ifeval"]) == 0
    assert "| IFEval | 8 | " in capsys.readouterr().out
    shape = dataclasses.replace(_scale_generate.SHAPES["bbh_cot"], docs=1200)
    row = _scale_generate.simulate(shape, 8)
    assert row["received_mb"] < row["all_gather_mb"] / 2
    assert row["records_mb"] * 1e6 / row["jobs"] < 48 + 40 + 16 + 8 * (800 + 100) / 16 + 64


def test_bench_generate_runs_end_to_end(tiny_model_dir):
    proc = bench(
        "bench_generate",
        "--model",
        tiny_model_dir,
        "--prompts",
        "3",
        "--repeats",
        "1",
        "--instruct-new",
        "6",
        "--task-new",
        "6",
        "--max-length",
        "128",  # the tiny model's positions: distperp refuses a max_length beyond them
        "--batch-size",
        "2",
        "--shapes",
        "instruct,gsm8k",
    )
    out = proc.stdout
    assert "| shape | backend | decode positions per useful token |" in out
    for shape in ("instruct", "gsm8k"):
        assert f"| {shape} (3 prompts" in out and f"\n{shape}: distperp " in out, out
        assert f"| {shape} | distperp | dynamic | " in out, (
            out
        )  # the decode step table: CPU decodes on the dynamic cache


def test_bench_generate_bare_decode_step_times(tiny_model_dir):
    """``bench_generate``'s bare decode-step timing (run with ``--backends ...,distperp-compile``) through the step's
    public faces only, here on the eager fixed-shape step: both medians come back."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.bench_generate import step_times
    from distperp_harness.run.generation.engine.step import StaticStep

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    step = StaticStep(model, torch.device("cpu"), pad_token_id=0)
    eager_ms, static_ms = step_times(
        SimpleNamespace(model=model),
        SimpleNamespace(static_decoding=step, collective=None),
        rows=2,
        context=8,
        steps=2,
        blocks=1,
    )
    assert eager_ms > 0 and static_ms > 0


def test_decode_host_counts_one_read_per_forward(tiny_model_dir):
    """``benchmarks.decode_host`` (the CPU proxy of a GPU's decode loop): both decode step kinds read the device
    once per forward, and their greedy texts agree."""
    proc = bench("decode_host", "--model", tiny_model_dir, "--prompts", "5", "--new", "8", "--repeats", "1")
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith(("| dynamic", "| static"))]
    assert [r[1].strip() for r in rows] == ["dynamic", "static"], proc.stdout
    assert all(r[3].strip() == "1.00" for r in rows) and "texts equal: 5/5" in proc.stdout, proc.stdout


def test_tp_traffic_runs_and_its_tp_formula_matches_the_counts(tiny_model_dir):
    """``benchmarks.tp_traffic`` at N=2, the tensor-parallel launch only (the launch tests hold both layouts'
    counts to their formulas): the table, the exact formula check and the 70B projection."""
    proc = bench(
        "tp_traffic",
        "--model",
        tiny_model_dir,
        "--size",
        "2",
        "--prompts",
        "2",
        "--new",
        "4",
        "--repeats",
        "1",
        "--layouts",
        "tp",
    )
    out = proc.stdout
    assert "| tp_size=2 |" in out and "| 2/2 |" in out, out
    assert "TP received bytes per rank per row" in out and "(1.000x)" in out, out
    assert "Llama-3.1-70B bf16 on 8 GPUs" in out


def test_traffic_counts_the_exchange_of_two_processes(tiny_model_dir, sample_text_path):
    """``benchmarks.traffic`` launches itself on 2 processes (``accelerate launch -m``): each rank's payload bytes
    through distperp's collectives and the loopback total."""
    proc = bench("traffic", "--model", tiny_model_dir, "--text", sample_text_path, "--questions", "4")
    out = proc.stdout
    assert "4 questions x 10 options" in out and "rank 1: received " in out, out
    assert "collective payloads received in all: " in out and "loopback traffic over the run" in out


def test_invariance_check_leaderboard_suite_and_cost(tiny_model_dir, tmp_path, capsys):
    """``invariance_check --suite leaderboard --cost-repeats`` (what ``batch_invariance.py`` measured): lm-eval's
    leaderboard YAMLs on local data with the chat template, invariant rows the same bits at every batch size, and
    the cost table of the option. (The test suite runs in ``gpu_all.sh``'s dry mode.)"""
    from benchmarks import invariance_check

    argv = ["--device", "cpu", "--suite", "leaderboard", "--model", str(tiny_model_dir), "--docs", "1"]
    argv += ["--wikitext-docs", "1", "--max-gen-toks", "4", "--sizes", "1,auto", "--cost-repeats", "1"]
    assert invariance_check.main([*argv, "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| mode | batch_size | leaderboard_mmlu_pro | leaderboard_musr_" in out, out
    assert "| invariant | auto | 1/1 | " in out and "| same bits |" in out and "DIFFER" not in out
    assert "| batch_size=auto, median of 1 | false s | invariant s | invariant / false | tokens computed" in out
    assert "| generation | " in out


def test_gpu_quant_check_cpu_dry(tiny_model_dir, capsys):
    """``benchmarks.gpu_quant_check --device cpu`` on the tiny model: the reference row and an int4 row with its
    agreement figures."""
    from benchmarks import gpu_quant_check

    argv = ["--device", "cpu", "--model", str(tiny_model_dir), "--runs", "none:float32,int4:float32"]
    gpu_quant_check.main([*argv, "--batch", "2", "--seq", "32", "--repeats", "1", "--agree", "1"])
    out = capsys.readouterr().out
    assert "| run | torchao config | storage | weights MB |" in out
    assert "| none:float32 | - | full |" in out and "| int4:float32 | " in out, out


def test_docsplit_cost_dry():
    """``benchmarks.docsplit_cost`` at 48 documents: both builds timed, the split for one rank and the memory."""
    proc = bench("docsplit_cost", "--docs", "48", "--ranks", "8", "--repeats", "1", "--full-repeats", "1", "--split")
    out = proc.stdout
    assert "synthetic MMLU: 48 docs" in out and "1/8 share" in out, out
    assert "docsplit.build_split, one rank of 8" in out and "instances with their documents" in out


def test_lora_example_trains_and_saves_an_adapter(tiny_model_dir, sample_text_path, tmp_path):
    """``benchmarks.lora_example`` for 2 steps on the tiny model: a PEFT adapter folder."""
    import torch

    from benchmarks import lora_example

    threads = torch.get_num_threads()
    try:  # the example trains on one thread
        argv = ["--model", str(tiny_model_dir), "--text", str(sample_text_path), "--out", str(tmp_path / "lora")]
        lora_example.main([*argv, "--steps", "2", "--seq-len", "32", "--batch", "2"])
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "lora" / "adapter_config.json").is_file()
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()


def test_leaderboard_runs_the_whole_group_end_to_end(tiny_model_dir, tmp_path):
    """``benchmarks.leaderboard`` on the tiny model, 1 document per subtask: lm-eval's ``leaderboard`` group (39
    tasks on local data in each family's schema, lm-eval's own YAMLs) through ``hf`` and ``distperp``, chat template
    on, one repeat. Every family reaches the table, both backends aggregate the group, answers agree (or differ at a
    near tie only), and the metrics that need absent packages are named, not faked."""
    import re

    proc = bench(
        "leaderboard",
        "--model",
        tiny_model_dir,
        "--docs",
        "1",
        "--repeats",
        "1",
        "--max-gen-toks",
        "4",
        "--max-length",
        "512",
        "--batch-size",
        "4",
        "--families",
        "gpqa",
        "--work",
        tmp_path / "lb",
    )
    out = proc.stdout
    group = re.findall(r"^\| whole group \| 39 \| (\d+) \| (hf|distperp) \|", out, re.M)
    assert [b for _, b in group] == ["hf", "distperp"] and int(group[0][0]) > 39, out
    same = re.search(r"^\| whole group \|.*\| distperp \|.*\| (\d+)/(\d+) \|$", out, re.M)
    assert same and int(same.group(2)) == 39, out
    for line in re.findall(r"^- (.*): top-2 gap ([0-9.e+-]+) nats$", out, re.M):
        assert float(line[1]) < 1e-3, out  # a differing answer is a near tie, nothing more
    assert "texts differ" not in out, out
    assert "| gpqa | 3 |" in out and "gpqa >= 1.5x hf" in out and "whole group >= 3.0x hf" in out
    for name in ("hf", "distperp"):
        assert re.search(rf"^- {name}: acc,none [0-9.]+, acc_norm,none [0-9.]+", out, re.M), out
        assert re.search(rf"^\| whole group \| {name} \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|", out, re.M), out
    assert "no chat template" in out and "Not computable here" in out and "| gpqa | 1,192 |" in out


def test_request_path_runs_and_batched_ids_equal(tiny_model_dir):
    """``benchmarks.request_path`` (the CPU proxy of the request path): the call runs, and batched tokenization
    gives the ids of one encode per string (else it says DIFFER and exits 1)."""
    proc = bench("request_path", "--model", tiny_model_dir, "--questions", "3", "--repeats", "1")
    assert "| outside batches, ms per request |" in proc.stdout and "batched equal to one by one" in proc.stdout


def test_bench_families_dry(sample_text_path, tmp_path):
    """``benchmarks.bench_families --dry``: every family's tiny shape (Gemma 3 windows, Qwen 3, Granite's logit
    scaling, gpt-oss sinks and experts) through ``hf`` and ``distperp`` sharing one model, on the three workloads:
    the probe grants each the fast path, answers agree with ``hf``'s, and the tables come out."""
    import re

    proc = bench(
        "bench_families",
        "--dry",
        "--text",
        sample_text_path,
        "--mc-text",
        sample_text_path,
        "--workdir",
        tmp_path,
    )
    out = proc.stdout
    assert "| family | published shape | probe decision | MMLU-Pro 5-shot vs hf |" in out, out
    for family, attention in (("gemma3-270m", "sdpa"), ("qwen3-0.6b", "sdpa"), ("granite-3-2b", "sdpa")):
        assert re.search(rf"^\| {family} \([0-9.]+M, {attention}\) \| tiny-", out, re.M), out
    assert re.search(r"^\| gpt-oss-scaled \([0-9.]+M, eager\) \| tiny-gpt-oss \|", out, re.M), out
    assert out.count("| probed: packed rows") == 4 and "window 16" in out and "{'divide': 8.0}" in out, out
    assert out.count("answers equal") == 4 and "DIFFER" not in out, out
    assert "| family | mmlupro5 ≥ 3× | rolling ≥ 1× | generate ≥ 1× |" in out, out


def test_tokenize_families_runs_and_ids_equal():
    """``benchmarks.tokenize_families`` at dry size: the five family layouts (GPT-2, Llama 3, Qwen2 with NFC, Gemma's
    ``Replace`` without a pre-tokenizer, Metaspace) on its three workloads (one fixed few-shot block, MMLU 5-shot in
    lm-eval's default sampler's random order, a 300-example pool) and Gemma's added-token case, with every string's
    ids equal to its whole encode (else it says which and exits 1); no layout is refused, every row groups."""
    proc = bench("tokenize_families", "--questions", "12", "--vocab", "400", "--repeats", "1", "--model", "none")
    assert "equal to whole encodes everywhere" in proc.stdout and proc.stdout.count("| yes |") == 15, proc.stdout
    assert "whole:" not in proc.stdout and "| 0 / 0 / 0 |" not in proc.stdout, proc.stdout
    assert "| find the cut of the prefix |" in proc.stdout and "ids equal: yes" in proc.stdout, proc.stdout


def test_bench_series_dry(tiny_model_dir):
    """``benchmarks.bench_series`` at dry size (one stage: the series launch and one ``lm_eval`` run): its table and
    the fingerprint check."""
    proc = bench(
        "bench_series", "--model", tiny_model_dir, "--checkpoints", "1", "--limit", "2", "--max-length", "128",
        timeout=300,
    )  # fmt: skip
    assert "| series of 1 | 1 |" in proc.stdout and "| lm_eval step_1000 | 1 |" in proc.stdout
    assert "fingerprints equal: step_1000 yes" in proc.stdout


def test_bench_cp_runs_a_group_on_the_tiny_shape():
    proc = bench("bench_cp", "--shape", "tiny", "--tokens", "128", "--sizes", "2", "--repeats", "1", "--no-memory")
    assert "| cp_size | seconds |" in proc.stdout and "| 2 | " in proc.stdout, proc.stdout


def test_bench_cp_generate_runs_a_group_on_the_tiny_shape():
    proc = bench("bench_cp_generate", "--shape", "tiny", "--tokens", "256", "--new", "3", "--sizes", "1,2")
    assert "| cp_size | prefill s |" in proc.stdout and "| 2 | " in proc.stdout, proc.stdout
    assert "DIFFER" not in proc.stdout and proc.stdout.count("| same |") == 2, proc.stdout


def test_miniatures_matrix_rows():
    """``benchmarks.miniatures --types ...``: a built row (layers, parameters, timings, how far a masked key and a
    moved position move a score), a skipped row with its reason, and the counts."""
    proc = bench("miniatures", "--types", "llama,gpt_neo,musicgen,deepseek_v3", "--tokens", "120")
    out = proc.stdout
    assert "4 types: 3 built, 1 skipped, 0 failed" in out, out
    assert "| llama | LlamaForCausalLM | sdpa | built | 1 |" in out, out
    assert "| gpt_neo | GPTNeoForCausalLM | eager | built | 2 |" in out, out
    assert "| deepseek_v3 | DeepseekV3ForCausalLM | sdpa | built | 4 |" in out, out
    assert "| musicgen |" in out and "audio codebooks" in out, out
    assert "build + forward seconds over 3 built types" in out, out


def test_probe_cost_times_a_fresh_process_per_run(tiny_model_dir):
    """benchmarks/probe_cost.py on a random shape and on a local folder: one line per run and a median."""
    for runs, where in ((2, ["--shape", "tiny"]), (1, ["--model", str(tiny_model_dir)])):
        lines = bench("probe_cost", "--runs", str(runs), *where).stdout.strip().splitlines()
        assert len([x for x in lines if x.startswith("probe ")]) == runs and "median" in lines[-1], lines
