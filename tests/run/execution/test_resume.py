"""resume_dir: saved batches reused bit for bit; damaged files recomputed; a full disk and preemption survived.

Store-level tests check each kind of damage and the save-failure rule on :class:`BatchStore` directly (fast). The
run-level tests score the same texts with and without ``resume_dir`` (in-process, and through ``accelerate
launch`` with 1 and 2 processes) and require identical bits from every damaged, full or interrupted folder.
"""

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
from helpers import (
    TASKS_DIR,
    accelerate_launch_prefix,
    load_results,
    load_samples,
    make_lm,
    offline_env,
    run_command,
    score_rolling,
)

from distperp_harness.errors import InputError
from distperp_harness.planning.requests import Unit
from distperp_harness.planning.rows import build_rows, unit_rows
from distperp_harness.run.execution.resume import BatchStore
from distperp_harness.run.scoring.engine.forward import GREEDY, LL, N_TOKENS, TOP1, BatchScores

UNITS = unit_rows([Unit((1, 2, 3, 4), 3), Unit((5, 6), 1)])  # two one-unit rows
GOOD = BatchScores(
    np.array([[-3.5, 0.0, 3, -3.25, 2], [-0.5, 1.0, 1, -0.75, 1]]), [np.array([0.1, 0.2, 0.3]), np.array([1e-9])]
)
ARGS = ",max_length=32,batch_size=2"
TEXTS = [
    json.loads(line)["text"] for line in (TASKS_DIR / "dptest_rolling.jsonl").read_text().splitlines() if line.strip()
]


@pytest.fixture
def resume_log():
    """Messages the resume store logs (they are rank 0's warnings)."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("distperp_harness.run.execution.resume")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.fixture
def run_log():
    """Messages of the in-process model's logger (rank 0's call summaries and the resume line)."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("distperp_harness.lm")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # the rest of the suite may have left the package's logger at WARNING
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def _same(a: BatchScores, b: BatchScores) -> bool:
    return a.stats.tobytes() == b.stats.tobytes() and all(x.tobytes() == y.tobytes() for x, y in zip(a.kl, b.kl))


def test_roundtrip_and_keying(tmp_path):
    store = BatchStore(tmp_path, {"model": "a"}, with_kl=True)
    assert store.load(UNITS) is None
    store.save(UNITS, GOOD)
    back = store.load(UNITS)
    assert _same(back, GOOD) and back.stats.dtype == np.float64
    assert store.counts == {"reused": 1, "saved": 1, "recomputed_corrupt": 0, "save_failures": 0}
    assert BatchStore(tmp_path, {"model": "b"}, with_kl=True).load(UNITS) is None  # another configuration
    assert BatchStore(tmp_path, {"model": "a"}, with_kl=True).load(UNITS[:1]) is None  # another batch
    shared = build_rows([Unit((1, 2, 3, 4), 1), Unit((1, 2, 3, 5), 1)], "prefix")  # one row, two units
    two = BatchScores(np.array([[-1.0, 0.0, 1, -1.5, 1], [-2.0, 1.0, 1, -2.5, 0]]), [np.array([0.1]), np.array([0.2])])
    store.save(shared, two)
    assert _same(store.load(shared), two)
    assert store.load(unit_rows(shared[0].units)) is None  # the same units on their own rows: no reuse
    assert not list(tmp_path.glob(".tmp-*"))  # atomic writes leave no partial files


# ------------------------------------------------------------------------------------ kinds of damage
def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path):
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes())


def _flip_a_byte(path):
    """Flip the last data byte of ``stats.npy`` inside the zip: its CRC no longer matches (``BadZipFile``)."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("stats.npy")
    raw = bytearray(path.read_bytes())
    name_len, extra_len = (
        int.from_bytes(raw[info.header_offset + o : info.header_offset + o + 2], "little") for o in (26, 28)
    )
    raw[info.header_offset + 30 + name_len + extra_len + info.compress_size - 1] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(zipfile.BadZipFile, match="CRC"), np.load(path) as data:
        data["stats"]  # the damage is the kind named


def _rewrite(path, **changes):
    """Rewrite the file's arrays with ``changes`` (a function of the old array each), keeping its checksum."""
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    np.savez(path, **{name: changes.get(name, lambda a: a)(array) for name, array in arrays.items()})


