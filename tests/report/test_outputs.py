"""report/outputs.py: --output_path checked before the run (one line, exit 1), and results never lost at the end
(a fallback file, named, and a non-zero exit)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import FullDisk, run_command

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


def _real_tracker(output_path):
    """lm-eval's own EvaluationTracker, wrapped by distperp's start-up hook (as in every lm-eval run)."""
    from lm_eval.loggers import evaluation_tracker

    from distperp_harness._hook import guard_outputs

    guard_outputs(evaluation_tracker)
    tracker = evaluation_tracker.EvaluationTracker(output_path=str(output_path))
    tracker.general_config_tracker.model_name_sanitized = "model"
    return tracker


def _big_results():
    return {"results": {f"task{i}": {"acc,none": i / 100, "note": "x" * 100} for i in range(200)}}  # ~30 KB


def _leftovers(folder):
    return sorted(p.name for p in folder.rglob("*") if p.is_file())


def _assert_fell_back(info, tracker, tmp_path, out, results):
    fallback = tmp_path / f"results_{tracker.date_id}.json"
    message = str(info.value)
    assert f"they are in {fallback} instead" in message and "No space left on device" in message, message
    saved = json.loads(fallback.read_text())  # whole: lm-eval's additions (config, task hashes) included
    assert saved["results"] == results["results"] and "task_hashes" in saved and "model_name" in saved
    assert _leftovers(out) == [], "nothing partial (results file or temporary file) is left in the results folder"


def test_results_cut_short_by_a_full_disk_fall_back_whole_and_leave_nothing_partial(tmp_path, monkeypatch):
    """The issue's case through lm-eval's real tracker: 8 KiB free, ~30 KB of results. lm-eval alone leaves an
    8,192-byte invalid results_*.json and returns; distperp leaves nothing there and names the fallback."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    tracker = _real_tracker(out)
    results = _big_results()
    FullDisk(out, free=8192).install(monkeypatch)
    with pytest.raises(InputError, match="could not write the results there") as info:
        tracker.save_results_aggregated(results=results, samples=None)
    _assert_fell_back(info, tracker, tmp_path, out, results)


def test_a_results_file_that_does_not_parse_is_removed_and_the_results_fall_back(tmp_path, monkeypatch):
    """A write the routing does not see (lm-eval writing another way) is caught afterwards by parsing."""
    monkeypatch.chdir(tmp_path)
    results = {"results": {"task": {"acc,none": 0.5}}}

    def cut_short(tracker, results):
        out = tmp_path / "out" / "model"
        out.mkdir(parents=True, exist_ok=True)
        os.write(fd := os.open(out / "results_x.json", os.O_CREAT | os.O_WRONLY), json.dumps(results)[:9].encode())
        os.close(fd)

    with pytest.raises(InputError, match=r"results_x.json was cut short or damaged \(JSONDecodeError") as info:
        save_or_fall_back(cut_short, _Tracker(str(tmp_path / "out")), results)
    assert json.loads((tmp_path / "results_2026-12-04T00-00-00.json").read_text()) == results
    assert _leftovers(tmp_path / "out") == [] and "they are in" in str(info.value)


def test_samples_cut_short_leave_nothing_partial_and_name_the_results_file(tmp_path, monkeypatch):
    out = tmp_path / "out"
    tracker = _real_tracker(out)
    tracker.save_results_aggregated(results={"results": {"t": {"acc,none": 1.0}}}, samples=None)
    (results_file,) = (out / "model").glob("results_*.json")
    sample = {"arguments": [("ctx", "cont")], "resps": [], "filtered_resps": [], "target": 1, "doc": {}}
    FullDisk(out, free=100).install(monkeypatch)
    with pytest.raises(InputError, match="could not write the samples of task 't' there") as info:
        tracker.save_results_samples(task_name="t", samples=[dict(sample, doc={"text": "y" * 500})])
    assert f"the results are in {results_file}" in str(info.value) and "No space left" in str(info.value)
    assert _leftovers(out) == [results_file.name]
    json.loads(results_file.read_text())


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 KiB tmpfs (needs root and the right to mount); skipped where it cannot be mounted."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the in-process full-disk tests cover this case")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_results_on_a_real_full_tmpfs_fall_back_whole(small_tmpfs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    free = os.statvfs(small_tmpfs)
    (small_tmpfs / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 8192))
    out = small_tmpfs / "out"
    tracker = _real_tracker(out)
    results = _big_results()
    with pytest.raises(InputError, match="could not write the results there") as info:
        tracker.save_results_aggregated(results=results, samples=None)
    _assert_fell_back(info, tracker, tmp_path, out, results)


def test_the_cli_refuses_an_unwritable_output_path_before_loading(tiny_model_dir, tasks_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    args = ["--model", "distperp", "--model_args", f"pretrained={tiny_model_dir}", "--tasks", "dptest_rolling"]
    args += ["--include_path", str(tasks_dir), "--output_path", str(blocker / "results")]
    proc = run_command([sys.executable, "-m", "lm_eval", *args], cwd=tmp_path, check=False, timeout=180)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("distperp: error")]
    assert proc.returncode == 1 and len(lines) == 1 and "--output_path" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "loglikelihood_rolling" not in proc.stderr + proc.stdout
