"""Checkpoints saved already quantized (a ``quantization_config`` in ``config.json``): loaded as saved, sized for the
fit check from their stored bytes, ``quantize=`` and ``reference=base`` on top refused with the reason, a
``reference=`` to the full-precision source works; scores as lm-eval ``hf`` scores the same folder."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from helpers import make_lm, score_rolling

TEXTS = ["The quick brown fox jumps over the lazy dog.", "= Title =\n a checkpoint saved already quantized"]


@pytest.fixture(scope="module", autouse=True)
def accelerate_state():
    from accelerate import PartialState

    PartialState(cpu=True)


def _save_quantized(source, out, quantization_config, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, quantization_config=quantization_config, device_map="cpu"
    )
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return model


@pytest.fixture(scope="module")
def torchao_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model quantized by torchao int8 weight-only (``TorchAoConfig``) and saved with ``save_pretrained``;
    returns the folder and the quantized model as transformers made it (the independent expectation). float32
    scales: lm-eval hf sums log-probs in the model dtype, which in bfloat16 is off by ~0.5 nats per text."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    out = tmp_path_factory.mktemp("torchao-int8")
    model = _save_quantized(tiny_model_dir, out, TorchAoConfig(Int8WeightOnlyConfig()), torch.float32)
    return out, model


def _hf_rolling(model_dir, texts, **kwargs):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(model_dir), device="cpu", batch_size=1, **kwargs)
    return lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)], disable_tqdm=True
    )


def test_torchao_checkpoint_loads_as_saved(torchao_dir):
    folder, saved = torchao_dir
    lm = make_lm(folder, "")
    weight = lm.model.model.layers[0].self_attn.q_proj.weight
    assert type(weight).__name__ == "Int8Tensor"
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, saved(ids).logits)
    info = lm.get_model_info()["distperp"]
    assert info["stored_quantization"]["quant_method"] == "torchao" and info["quantization"] is None


def test_torchao_checkpoint_parity_with_hf(torchao_dir):
    folder, _ = torchao_dir
    ours = score_rolling(make_lm(folder, ""), TEXTS)
    for a, b in zip(_hf_rolling(folder, TEXTS), ours):
        assert float(b) == pytest.approx(a, rel=1e-5)


def test_fit_check_sizes_it_from_its_stored_bytes(torchao_dir, tiny_model_dir):
    folder, _ = torchao_dir
    lm = make_lm(folder, "")
    stored = os.path.getsize(folder / "model.safetensors")
    full = make_lm(tiny_model_dir, "").estimate.model  # the same shapes at full precision (float32)
    assert lm.estimate.model == stored < full


def test_quantize_on_top_and_reference_base_are_refused(torchao_dir):
    folder, _ = torchao_dir
    with pytest.raises(ValueError, match=r"quantize=int4 was asked for, but .* is already quantized .*torchao.*Fix"):
        make_lm(folder, ",quantize=int4")
    with pytest.raises(ValueError, match=r"reference=base means the same weights unquantized.*Fix: give reference="):
        make_lm(folder, ",reference=base")


def test_reference_to_the_full_precision_source(torchao_dir, tiny_model_dir):
    folder, _ = torchao_dir
    lm = make_lm(folder, f",reference={tiny_model_dir}")
    rows = score_rolling(lm, TEXTS)
    plain = score_rolling(make_lm(tiny_model_dir, ""), TEXTS)
    for row, p in zip(rows, plain):
        assert row.ref_loglikelihood == float(p) and float(row) != float(p) and all(k >= 0 for k in row.kl)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
def test_bitsandbytes_8bit_checkpoint_parity_with_hf(tiny_model_dir, tmp_path):
    from transformers import BitsAndBytesConfig

    _save_quantized(tiny_model_dir, tmp_path / "bnb8", BitsAndBytesConfig(load_in_8bit=True), torch.float32)
    lm = make_lm(tmp_path / "bnb8", "")
    assert lm.get_model_info()["distperp"]["stored_quantization"]["quant_method"] == "bitsandbytes"
    ours = score_rolling(lm, TEXTS)
    for a, b in zip(_hf_rolling(tmp_path / "bnb8", TEXTS), ours):
        assert float(b) == pytest.approx(a, rel=1e-5)