def _wrong_numbers(path):
    """A readable, plausible file whose numbers changed after saving: only the sha256 can tell."""

    def lower(stats):
        stats = stats.copy()
        stats[0, LL] -= 1.0
        return stats

    _rewrite(path, stats=lower)


def _other_batch(path):
    """Another batch's intact file (same shapes) under this batch's name: a copy or rename gone wrong."""
    other = path.parent / "other"
    BatchStore(other, {}, with_kl=True).save([Unit((9, 8, 7, 6), 3), Unit((4, 3), 1)], GOOD)
    [other_file] = other.glob("batch-*.npz")
    shutil.copyfile(other_file, path)


def _npy_not_npz(path):
    np.save(path.with_suffix(".npy"), np.zeros(3))
    path.with_suffix(".npy").rename(path)


def _pickled(path):
    _rewrite(path, stats=lambda s: np.array(list(s), dtype=object))


def _float32(path):
    _rewrite(path, stats=lambda s: s.astype(np.float32))


STORE_DAMAGE = [_truncate, _garbage, _flip_a_byte, _wrong_numbers, _other_batch, _npy_not_npz, _pickled, _float32]


@pytest.mark.parametrize("damage", STORE_DAMAGE, ids=lambda f: f.__name__.strip("_"))
def test_damaged_file_is_recomputed_and_overwritten(tmp_path, damage):
    BatchStore(tmp_path, {}, with_kl=True).save(UNITS, GOOD)
    [path] = tmp_path.glob("batch-*.npz")
    damage(path)
    store = BatchStore(tmp_path, {}, with_kl=True)
    assert store.load(UNITS) is None
    assert store.counts["recomputed_corrupt"] == 1 and store.local_counts()["damage"].startswith(path.name)
    store.save(UNITS, GOOD)
    assert _same(BatchStore(tmp_path, {}, with_kl=True).load(UNITS), GOOD)


@pytest.mark.parametrize(
    "column, value, why",
    [
        (LL, np.nan, "non-finite scores"),
        (LL, 0.5, "a log-likelihood > 0"),
        (GREEDY, 0.5, "a greedy flag other than 0/1"),
        (N_TOKENS, 2, "token counts that differ"),
        (TOP1, 7, "top-1 counts out of range"),
    ],
)
def test_impossible_values_with_a_valid_checksum_are_recomputed(tmp_path, column, value, why):
    stats = GOOD.stats.copy()
    stats[0, column] = value
    BatchStore(tmp_path, {}, with_kl=True).save(UNITS, BatchScores(stats, GOOD.kl))  # another writer's file
    store = BatchStore(tmp_path, {}, with_kl=True)
    assert store.load(UNITS) is None and why in store.local_counts()["damage"]


def test_a_failed_save_warns_once_stops_saving_and_leaves_no_temporary_file(tmp_path, monkeypatch, resume_log):
    calls = []

    def refuse(src, dst):
        calls.append(dst)
        raise PermissionError(errno.EACCES, "Permission denied", str(dst))

    monkeypatch.setattr(os, "replace", refuse)
    store = BatchStore(tmp_path, {}, with_kl=True)
    store.save(UNITS, GOOD)
    store.save(UNITS[:1], BatchScores(GOOD.stats[:1], GOOD.kl[:1]))
    assert len(calls) == 1 and not list(tmp_path.iterdir())
    assert store.counts["save_failures"] == 1 and store.counts["saved"] == 0
    assert len(resume_log) == 1 and "Permission denied" in resume_log[0] and str(tmp_path) in resume_log[0]


