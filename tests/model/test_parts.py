"""Every part checked when it loads (distperp_harness/model/parts.py): a damaged checkpoint, a tokenizer that does not
fit the model, a folder without tokenizer files, a ``max_length`` beyond the model's positions and a chat template
asked of a tokenizer without one are each one :class:`InputError` naming the file or value and the fix, raised
before anything is scored. Broken folders are copies of the tiny test model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import make_lm, score_rolling

from distperp_harness.errors import InputError, MissingInput
from distperp_harness.model.parts import position_limit, position_warning


@pytest.fixture
def copy_model(tiny_model_dir, tmp_path):
    def copy(name: str = "model") -> Path:
        return Path(shutil.copytree(tiny_model_dir, tmp_path / name))

    return copy


def _one_line(error: BaseException) -> str:
    assert isinstance(error, InputError) and error.same_on_every_rank, repr(error)
    assert "\n" not in str(error)
    return str(error)


def test_a_truncated_checkpoint_names_the_file(copy_model):
    folder = copy_model()
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # header whole, data cut short
    with pytest.raises(InputError) as info:
        make_lm(folder)
    message = _one_line(info.value)
    assert f"the weight file {weights} is damaged" in message and "Fix: download or copy that file again" in message


def test_random_bytes_for_weights_name_the_file(copy_model):
    folder = copy_model()
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(InputError, match=r"the weight file .*model\.safetensors is damaged \(safetensors cannot"):
        make_lm(folder)


def test_a_missing_shard_of_a_sharded_checkpoint_is_named(copy_model):
    from safetensors import safe_open

    folder = copy_model()
    first = folder / "model-00001-of-00002.safetensors"
    (folder / "model.safetensors").rename(first)
    with safe_open(str(first), framework="pt") as handle:
        names = list(handle.keys())
    shards = {name: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    with pytest.raises(MissingInput) as info:
        make_lm(folder)
    assert "the weight file model-00002-of-00002.safetensors named by model.safetensors.index.json is missing" in (
        _one_line(info.value)
    )


def test_a_folder_without_tokenizer_files_says_how_to_give_one(copy_model, tiny_model_dir):
    folder = copy_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(InputError) as info:
        make_lm(folder)
    message = _one_line(info.value)
    assert f"pretrained='{folder}': no tokenizer files in {folder}" in message
    assert "tokenizer=<a folder or hub id holding them>" in message and "installed" not in message  # not "install
    # sentencepiece or tiktoken", transformers' answer
    assert make_lm(folder, f",tokenizer={tiny_model_dir}").tokenizer is not None  # the fix works


def test_a_tokenizer_larger_than_the_embeddings_is_refused_at_start(copy_model, tiny_model_dir, tiny_tokenizer):
    big = copy_model("big_tokenizer")
    tokenizer = type(tiny_tokenizer).from_pretrained(tiny_model_dir)
    rows = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    tokenizer.add_tokens([f"extra_token_{i}" for i in range(rows - len(tokenizer) + 8)])
    tokenizer.save_pretrained(big)
    with pytest.raises(InputError) as info:
        make_lm(tiny_model_dir, f",tokenizer={big}")
    message = _one_line(info.value)
    assert f"has {len(tokenizer)} tokens (ids 0..{len(tokenizer) - 1})" in message
    assert (
        f"embeds and predicts only {rows} (ids 0..{rows - 1})" in message
        and "Fix: use the model's own tokenizer" in message
    )
    # a tokenizer smaller than the embeddings (padded embedding rows) is normal
    small = copy_model("small_tokenizer")
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = rows + 64
    (small / "config.json").write_text(json.dumps(config))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(rows + 64)
    model.save_pretrained(small)
    assert score_rolling(make_lm(small), ["a short text"])[0].n_tokens > 0


def test_max_length_beyond_the_positions_is_said_with_the_limit(tiny_model_dir, caplog):
    """A max_length beyond the model's positions runs (dry runs, extrapolation studies) but is said once in the
    log with the number and the fix, never silently; the default is the model's limit."""
    import logging

    from distperp_harness.model import parts

    parts._WARNED.clear()  # once per process: another test of this session may have said it already
    limit = 128
    with caplog.at_level(logging.WARNING):
        lm = make_lm(tiny_model_dir, f",max_length={limit * 4}")
    assert lm.max_length == limit * 4
    said = [r.getMessage() for r in caplog.records if "has positions for" in r.getMessage()]
    assert len(said) == 1, said
    assert f"max_length={limit * 4} is more than pretrained='{tiny_model_dir}' has positions for" in said[0]
    assert f"max_position_embeddings={limit}" in said[0] and f"Fix: max_length={limit}" in said[0]
    assert make_lm(tiny_model_dir).max_length == limit  # defaulted: the model's limit


@pytest.mark.parametrize(
    "config, limit",
    [
        ({"max_position_embeddings": 128}, ("max_position_embeddings", 128)),
        ({"n_positions": 1024}, ("n_positions", 1024)),
        ({}, None),  # no positions in the config: nothing to compare against
        ({"max_position_embeddings": 128, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, None),
        (
            {"max_position_embeddings": 128, "rope_parameters": {"rope_type": "default"}},
            ("max_position_embeddings", 128),
        ),
        (
            {"max_position_embeddings": 128, "rope_parameters": {"full_attention": {"rope_type": "linear"}}},
            None,
        ),
        ({"text_config": SimpleNamespace(max_position_embeddings=4096), "max_position_embeddings": 1200}, None),
    ],
)
def test_the_position_limit_trusts_only_plain_positions(config, limit):
    namespace = SimpleNamespace(**config)
    if "text_config" in config:
        assert position_limit(namespace) == ("max_position_embeddings", 4096)  # the text model's, as lm-eval
        assert position_warning(4096, namespace, "pretrained", "m") is None
        return
    assert position_limit(namespace) == limit
    assert position_warning(None, namespace, "pretrained", "m") is None  # defaulted passes
    if limit is None:
        assert position_warning(10**6, namespace, "pretrained", "m") is None  # rope scaling / no positions
    else:
        assert f"Fix: max_length={limit[1]}" in position_warning(limit[1] + 1, namespace, "pretrained", "m")


def test_a_chat_template_asked_of_a_tokenizer_without_one_is_one_line(tiny_model_dir):
    lm = make_lm(tiny_model_dir)
    assert not getattr(lm.tokenizer, "chat_template", None)
    with pytest.raises(InputError) as info:
        lm.chat_template(True)
    message = _one_line(info.value)
    assert f"--apply_chat_template was given, but the tokenizer of '{tiny_model_dir}' has no chat template" in message
    assert "Fix: drop --apply_chat_template" in message
    assert lm.chat_template(False) is None  # not asked: nothing to check


def test_an_output_head_narrower_than_the_embeddings_bounds_the_ids():
    """An id the input embeddings read but the head does not predict cannot be scored: the check counts the head."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from distperp_harness.model.parts import embedding_rows

    config = AutoConfig.for_model(
        "llama", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    assert embedding_rows(model) == 300
    model.lm_head = torch.nn.Linear(32, 200, bias=False)
    assert embedding_rows(model) == 200
