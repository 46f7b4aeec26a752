"""``peft=`` and ``delta=``: the adapter's weights are what the model computes with (checked against an independent
float64 merge and against lm-eval ``hf`` with the same arguments); it is merged before quantization;
``reference=pretrained`` is the base alone; the adapter's identity is in the results and the resume key."""

from __future__ import annotations

import pytest
import torch
from helpers import lora_adapter, make_lm, score_rolling

TEXTS = [
    "The quick brown fox jumps over the lazy dog, again and again.",
    "an adapter changes what a model says",
    "= Title =\n a short article of a few words",
]
PAIRS = [("The quick brown", " fox jumps"), ("an adapter", " changes everything")]


@pytest.fixture(scope="module", autouse=True)
def accelerate_state():
    from accelerate import PartialState

    PartialState(cpu=True)


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    return lora_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora"), seed=1)


@pytest.fixture(scope="module")
def other_adapter_dir(tiny_model_dir, tmp_path_factory):
    return lora_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora2"), seed=2)


def _hf(model_dir, **kwargs):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(model_dir), device="cpu", batch_size=1, max_length=128, **kwargs)


def _hf_rolling(lm, texts):
    from lm_eval.api.instance import Instance

    return lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)], disable_tqdm=True
    )


def _loglikelihood(lm, pairs):
    from lm_eval.api.instance import Instance

    return lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)


def _float64_merged(model_dir, adapter_dir) -> dict[str, torch.Tensor]:
    """The base's weights plus ``scale * B @ A`` of every adapted Linear, computed in float64 from the files."""
    import json

    from safetensors.torch import load_file

    base = load_file(str(model_dir / "model.safetensors"))
    lora = load_file(str(adapter_dir / "adapter_model.safetensors"))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    merged = {k: v.double() for k, v in base.items()}
    for key in lora:
        if key.endswith("lora_A.weight"):
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            b = lora[key.replace("lora_A", "lora_B")].double()
            merged[name] = merged[name] + scale * b @ lora[key].double()
    return merged


def test_merged_weights_equal_an_independent_float64_merge(tiny_model_dir, adapter_dir):
    lm = make_lm(tiny_model_dir, f",peft={adapter_dir}")
    expected = _float64_merged(tiny_model_dir, adapter_dir)
    ours = lm.model.state_dict()
    base = make_lm(tiny_model_dir, "").model.state_dict()
    for name, weight in expected.items():
        assert torch.allclose(ours[name].double(), weight, rtol=0, atol=1e-6), name
    changed = [n for n in expected if not torch.equal(ours[n], base[n])]
    assert len(changed) == 3 * 2 and all(n.split(".")[-2] in ("q_proj", "v_proj", "down_proj") for n in changed)
    assert type(lm.model).__name__ == "LlamaForCausalLM"  # a plain transformers model, no PEFT layers left
    assert not any("lora" in n for n, _ in lm.model.named_modules())
    adapter = lm.get_model_info()["distperp"]["adapter"]
    assert adapter["merged"] and adapter["peft_type"] == "LORA" and adapter["rank"] == 4
    assert adapter["target_modules"] == ["down_proj", "q_proj", "v_proj"]


@pytest.mark.parametrize("merge", [False, True])
def test_peft_parity_with_hf(tiny_model_dir, adapter_dir, merge):
    """hf runs the adapter unmerged: merge_adapter=false is the same computation; merged weights round once."""
    hf = _hf(tiny_model_dir, peft=str(adapter_dir))
    ours = make_lm(tiny_model_dir, f",peft={adapter_dir},max_length=128" + ("" if merge else ",merge_adapter=false"))
    base = score_rolling(make_lm(tiny_model_dir, ",max_length=128"), TEXTS)
    rel = 1e-5 if merge else 1e-6
    for a, b, plain in zip(_hf_rolling(hf, TEXTS), score_rolling(ours, TEXTS), base):
        assert float(b) == pytest.approx(a, rel=rel)
        assert abs(float(b) - float(plain)) > 1e-3  # the adapter changes the numbers
    for (a, ga), (b, gb) in zip(_loglikelihood(hf, PAIRS), _loglikelihood(ours, PAIRS)):
        assert abs(a - float(b)) <= 1e-5 and ga == gb


