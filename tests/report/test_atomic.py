"""report/atomic.py: a file is written whole or not at all; a failed write leaves no temporary file and the old
content (or nothing) under the name."""

from __future__ import annotations

import errno
import os

import pytest
from helpers import FullDisk

from distperp_harness.report.atomic import atomic_open, atomic_path, atomic_write_bytes, atomic_write_text


def test_a_whole_write_replaces_the_file_with_an_ordinary_mode_and_leaves_nothing_else(tmp_path):
    target = tmp_path / "a.json"
    atomic_write_text(target, "old")
    atomic_write_text(target, "new ✓")
    assert target.read_text(encoding="utf-8") == "new ✓" and os.listdir(tmp_path) == ["a.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    with atomic_open(target, "a") as handle:
        handle.write(" more")
    assert target.read_text(encoding="utf-8") == "new ✓ more"


def test_a_write_cut_short_by_a_full_disk_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "a.json"
    atomic_write_text(target, '{"old": 1}')
    FullDisk(tmp_path, free=10).install(monkeypatch)
    with pytest.raises(OSError) as info:
        atomic_write_text(target, '{"new": "' + "x" * 100 + '"}')
    assert info.value.errno == errno.ENOSPC
    assert target.read_text() == '{"old": 1}' and os.listdir(tmp_path) == ["a.json"]
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "fresh.json", "y" * 100)
    assert os.listdir(tmp_path) == ["a.json"]


def test_a_writer_that_wants_a_path_gets_one_with_the_same_suffix_and_a_failure_leaves_nothing(tmp_path):
    target = tmp_path / "fig.png"
    with atomic_path(target) as temp:
        assert temp.parent == tmp_path and temp.suffix == ".png" and temp != target
        temp.write_bytes(b"png")
    assert target.read_bytes() == b"png" and os.listdir(tmp_path) == ["fig.png"]
    with pytest.raises(RuntimeError, match="renderer"), atomic_path(tmp_path / "other.png") as temp:
        temp.write_bytes(b"half")
        raise RuntimeError("renderer failed")
    assert os.listdir(tmp_path) == ["fig.png"]
    with pytest.raises(ValueError, match="allowed"), atomic_open(target, "r+"):
        pass


def test_a_written_file_takes_the_process_umask_read_without_changing_it(tmp_path, monkeypatch):
    from distperp_harness.report import atomic

    calls = []
    before = os.umask(0o027)
    try:
        monkeypatch.setattr(atomic.os, "umask", lambda mask: calls.append(mask) or 0o027)
        atomic.atomic_write_text(tmp_path / "a.txt", "x")
        assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o640
        assert calls == [] or not os.path.exists("/proc/self/status")  # read from /proc where Linux has it
    finally:
        os.umask(before)
