"""``gguf_file=``: a GGUF checkpoint loads through transformers' GGUF support (weights and tokenizer from the file),
scores as lm-eval ``hf`` does with the same arguments, quantizes and compares like any checkpoint, and records the
file and its hash. The test writes its own tiny GGUF (always runs); the shared SmolLM2 file is used when present."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from helpers import make_lm, score_rolling, write_gguf

SHARED = Path(__file__).resolve().parents[3] / "shared" / "models" / "smollm2-135m-instruct"
SHARED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "= Title =\n GGUF files hold a model and its tokenizer."]


@pytest.fixture(scope="module", autouse=True)
def accelerate_state():
    from accelerate import PartialState

    PartialState(cpu=True)


@pytest.fixture(scope="module")
def gguf_dir(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    write_gguf(tiny_model_dir, folder / "tiny-f32.gguf")
    (folder / "other.gguf").write_bytes(b"not read")  # a folder of several files: only the named one counts
    return folder


def _hf_rolling(model_dir, texts, **kwargs):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(
        pretrained=model_dir if isinstance(model_dir, torch.nn.Module) else str(model_dir),
        device="cpu",
        batch_size=1,
        **kwargs,
    )
    return lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)], disable_tqdm=True
    )


def test_gguf_weights_and_scores_equal_the_source_checkpoint(tiny_model_dir, gguf_dir):
    lm = make_lm(gguf_dir, ",gguf_file=tiny-f32.gguf")
    source = make_lm(tiny_model_dir, "")
    ours, theirs = lm.model.state_dict(), source.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert [float(x) for x in score_rolling(lm, TEXTS)] == [float(x) for x in score_rolling(source, TEXTS)]


def test_gguf_parity_with_hf(gguf_dir):
    ours = score_rolling(make_lm(gguf_dir, ",gguf_file=tiny-f32.gguf"), TEXTS)
    for a, b in zip(_hf_rolling(gguf_dir, TEXTS, gguf_file="tiny-f32.gguf"), ours):
        assert float(b) == pytest.approx(a, rel=1e-6)


def test_gguf_identity_is_the_file_and_its_hash(gguf_dir):
    info = make_lm(gguf_dir, ",gguf_file=tiny-f32.gguf").get_model_info()
    expected = "sha256:" + hashlib.sha256((gguf_dir / "tiny-f32.gguf").read_bytes()).hexdigest()
    assert info["gguf_file"] == "tiny-f32.gguf" and info["gguf_sha"] == expected and info["model_sha"] == expected
    assert info["distperp"]["options"]["gguf_file"] == "tiny-f32.gguf"


def test_gguf_quantized_with_reference_base(gguf_dir):
    lm = make_lm(gguf_dir, ",gguf_file=tiny-f32.gguf,quantize=int8,reference=base")
    rows = score_rolling(lm, TEXTS)
    assert lm.quant_report.quantized and all(r.ref_loglikelihood is not None and len(r.kl) == r.n_tokens for r in rows)
    assert lm.estimate is not None and lm.estimate.model > 0  # the fit check sized the GGUF model's skeleton


def test_gguf_errors_name_the_fix(gguf_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"no such file .* GGUF files there: other.gguf, tiny-f32.gguf"):
        make_lm(gguf_dir, ",gguf_file=missing.gguf")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs the 'gguf' package.*Fix: pip install 'gguf"):
        make_lm(gguf_dir, ",gguf_file=tiny-f32.gguf")


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / SHARED_FILE).is_file(), reason="the shared SmolLM2 GGUF is not on this machine")
def test_shared_smollm2_gguf_parity_with_hf():
    texts = [
        "The capital of France is Paris. It is known for the Eiffel Tower.",
        "Large language models are trained on text from the web.",
    ]
    lm = make_lm(SHARED, f",gguf_file={SHARED_FILE},max_length=256")
    ours = score_rolling(lm, texts)
    # hf scores the weights distperp loaded (transformers' GGUF loader is the same call on both sides: dequantizing
    # the file again would double the test's time); the tiny GGUF test above compares the two loads too
    for a, b in zip(_hf_rolling(lm.model, texts, tokenizer=lm.tokenizer, max_length=256), ours):
        assert float(b) == pytest.approx(a, rel=1e-5)
        assert -8 * b.n_tokens < float(b) < -0.5 * b.n_tokens  # a real model: a few nats per token, not random
    assert lm.get_model_info()["gguf_sha"].startswith("sha256:")
