"""report/outputs.py: --output_path checked before the run (one line, exit 1), and results never lost at the end
(a fallback file, named, and a non-zero exit)."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import run_command

from distperp_harness.errors import InputError
from distperp_harness.report.outputs import check_writable, results_folder, save_or_fall_back


class _Tracker:
    def __init__(self, output_path):
        self.output_path, self.date_id = output_path, "2026-12-04T00-00-00"


def test_the_results_folder_of_an_output_path(tmp_path):
    assert results_folder(str(tmp_path / "out")) == tmp_path / "out"
    assert results_folder(str(tmp_path / "out" / "r.json")) == tmp_path / "out"


def test_an_output_path_that_cannot_be_written_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(InputError, match="could not be written there") as info:
        check_writable(str(blocker / "results"))
    assert info.value.same_on_every_rank and "before loading the model" in str(info.value)
    check_writable(str(tmp_path / "new" / "folder"))  # created, and nothing else left in it
    assert list((tmp_path / "new" / "folder").iterdir()) == []
    check_writable(None)


def test_results_lm_eval_failed_to_write_go_to_a_fallback_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = {"results": {"task": {"acc,none": 0.5}}}

    def lost(tracker, results):  # lm-eval's save: it logs a warning when writing fails, and returns
        pass

    with pytest.raises(InputError, match="could not write the results there") as info:
        save_or_fall_back(lost, _Tracker(str(tmp_path / "out")), results)
    fallback = tmp_path / "results_2026-12-04T00-00-00.json"
    assert str(fallback) in str(info.value) and json.loads(fallback.read_text()) == results

    def saved(tracker, results):
        out = tmp_path / "out" / "model"
        out.mkdir(parents=True, exist_ok=True)
        (out / "results_x.json").write_text(json.dumps(results))

    save_or_fall_back(saved, _Tracker(str(tmp_path / "out")), results)  # written: nothing more to do


def test_the_cli_refuses_an_unwritable_output_path_before_loading(tiny_model_dir, tasks_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    args = ["--model", "distperp", "--model_args", f"pretrained={tiny_model_dir}", "--tasks", "dptest_rolling"]
    args += ["--include_path", str(tasks_dir), "--output_path", str(blocker / "results")]
    proc = run_command([sys.executable, "-m", "lm_eval", *args], cwd=tmp_path, check=False, timeout=180)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("distperp: error")]
    assert proc.returncode == 1 and len(lines) == 1 and "--output_path" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "loglikelihood_rolling" not in proc.stderr + proc.stdout
