"""``benchmarks/gpu_all.sh``, the one command a GPU owner runs, in its CPU dry mode."""

import json
import sys

from helpers import REPO_ROOT, run_command

ONLY = "gpu_check,shard_check,shard_check_one,cli"


def test_gpu_all_dry_mode_on_cpu(tmp_path):
    """The one command a GPU owner runs, in its CPU dry mode (each prepared check once, so it cannot rot before a
    GPU is at hand): one table file, every check passed, and each step's own JSON rows:

    * gpu_check on 2 processes: same bits twice and on 1 vs 2 processes, the auto budget stable, the tree-row case;
    * shard_check on 2 CPU processes: sharded weights give the unsharded fingerprint with at most 0.6 of the bytes;
    * shard_check_one (the one-GPU mode): FSDP2 on a mesh of one gives the unsharded fingerprint, and the torchao
      weights stay outside FSDP;
    * cli: the lm_eval CLI, hf vs distperp, MMLU-Pro (the same answers), rolling and the int4 rows.

    The steps bench_mc, bench_scoring and invariance run their modules end to end in tests/test_benchmarks.py
    on the test model, so this launch leaves them out (--only): 41 s of the suite."""

    out, work = tmp_path / "gpu_all.md", tmp_path / "work"
    proc = run_command(
        ["bash", REPO_ROOT / "benchmarks" / "gpu_all.sh", "--device", "cpu", "--out", out, "--only", ONLY],
        cwd=tmp_path,  # the script runs its steps from the repository root whatever the caller's folder
        timeout=900,
        env={"PYTHON": sys.executable, "DISTPERP_GPU_ALL_WORK": str(work)},
    )
    text = out.read_text()
    assert "## gpu_check" in text and "## shard_check" in text and "FAILED" not in text, proc.stdout[-3000:]
    assert text.count("passed") == 4  # gpu_check, shard_check, shard_check_one, cli
    assert "| int4 |" in text and "| 14/14 |" in text  # the dry-run model quantizes every decoder Linear
    assert "| int4 | 1 (mesh of one) |" in text and "fingerprints equal to the unsharded run" in text
    assert "DIFFER" not in text and "total: " in text
    assert "1 vs 2 processes: identical fingerprints" in text and "| sdpa | 4 |" in text
    assert "## cli" in text and "| MMLU-Pro 5-shot, 4 questions | distperp |" in text and "4/4 answers equal" in text
    cli = {w["work"].split(",")[0] + str(i): w for i, w in enumerate(json.loads((work / "cli.json").read_text()))}
    assert [r["name"] for r in cli["rolling2"]["rows"]] == ["distperp", "distperp int4", "distperp int4 kernel"]
    assert all(r["request_phase"] > 0 for r in cli["rolling2"]["rows"])  # from distperp's call records
    report = json.loads((work / "gpu_check.json").read_text())
    assert all(r["same_bits"] and r["budget"] == r["budget_again"] for r in report["rows"])
    assert [t["impl"] for t in report["tree"]] == ["sdpa"] and report["tree"][0]["per_question"] > 0
    whole, sharded = json.loads((work / "shard_check.json").read_text())["rows"]
    assert (whole["shard_size"], sharded["shard_size"]) == (1, 2)
    assert sharded["same"] == "equal" and sharded["fingerprint"] == whole["fingerprint"]
    assert sharded["ratio"] <= 0.6 and sharded["replicated"] > 0
    whole, mesh = json.loads((work / "shard_check_one.json").read_text())["rows"]
    assert (whole["mesh_of_one"], whole["fsdp"]) == (False, False)
    assert (mesh["mesh_of_one"], mesh["fsdp"]) == (True, True)
    assert mesh["same"] == "equal" and mesh["fingerprint"] == whole["fingerprint"]
    assert mesh["replicated"] == 14  # every quantized Linear of the dry-run model stays outside FSDP
    assert mesh["estimate_total"] > whole["estimate_total"]  # the units FSDP copies on a mesh of one are counted
