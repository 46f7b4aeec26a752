"""``distperp check``: the whole self-check on CPU (in-process runs and a real 2-process launch), and each check's
failure path."""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from pathlib import Path

import pytest
from helpers import REPO_ROOT, run_command

from distperp_harness.commands import check
from distperp_harness.commands.check import CheckRow, Evaluation, Outcome


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
        *[(run, c) for run in ("bfloat16", "int4") for c in ("load", "scores", "same bits twice", "memory released")],
        ("1 vs 2 processes", "same bits"),
    ]
    assert {r["outcome"] for r in rows} == {"pass"}, rows
    assert "3 documents" in rows[1]["detail"] and "3 documents" in rows[-1]["detail"]
    int4_load = rows[4]["detail"]
    assert "of 15 Linear layers quantized" in int4_load and " 0 of" not in int4_load
    assert "OK: 9 passed, 0 failed, 0 skipped" in proc.stdout


def _namespace(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()])


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


def test_a_model_still_referenced_is_not_released() -> None:
    class Model:
        pass

    held = Model()
    kept = check.released(weakref.ref(held), None)
    assert not kept.ok and "still referenced" in kept.detail
    gone = Model()
    ref = weakref.ref(gone)
    del gone
    assert check.released(ref, None) == check.Release(collected=True, left_bytes=None)
    assert check.Release(collected=True, left_bytes=None).ok
    assert not check.Release(collected=True, left_bytes=check.RELEASE_SLACK + 1).ok


def test_a_model_that_does_not_load_fails_its_row_and_the_exit_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows, first = check.run_in_process("bfloat16", {"pretrained": str(tmp_path / "missing")}, None, None, None)
    assert first is None and [r.outcome for r in rows] == [Outcome.FAIL] and rows[0].check == "load"
    failing = [CheckRow("bfloat16", "load", Outcome.FAIL, "no")]
    monkeypatch.setattr(check, "run_in_process", lambda *a: (failing, None))
    monkeypatch.setattr(check, "cached_model", lambda: str(tmp_path))
    assert check.run_check(_namespace(device="cpu")) == 1
    assert "FAILED: 0 passed, 2 failed, 1 skipped" in capsys.readouterr().out


def test_devices_other_than_cpu_and_cuda_are_refused() -> None:
    with pytest.raises(ValueError, match="--device 'tpu'"):
        check.device_for("tpu")
