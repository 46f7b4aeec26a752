"""``distperp check``: the whole self-check on CPU (in-process runs and a real 2-process launch), and each check's
failure path."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO_ROOT, run_command

from distperp_harness.commands import check
from distperp_harness.commands.check import CheckRow, Evaluation, Outcome
from distperp_harness.errors import InputError

CHECKS = ("load", "scores", "same bits twice", "rows attend alone", "memory released")


def test_check_passes_on_cpu_with_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = run_command(
        [sys.executable, "-m", "distperp_harness", "check", "--device", "cpu", "--limit", "3", "--json", out],
        cwd=REPO_ROOT,
        env={"DISTPERP_CACHE": str(tmp_path / "cache")},
        timeout=600,
    )
    rows = json.loads(out.read_text())
    assert [(r["run"], r["check"]) for r in rows] == [
        *[(run, c) for run in ("bfloat16", "int4") for c in CHECKS],
        ("1 vs 2 processes", "same bits"),
    ]
    assert {r["outcome"] for r in rows} == {"pass"}, rows
    assert "3 documents" in rows[1]["detail"] and "3 documents" in rows[-1]["detail"]
    int4_load = rows[len(CHECKS)]["detail"]
    assert "of 15 Linear layers quantized" in int4_load and " 0 of" not in int4_load
    assert "OK: 11 passed, 0 failed, 0 skipped" in proc.stdout


def test_failures_on_rank_0_and_on_rank_1_are_failed_rows_not_a_hang(tmp_path: Path) -> None:
    """Real faults: rank 0 (this process) fails the int4 run's first scoring call; rank 1 of the launched run fails
    at its first forward. Both become failed rows naming the error, the int4 model is still released, and the
    command exits 3 (it ran to its end; a check failed) within its timeout."""
    out = tmp_path / "rows.json"
    proc = run_command(
        # 4 documents are two batches of batch_size=auto, one per process, and claim=false keeps each on its own
        # process: rank 1's injected failure always happens (with one batch, it happened only when rank 1 claimed
        # rank 0's batch first, a race a loaded machine loses)
        [
            *[sys.executable, "-m", "distperp_harness", "check", "--device", "cpu", "--limit", "4", "--json", out],
            *["--model_args", "claim=false"],
        ],
        cwd=REPO_ROOT,
        env={
            "DISTPERP_CACHE": str(tmp_path / "cache"),
            "DISTPERP_TEST_FAIL_PLANNING": "0:3",  # calls 1 and 2 are the bfloat16 run's two evaluations
            "DISTPERP_TEST_FAIL": "1:1",  # only the launched run has a rank 1
        },
        timeout=300,
        check=False,
    )
    assert proc.returncode == 3, proc.stdout[-3000:]
    rows = {(r["run"], r["check"]): r for r in json.loads(out.read_text())}
    assert {k: r["outcome"] for k, r in rows.items() if r["run"] == "bfloat16"} == dict.fromkeys(
        [("bfloat16", c) for c in CHECKS], "pass"
    )
    assert rows[("int4", "scores")]["outcome"] == "FAIL"
    assert "injected failure for tests (DISTPERP_TEST_FAIL_PLANNING=0:3)" in rows[("int4", "scores")]["detail"]
    assert rows[("int4", "same bits twice")]["outcome"] == "skipped"
    assert rows[("int4", "memory released")]["outcome"] == "pass"
    launch = rows[("1 vs 2 processes", "same bits")]
    assert launch["outcome"] == "FAIL" and "distperp: rank 1 (" in launch["detail"], launch
    assert "failed while scoring" in launch["detail"] and "\n" not in launch["detail"]


def _namespace(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    return parser.parse_args([f"--{k}={v}" for k, v in overrides.items()])


def _evaluation(bits: dict[int, str], fingerprint: str = "f") -> Evaluation:
    return Evaluation(per_doc=bits, fingerprint=fingerprint, token_perplexity=1.0, tokens_per_s=1.0)


def test_a_launched_run_with_other_bits_fails_the_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    one = _evaluation({0: (-1.5).hex(), 1: (-2.5).hex()})
    monkeypatch.setattr(check, "launched", lambda *a: _evaluation({0: (-1.5).hex(), 1: (-2.4).hex()}))
    row = check.processes_row(_namespace(work=tmp_path), "cpu", {}, {}, one)
    assert row.outcome is Outcome.FAIL
    monkeypatch.setattr(check, "launched", lambda *a: _evaluation(dict(one.per_doc), "other"))
    assert check.processes_row(_namespace(work=tmp_path), "cpu", {}, {}, one).outcome is Outcome.FAIL
    monkeypatch.setattr(check, "launched", lambda *a: _evaluation(dict(one.per_doc)))
    assert check.processes_row(_namespace(work=tmp_path), "cpu", {}, {}, one).outcome is Outcome.PASS


def test_a_failed_launch_is_a_failed_check_with_its_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def boom(*args):
        raise RuntimeError("exit 1: rank 1 died")

    monkeypatch.setattr(check, "launched", boom)
    row = check.processes_row(_namespace(work=tmp_path), "cpu", {}, {}, _evaluation({0: "0x1p+0"}))
    assert row.outcome is Outcome.FAIL and "rank 1 died" in row.detail


def test_one_process_or_no_scores_skip_the_launch() -> None:
    one = _evaluation({0: "0x1p+0"})
    assert check.processes_row(_namespace(processes=1), "cpu", {}, {}, one).outcome is Outcome.SKIP
    assert check.processes_row(_namespace(), "cpu", {}, {}, None).outcome is Outcome.SKIP


def test_a_model_that_does_not_load_fails_its_row_and_the_exit_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows, first = check.run_in_process("bfloat16", {"pretrained": str(tmp_path / "missing")}, None, None, None)
    assert first is None and [r.outcome for r in rows] == [Outcome.FAIL] and rows[0].check == "load"
    failing = [CheckRow("bfloat16", "load", Outcome.FAIL, "no")]
    monkeypatch.setattr(check, "run_in_process", lambda *a: (failing, None))
    monkeypatch.setattr(check, "cached_model", lambda: str(tmp_path))
    assert check.run_check(_namespace(device="cpu")) == 3  # ran to its end, a check failed
    assert "FAILED: 0 passed, 2 failed, 1 skipped" in capsys.readouterr().out


def test_devices_other_than_cpu_and_cuda_are_refused() -> None:
    for device in ("tpu", "cpu:0", "cuda:x"):
        with pytest.raises(InputError, match=f"--device '{device}'"):
            check.device_for(device)
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="torch sees 0 CUDA device"):
            check.device_for("cuda:0")
    assert check.device_for("cpu") == "cpu"


def test_model_args_add_to_the_runs_but_cannot_replace_what_the_check_sets() -> None:
    base = check.model_args_for(_namespace(model_args="group_size=64,trust_remote_code=True"), "m", "cpu")
    assert base == {
        "pretrained": "m", "device": "cpu", "dtype": "bfloat16", "batch_size": "auto",
        "group_size": 64, "trust_remote_code": True,
    }  # fmt: skip
    assert check.model_args_for(_namespace(max_length=64), "m", "cpu")["max_length"] == 64
    with pytest.raises(InputError, match=r"sets dtype, quantize.*dtype \(use --dtype\)"):
        check.model_args_for(_namespace(model_args="quantize=int8,dtype=float16"), "m", "cpu")


def test_processes_below_one_are_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        _namespace(processes=0)


class _Report:
    def __init__(self, quantized: list[str], skipped: dict[str, str], config_name: str | None = "Int4") -> None:
        self.quantized, self.skipped, self.config_name = quantized, skipped, config_name


def test_a_quantized_run_that_quantized_nothing_fails_its_load() -> None:
    assert check.load_row("bfloat16", "1 s", None, quantized_run=False).outcome is Outcome.PASS
    row = check.load_row("int4", "1 s", _Report(["a", "b"], {"lm_head": "output embedding kept"}), quantized_run=True)
    assert row.outcome is Outcome.PASS and "2 of 3 Linear layers quantized (kept: output embedding kept)" in row.detail
    for report in (None, _Report([], {"a": "in_features=576 is not divisible"}), _Report(["a"], {}, None)):
        assert check.load_row("int4", "1 s", report, quantized_run=True).outcome is Outcome.FAIL


def test_scores_must_be_finite_and_the_same_bits_twice() -> None:
    first = _evaluation({0: (-1.5).hex(), 1: (-2.5).hex()})
    assert [r.outcome for r in check.score_rows("bf16", first, first)] == [Outcome.PASS, Outcome.PASS]
    moved = check.score_rows("bf16", first, _evaluation({0: (-1.5).hex(), 1: (-2.500001).hex()}))
    assert [r.outcome for r in moved] == [Outcome.PASS, Outcome.FAIL] and "1 of 2 documents differ" in moved[1].detail
    nan = _evaluation({0: float("nan").hex()})
    assert check.score_rows("bf16", nan, nan)[0].outcome is Outcome.FAIL
    assert check.score_rows("bf16", _evaluation({}), _evaluation({}))[0].outcome is Outcome.FAIL


def test_a_launch_that_writes_no_results_says_so_on_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(check.subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=0, stderr="", stdout=""))
    row = check.processes_row(_namespace(work=tmp_path), "cpu", {}, {}, _evaluation({0: "0x1p+0"}))
    assert row.outcome is Outcome.FAIL and "no results_*.json under" in row.detail
    failing = SimpleNamespace(returncode=1, stderr="Traceback\nline two\nValueError: bad", stdout="")
    monkeypatch.setattr(check.subprocess, "run", lambda *a, **k: failing)
    row = check.processes_row(_namespace(work=tmp_path), "cpu", {}, {}, _evaluation({0: "0x1p+0"}))
    assert "exit 1" in row.detail and "\n" not in row.detail and "ValueError: bad" in row.detail


def test_the_load_row_names_the_dtype_the_model_ran_in() -> None:
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        lm = SimpleNamespace(model=torch.nn.Linear(2, 2, dtype=dtype), weight_bytes=3 * 2**20, device="cpu")
        assert check.load_detail(1.25, lm) == f"1.2 s, 3.0 MiB of weights on cpu, dtype {name}"
    help_text = argparse.ArgumentParser()
    check.add_arguments(help_text)
    assert "unquantized" not in help_text.format_help()
