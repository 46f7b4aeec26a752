"""resume_dir: finished batches saved atomically, reused after a crash with a different number of processes."""

import numpy as np

from distperp_harness.requests import Unit
from distperp_harness.resume import BatchStore
from distperp_harness.rows import build_rows, unit_rows
from distperp_harness.scoring import BatchScores
from helpers import accelerate_launch_prefix, load_results, load_samples, run_command

UNITS = unit_rows([Unit((1, 2, 3, 4), 3), Unit((5, 6), 1)])


def test_roundtrip_and_keying(tmp_path):
    store = BatchStore(tmp_path, {"model": "a"})
    assert store.load(UNITS) is None
    scores = BatchScores(np.arange(10, dtype=np.float64).reshape(2, 5) / 3, [np.array([0.1, 0.2, 0.3]), np.array([1e-9])])
    store.save(UNITS, scores)
    back = store.load(UNITS)
    assert np.array_equal(back.stats, scores.stats) and all(np.array_equal(a, b) for a, b in zip(back.kl, scores.kl))
    assert back.stats.dtype == np.float64 and store.hits == 1
    assert BatchStore(tmp_path, {"model": "b"}).load(UNITS) is None  # another configuration: no reuse
    assert BatchStore(tmp_path, {"model": "a"}).load(UNITS[:1]) is None  # another batch: no reuse
    shared = build_rows([Unit((1, 2, 3, 4), 1), Unit((1, 2, 3, 5), 1)], "prefix")  # one row, two units
    store.save(shared, scores)
    assert store.load(shared) is not None
    assert store.load(unit_rows(shared[0].units)) is None  # the same units on their own rows: no reuse
    assert not list(tmp_path.glob(".tmp-*"))  # atomic writes leave no partial files


def test_corrupt_file_is_recomputed(tmp_path):
    store = BatchStore(tmp_path, {})
    store.save(UNITS, BatchScores(np.zeros((2, 5)), None))
    for path in tmp_path.glob("batch-*.npz"):
        path.write_bytes(b"garbage")
    assert store.load(UNITS) is None


def _run(model_dir, tasks_dir, out, processes, extra_args="", env=None, check=True):
    args = ["-m", "lm_eval", "--model", "distperp",
            "--model_args", f"pretrained={model_dir},max_length=32{extra_args}",
            "--tasks", "dptest_rolling", "--include_path", str(tasks_dir), "--batch_size", "2",
            "--log_samples", "--output_path", str(out)]
    return run_command([*accelerate_launch_prefix(processes), *args], cwd=out.parent, env=env, check=check)


def test_crash_then_resume_with_another_world_size(tiny_model_dir, tasks_dir, tmp_path):
    resume = tmp_path / "resume"
    crashed = _run(tiny_model_dir, tasks_dir, tmp_path / "crashed", 2, f",resume_dir={resume}",
                   env={"DISTPERP_TEST_CRASH": "1:3"}, check=False)
    assert crashed.returncode != 0
    assert not list((tmp_path / "crashed").rglob("results_*.json"))
    done_before = len(list(resume.glob("batch-*.npz")))
    assert done_before >= 3

    _run(tiny_model_dir, tasks_dir, tmp_path / "resumed", 1, f",resume_dir={resume}")
    _run(tiny_model_dir, tasks_dir, tmp_path / "clean", 1)
    resumed, clean = load_results(tmp_path / "resumed"), load_results(tmp_path / "clean")
    calls = resumed["config"]["distperp"]["calls"]
    assert calls[-1]["resumed_batches"] >= 3
    assert resumed["config"]["distperp"]["fingerprint"] == clean["config"]["distperp"]["fingerprint"]
    assert [r["resps"] for r in load_samples(tmp_path / "resumed", "dptest_rolling")] == \
           [r["resps"] for r in load_samples(tmp_path / "clean", "dptest_rolling")]