def test_counts_are_summed_over_ranks_and_rank0_logs_each_fault_once(tmp_path, resume_log):
    store = BatchStore(tmp_path, {})
    rank = {
        "reused": 2,
        "saved": 3,
        "recomputed_corrupt": 1,
        "save_failures": 0,
        "damage": "x.npz: bad",
        "save_error": None,
    }
    failing = {**rank, "save_failures": 1, "damage": None, "save_error": "OSError: disk gone (saving /r/y.npz)"}
    for _ in range(2):  # the same state again at the next call: nothing new to say
        store.add_up([rank, None, failing])
    assert store.report() == {
        "folder": str(tmp_path),
        "reused": 4,
        "saved": 6,
        "recomputed_corrupt": 2,
        "save_failures": 1,
    }
    assert len(resume_log) == 2
    assert "2 saved batch file(s)" in resume_log[0] and "x.npz: bad" in resume_log[0]
    assert "rank 2: OSError: disk gone (saving /r/y.npz)" in resume_log[1]
    BatchStore(tmp_path, {}, is_main=False).add_up([rank, failing])
    assert len(resume_log) == 2  # other ranks never log


# ------------------------------------------------------------------------------ in-process runs, bit for bit
def _bits(results):
    return [
        (float(r).hex(), r.n_tokens, r.ref_loglikelihood, r.top1_agree, None if r.kl is None else r.kl.tobytes())
        for r in results
    ]


def _run(model_dir, folder=None, args=""):
    """Bits of the texts' scores and ``config.distperp.resume`` of one in-process run."""
    lm = make_lm(model_dir, ARGS + args + (f",resume_dir={folder}" if folder else ""))
    return _bits(score_rolling(lm, TEXTS)), lm.get_model_info()["distperp"]["resume"]


@pytest.fixture(scope="module")
def clean(tiny_model_dir):
    return _run(tiny_model_dir)[0]


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory, clean):
    """A folder holding every batch of the texts, and how many there are."""
    folder = tmp_path_factory.mktemp("saved") / "resume"
    bits, report = _run(tiny_model_dir, folder)
    n = len(list(folder.glob("batch-*.npz")))
    assert bits == clean and report["saved"] == n >= 4 and report["reused"] == 0
    return folder, n


