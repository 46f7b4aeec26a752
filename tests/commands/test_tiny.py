"""Tests for distperp_harness.commands.tiny (deterministic tiny models), the packaged sample, and the dptest_* tasks."""

from __future__ import annotations

import dataclasses
import json
import os
from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distperp_harness.commands import tiny
from distperp_harness.commands.tiny import DEMO_SPEC, TEST_SPEC, TinySpec

# TEST_SPEC with a few training steps, so the training path is covered too (about a second).
TRAINED_TEST_SPEC = dataclasses.replace(TEST_SPEC, train_steps=3, batch_size=2, seq_len=32, name="test-trained")


def _assert_same_build(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key].dtype == torch.float32, key
        assert torch.equal(wa[key], wb[key]), key
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = tiny.build_tiny_model(TRAINED_TEST_SPEC, tmp_path / "a")
    b = tiny.build_tiny_model(TRAINED_TEST_SPEC, tmp_path / "b")
    _assert_same_build(a, b)
    # and training changed the weights relative to the untrained init
    untrained = tiny.build_tiny_model(dataclasses.replace(TRAINED_TEST_SPEC, train_steps=0), tmp_path / "c")
    w0 = load_file(untrained / "model.safetensors")["model.norm.weight"]
    assert not torch.equal(w0, load_file(a / "model.safetensors")["model.norm.weight"])


def test_build_restores_thread_count(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    tiny.build_tiny_model(TRAINED_TEST_SPEC, tmp_path)
    assert torch.get_num_threads() == before


def test_cache_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = tiny.cached_tiny_model(TEST_SPEC, cache_dir=tmp_path)
    assert first.parent == tmp_path / "models" and first.name.startswith("test-llama-")

    def must_not_build(*args: object, **kwargs: object) -> Path:
        raise AssertionError("cached_tiny_model rebuilt a cached model")

    monkeypatch.setattr(tiny, "build_tiny_model", must_not_build)
    assert tiny.cached_tiny_model(TEST_SPEC, cache_dir=tmp_path) == first
    monkeypatch.setenv("DISTPERP_CACHE", str(tmp_path))
    assert tiny.cached_tiny_model(TEST_SPEC) == first
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [first.name]  # no temp dirs left


def test_cache_key_depends_on_spec_and_text() -> None:
    key = tiny.spec_key(TEST_SPEC)
    assert key == tiny.spec_key(TEST_SPEC)
    assert key != tiny.spec_key(dataclasses.replace(TEST_SPEC, seed=1))
    assert key != tiny.spec_key(TEST_SPEC, text="some other text")


def test_cache_race_uses_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process finishes first while we build: its directory wins, ours is discarded."""
    real_build = tiny.build_tiny_model
    winner: list[Path] = []

    def build_while_another_process_wins(spec: TinySpec, out_dir: Path, text: str | None = None) -> Path:
        monkeypatch.setattr(tiny, "build_tiny_model", real_build)
        winner.append(tiny.cached_tiny_model(spec, cache_dir=tmp_path, text=text))  # the "other process"
        (winner[0] / "marker").write_text("theirs")
        return real_build(spec, out_dir, text)

    monkeypatch.setattr(tiny, "build_tiny_model", build_while_another_process_wins)
    got = tiny.cached_tiny_model(TEST_SPEC, cache_dir=tmp_path)
    assert got == winner[0] and (got / "marker").read_text() == "theirs"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [got.name]


def test_tokenizer_adds_no_special_tokens(tiny_tokenizer) -> None:
    assert [tiny_tokenizer.bos_token, tiny_tokenizer.eos_token, tiny_tokenizer.unk_token, tiny_tokenizer.pad_token] == [
        "<s>", "</s>", "<unk>", "<pad>",
    ]  # fmt: skip
    assert [tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id] == [0, 1, 3]
    ids = tiny_tokenizer("The river was high.")["input_ids"]
    assert ids == tiny_tokenizer.encode("The river was high.", add_special_tokens=False)
    assert all(i >= len(tiny.SPECIAL_TOKENS) for i in ids)
    assert tiny_tokenizer.model_max_length == TEST_SPEC.max_position_embeddings
    assert len(tiny_tokenizer) == TEST_SPEC.vocab_size


def test_tokenizer_round_trips_sample(tiny_tokenizer, sample_text_path: Path) -> None:
    text = sample_text_path.read_text(encoding="utf-8")[:4000] + " café 20 °C “quotes”\n\n"
    assert tiny_tokenizer.decode(tiny_tokenizer(text, verbose=False)["input_ids"]) == text


def test_model_loads_offline(tiny_model_dir: Path, tiny_tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    assert (tiny_model_dir / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (TEST_SPEC.num_layers, TEST_SPEC.hidden_size)
    ids = torch.tensor([tiny_tokenizer("a short test")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], TEST_SPEC.vocab_size) and torch.isfinite(logits).all()


def test_cli_builds_into_out_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny.main(["--test", "--out", str(tmp_path / "m")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").is_file()


def test_demo_spec_suits_int4_group_128() -> None:
    head_dim = DEMO_SPEC.hidden_size // DEMO_SPEC.num_heads
    for in_features in (DEMO_SPEC.hidden_size, DEMO_SPEC.num_heads * head_dim, DEMO_SPEC.intermediate_size):
        assert in_features % 128 == 0
    assert DEMO_SPEC.train_steps > 0 and TEST_SPEC.train_steps == 0


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(TEST_SPEC, num_kv_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        dataclasses.replace(TEST_SPEC, vocab_size=100)


def test_sample_is_packaged_wikitext_format(sample_text_path: Path) -> None:
    packaged = resources.files("distperp_harness").joinpath("data/sample_wikitext.txt")
    text = packaged.read_text(encoding="utf-8")
    assert sample_text_path.read_text(encoding="utf-8") == text == tiny.sample_text()
    assert 20_000 <= len(text.encode("utf-8")) <= 30_000
    lines = text.split("\n")
    assert lines[0] == " " and lines[1].startswith(" = ") and lines[-1] == ""
    assert all(line.startswith(" ") for line in lines[:-1])
    titles = [line for line in lines if line.startswith(" = ") and not line.startswith(" = = ")]
    assert 8 <= len(titles) <= 12
    for token in (" @-@ ", " @,@ ", " @.@ ", " <unk> ", " = = "):
        assert token in text


def test_dptest_tasks_load_from_any_cwd(tasks_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local tasks find their jsonl next to the YAML whatever the current directory is."""
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(tmp_path)
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    tasks = manager.load(["dptest_mc", "dptest_rolling", "dptest_gen"])["tasks"]
    expected = {"dptest_mc": ("multiple_choice", 20), "dptest_rolling": ("loglikelihood_rolling", 8),
                "dptest_gen": ("generate_until", 10)}  # fmt: skip
    assert {name: (task.OUTPUT_TYPE, len(list(task.test_docs()))) for name, task in tasks.items()} == expected
    rows = [json.loads(line) for line in (tasks_dir / "dptest_mc.jsonl").read_text().splitlines()]
    assert any(r["query"] == "" for r in rows) and any(r["query"].endswith(" ") for r in rows)
