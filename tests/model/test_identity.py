"""Which weights a result came from: content hashes of local folders and files, hub commits from the local hub
cache, and ``subfolder=`` (loaded, hashed and recorded)."""

from __future__ import annotations

import hashlib
import shutil

import pytest
from helpers import make_lm, score_rolling

from distperp_harness.model.identity import content_hash, hub_sha, source_sha


def test_content_hash_is_of_the_files_not_the_place(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        (folder / "sub").mkdir(parents=True)
        (folder / "config.json").write_text('{"x": 1}')
        (folder / "sub" / "w.bin").write_bytes(b"\x00\x01" * 1000)
    (b / ".cache").mkdir()
    (b / ".cache" / "lock").write_text("hidden paths are not the checkpoint")
    assert content_hash(a) == content_hash(b)
    (b / "sub" / "w.bin").write_bytes(b"\x00\x01" * 999 + b"\x00\x02")
    assert content_hash(a) != content_hash(b)
    (b / "sub" / "w.bin").write_bytes(b"\x00\x01" * 1000)
    (b / "sub" / "w.bin").rename(b / "sub" / "v.bin")  # a renamed file is another checkpoint
    assert content_hash(a) != content_hash(b)
    assert content_hash(a / "config.json") == "sha256:" + hashlib.sha256(b'{"x": 1}').hexdigest()


def test_hub_id_gives_the_cached_snapshot_commit(tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--tiny"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_sha("org/tiny", "main") == commit == source_sha("org/tiny")
    assert hub_sha("org/absent", "main") == ""  # offline and not cached: unknown, as hf records it


def test_subfolder_loads_hashes_and_records_it(tiny_model_dir, tmp_path):
    from accelerate import PartialState

    PartialState(cpu=True)
    shutil.copytree(tiny_model_dir, tmp_path / "repo" / "checkpoint-100")
    (tmp_path / "repo" / "README.md").write_text("not part of the subfolder's hash")
    lm = make_lm(tmp_path / "repo", ",subfolder=checkpoint-100")
    info = lm.get_model_info()
    assert info["subfolder"] == "checkpoint-100" and info["model_sha"] == content_hash(tiny_model_dir)
    texts = ["a subfolder of a repository"]
    assert [float(x) for x in score_rolling(lm, texts)] == [
        float(x) for x in score_rolling(make_lm(tiny_model_dir, ""), texts)
    ]
    with pytest.raises(ValueError, match="could not load"):
        make_lm(tmp_path / "repo", ",subfolder=checkpoint-999")