def test_reference_pretrained_is_the_base_without_the_adapter(tiny_model_dir, adapter_dir):
    lm = make_lm(tiny_model_dir, f",peft={adapter_dir},reference=pretrained")
    tuned = score_rolling(make_lm(tiny_model_dir, f",peft={adapter_dir}"), TEXTS)
    base = score_rolling(make_lm(tiny_model_dir, ""), TEXTS)
    both = score_rolling(lm, TEXTS)
    for row, t, b in zip(both, tuned, base):
        assert float(row) == float(t) and row.ref_loglikelihood == float(b)
        assert all(k > 0 for k in row.kl) and len(row.kl) == row.n_tokens
    info = lm.get_model_info()["distperp"]["reference"]
    assert info["source"] == "pretrained"


def test_adapter_is_merged_before_quantizing(tiny_model_dir, adapter_dir):
    """quantize=int4 with peft=: the quantized weights are those of the merged model quantized (not of the base),
    and the report says the adapter was merged first."""
    from distperp_harness.model.quantize import quantize_model
    from tests.helpers import assert_same_weights as _assert_same_weights

    lm = make_lm(tiny_model_dir, f",peft={adapter_dir},quantize=int4,group_size=32,reference=base")
    merged = make_lm(tiny_model_dir, f",peft={adapter_dir},dtype=bfloat16").model
    quantize_model(merged, "int4", group_size=32)
    _assert_same_weights(lm.model, merged)
    notes = lm.get_model_info()["distperp"]["quantization"]["notes"]
    assert any("merged into the weights before quantize=int4" in n for n in notes)
    # reference=base keeps the adapter: the same weights, unquantized (close to the quantized model)
    ref = lm.reference.state_dict()
    tuned = make_lm(tiny_model_dir, f",peft={adapter_dir}").model.state_dict()
    assert all(torch.equal(ref[k], tuned[k]) for k in tuned)


def test_delta_weights_as_hf_defines_them(tiny_model_dir, adapter_dir, tmp_path):
    """delta = fine-tune - base, saved as a checkpoint; pretrained=base,delta=DIR scores as the fine-tune does,
    and as lm-eval hf with the same arguments."""
    from transformers import AutoModelForCausalLM

    tuned = make_lm(tiny_model_dir, f",peft={adapter_dir}").model
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for (_name, p), q in zip(base.named_parameters(), tuned.parameters()):
            p.copy_(q - p)
    base.save_pretrained(tmp_path / "delta")
    ours = score_rolling(make_lm(tiny_model_dir, f",delta={tmp_path / 'delta'},max_length=128"), TEXTS)
    hf = _hf_rolling(_hf(tiny_model_dir, delta=str(tmp_path / "delta")), TEXTS)
    expected = score_rolling(make_lm(tiny_model_dir, f",peft={adapter_dir}"), TEXTS)
    for a, b, c in zip(hf, ours, expected):
        assert float(b) == pytest.approx(a, rel=1e-6) and float(b) == pytest.approx(float(c), rel=1e-5)


def test_identity_and_resume_key_name_the_adapter(tiny_model_dir, adapter_dir, other_adapter_dir, tmp_path):
    from distperp_harness.model.identity import content_hash

    one = make_lm(tiny_model_dir, f",peft={adapter_dir},resume_dir={tmp_path / 'r1'}")
    two = make_lm(tiny_model_dir, f",peft={other_adapter_dir},resume_dir={tmp_path / 'r2'}")
    info = one.get_model_info()
    assert info["model_sha"] == content_hash(tiny_model_dir) and info["model_sha"].startswith("sha256:")
    assert info["peft_sha"] == content_hash(adapter_dir) != two.get_model_info()["peft_sha"]
    key_one, key_two = one._scoring_config(), two._scoring_config()
    assert key_one["checkpoint"]["peft_sha"] != key_two["checkpoint"]["peft_sha"]
    assert key_one != key_two


def test_missing_peft_package_is_one_clear_error(tiny_model_dir, adapter_dir, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'peft"):
        make_lm(tiny_model_dir, f",peft={adapter_dir}")


def test_bad_adapter_path_names_the_fix(tiny_model_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"could not load a PEFT adapter from peft=.*Fix"):
        make_lm(tiny_model_dir, f",peft={tmp_path / 'empty'}")