@pytest.mark.parametrize(
    "damage", [_truncate, _garbage, _flip_a_byte, _wrong_numbers], ids=lambda f: f.__name__.strip("_")
)
def test_run_with_a_damaged_file_gives_identical_results(
    tiny_model_dir, saved, clean, tmp_path, damage, resume_log, run_log
):
    source, n = saved
    folder = tmp_path / "resume"
    shutil.copytree(source, folder)
    damage(sorted(folder.glob("batch-*.npz"))[n // 2])
    bits, report = _run(tiny_model_dir, folder)
    assert bits == clean
    assert report == {"folder": str(folder), "reused": n - 1, "saved": 1, "recomputed_corrupt": 1, "save_failures": 0}
    assert len(resume_log) == 1 and "1 saved batch file(s)" in resume_log[0]
    said = [m[m.index("resume_dir:") :] for m in run_log if "resume_dir:" in m]  # after accelerate's "[RANK 0] "
    assert said == [
        f"resume_dir: loglikelihood_rolling: reused {n - 1} of {n} batches saved in {folder}, computed 1 "
        "(saved there for a rerun)"
    ]
    assert _run(tiny_model_dir, folder)[1]["reused"] == n  # overwritten with a good file


def test_reference_scores_and_kl_are_reused_bit_for_bit(tiny_model_dir, tmp_path):
    args = f",reference={tiny_model_dir}"
    clean_bits = _run(tiny_model_dir, args=args)[0]
    assert clean_bits[0][4] is not None  # KL values are part of what is compared
    first, report = _run(tiny_model_dir, tmp_path, args)
    again, report_again = _run(tiny_model_dir, tmp_path, args)
    assert first == again == clean_bits
    assert report["saved"] == report_again["reused"] > 0 and report_again["saved"] == 0


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (needs root); skipped with the reason where it cannot be mounted."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a 64 KiB tmpfs: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 64 KiB tmpfs (needs root): {proc.stderr.strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=False, timeout=30)


def _fill(disk, leave_bytes):
    """Fill ``disk`` up, then free ``leave_bytes``."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as handle, pytest.raises(OSError) as info:
        while True:
            handle.write(b"\0" * 4096)
    assert info.value.errno == errno.ENOSPC
    os.truncate(filler, max(0, filler.stat().st_size - leave_bytes))


@pytest.mark.parametrize("room_for", [0, 2])
def test_full_disk_finishes_with_identical_results(tiny_model_dir, clean, small_disk, room_for, resume_log):
    folder = small_disk / "resume"
    folder.mkdir()
    _fill(small_disk, room_for * 4096)  # a batch file takes one 4 KiB page
    bits, report = _run(tiny_model_dir, folder)
    assert bits == clean
    assert report["save_failures"] == 1 and report["saved"] == room_for and report["reused"] == 0
    assert len(list(folder.glob("batch-*.npz"))) == room_for and not list(folder.glob(".tmp-*"))
    assert len(resume_log) == 1 and "No space left on device" in resume_log[0] and str(folder) in resume_log[0]
    bits, report = _run(tiny_model_dir, folder)  # the rerun reuses what was saved
    assert bits == clean and report["reused"] == room_for


# ------------------------------------------------------------------------------ accelerate launch runs
def _sigint_as_a_terminal_gives_it():
    """In the child: SIGINT's default action. A shell's background job (a CI runner's, say) starts with SIGINT
    ignored, and an ignored signal is inherited: Python would then install no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(command, cwd, hold, log_path):
    """``command`` in a session of its own (a terminal's process group), ``DISTPERP_TEST_HOLD=hold``, its output
    in ``log_path``."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            command,
            cwd=cwd,
            env=offline_env({"DISTPERP_TEST_HOLD": hold}),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=_sigint_as_a_terminal_gives_it,
        )


def _command(model_dir, out, processes, resume=None):
    return [
        *accelerate_launch_prefix(processes),
        "-m",
        "lm_eval",
        "--model",
        "distperp",
        "--model_args",
        f"pretrained={model_dir}{ARGS}" + (f",resume_dir={resume}" if resume else ""),
        "--tasks",
        "dptest_rolling",
        "--include_path",
        str(TASKS_DIR),
        "--batch_size",
        "2",
        "--log_samples",
        "--output_path",
        str(out),
    ]


@pytest.fixture(scope="module")
def clean_cli(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "out"
    run_command(_command(tiny_model_dir, out, 1), cwd=out.parent)
    return out


def _assert_resumed(out, clean_out, reused):
    """``out`` holds results identical to ``clean_out`` and reused ``reused`` batches, computing the rest."""
    resumed, clean = load_results(out), load_results(clean_out)
    report, calls = resumed["config"]["distperp"]["resume"], resumed["config"]["distperp"]["calls"]
    assert report["reused"] == reused and report["reused"] + report["saved"] == sum(c["batches"] for c in calls)
    assert report["recomputed_corrupt"] == 0 and report["save_failures"] == 0
    assert resumed["config"]["distperp"]["fingerprint"] == clean["config"]["distperp"]["fingerprint"]
    assert [r["resps"] for r in load_samples(out, "dptest_rolling")] == [
        r["resps"] for r in load_samples(clean_out, "dptest_rolling")
    ]


def test_crash_then_resume_with_another_world_size(tiny_model_dir, clean_cli, tmp_path):
    resume = tmp_path / "resume"
    crashed = run_command(
        _command(tiny_model_dir, tmp_path / "crashed", 2, resume),
        cwd=tmp_path,
        env={"DISTPERP_TEST_CRASH": "1:3"},
        check=False,
    )
    assert crashed.returncode != 0
    assert not list((tmp_path / "crashed").rglob("results_*.json"))
    done_before = len(list(resume.glob("batch-*.npz")))
    assert done_before >= 3
    run_command(_command(tiny_model_dir, tmp_path / "resumed", 1, resume), cwd=tmp_path)
    _assert_resumed(tmp_path / "resumed", clean_cli, done_before)


def _wait_until_saving_pauses(folder, launcher, log_path, timeout=240.0, quiet=2.0):
    """Wait until batch files exist and their number has not changed for ``quiet`` seconds."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            pytest.fail(f"the run ended early ({launcher.returncode}):\n{log_path.read_text()[-3000:]}")
        count = len(list(folder.glob("batch-*.npz")))
        if count != last:
            last, since = count, time.monotonic()
        elif count >= 2 and time.monotonic() - since >= quiet:
            return
        time.sleep(0.1)
    pytest.fail(f"no pause in saving within {timeout:g} s:\n{log_path.read_text()[-3000:]}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_stop_signal_stops_both_ranks_and_the_same_command_resumes(tiny_model_dir, clean_cli, tmp_path, signum):
    """SIGTERM (SLURM, kill: the launcher forwards it) or Ctrl-C (SIGINT to the terminal's whole process group):
    every rank stops within seconds, one line for the node says what is saved, no rank prints a traceback, no
    temporary file is left, and the same command resumes."""
    resume, out, log_path = tmp_path / "resume", tmp_path / "preempted", tmp_path / "preempted.log"
    command = _command(tiny_model_dir, out, 2, resume)
    # Rank 1 stalls after its first batch, so rank 0 finishes its share and waits in a collective for it:
    # SIGTERM then meets one rank in Python and one blocked in gloo.
    launcher = _start(command, tmp_path, "1:1", log_path)
    try:
        _wait_until_saving_pauses(resume, launcher, log_path)
        t0 = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C: the terminal signals every process of the group
        else:
            launcher.send_signal(signal.SIGTERM)  # as SLURM or a user's kill does; the launcher forwards it
        launcher.wait(timeout=60)
        elapsed = time.monotonic() - t0
        time.sleep(0.5)
        with pytest.raises(ProcessLookupError):
            os.killpg(launcher.pid, 0)  # no rank is left behind
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    output = log_path.read_text()
    assert launcher.returncode != 0 and elapsed < 15, output[-3000:]
    saved = len(list(resume.glob("batch-*.npz")))
    name = "SIGTERM" if signum == signal.SIGTERM else "SIGINT (Ctrl-C)"
    notices = [line for line in output.splitlines() if f"stopped by {name}" in line]
    assert len(notices) == 1, output[-3000:]  # the node's first process only
    assert "KeyboardInterrupt" not in output, output[-3000:]  # no rank's traceback
    assert f"{saved} finished batch(es)" in notices[0] and "Run the same command again to resume" in notices[0]
    assert not list(out.rglob("results_*.json")) and not list(resume.glob(".tmp-*"))

    run_command(command, cwd=tmp_path)
    _assert_resumed(out, clean_cli, saved)


def test_ctrl_c_on_one_process_without_resume_dir_is_one_line(tiny_model_dir, tmp_path):
    """Ctrl-C on a plain ``lm_eval`` run: one line that says nothing is kept and how to keep it, no traceback, the
    exit status of SIGINT."""
    out, log_path = tmp_path / "out", tmp_path / "run.log"
    command = [sys.executable, *_command(tiny_model_dir, out, 1)[len(accelerate_launch_prefix(1)) :]]
    run = _start(command, tmp_path, "0:1", log_path)  # rank 0 stalls after its first batch
    try:
        deadline = time.monotonic() + 120
        while "distperp" not in log_path.read_text() or "loglikelihood_rolling" not in log_path.read_text():
            if run.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run did not reach scoring:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        time.sleep(1.0)
        os.killpg(run.pid, signal.SIGINT)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    output = log_path.read_text()
    assert run.returncode in (130, -signal.SIGINT), (run.returncode, output[-3000:])
    lines = [line for line in output.splitlines() if line.lstrip("\r").startswith("distperp: stopped by Ctrl-C")]
    assert len(lines) == 1 and "resume_dir=" in lines[0], output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]


def test_a_resume_dir_that_cannot_be_written_is_refused_at_start(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(InputError, match="cannot be created or written to") as info:
        BatchStore(blocker / "resume", {"model": "x"})
    assert info.value.same_on_every_rank
    (tmp_path / "ok" / ".tmp-left-by-a-killed-writer.npz").parent.mkdir()
    (tmp_path / "ok" / ".tmp-left-by-a-killed-writer.npz").write_bytes(b"")
    BatchStore(tmp_path / "ok", {"model": "x"})  # rank 0 opens it: the leftover goes, nothing else is left
    assert list((tmp_path / "ok").iterdir()) == []
