"""Tests of :mod:`distperp_harness.model.quantize` on the tiny random Llama of ``tiny_model_dir``, CPU only.

Quantized layers are checked against an independent float64 fake-quantization of the original weights (the affine
formulas, with scales computed in the weight dtype as the kernels store them), so a report that names the wrong
scheme, bit width, symmetry or group size fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from distperp_harness.model.quantize import SCHEMES, quantize_model, resolve_model_dtype, weight_bytes
from distperp_harness.options import GROUP_SIZES, QUANT_SCHEMES

G = 32  # group size that divides every in_features of the test model (hidden 64, intermediate 128)


@pytest.fixture
def load(tiny_model_dir):
    """``load(dtype, tie=False)``: a fresh copy of the session's tiny Llama (vocab 512, hidden 64, untied)."""

    def make(dtype: torch.dtype = torch.float32, *, tie: bool = False) -> nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
        if tie:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model

    return make


def fake_quant(w: torch.Tensor, group: int, bits: int, mapping: str) -> torch.Tensor:
    """Group-wise affine fake quantization of ``w`` [N, K], float64 result; qparams in ``w``'s dtype."""
    n, k = w.shape
    wg = w.detach().reshape(n, k // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    if mapping == "tinygemm":  # asymmetric, float zero point at mid-range, q in [0, 15]
        scale = ((hi - lo) / 15).clamp(min=1e-6)
        zero = lo + 8 * scale
        q = ((wg - (zero - 8 * scale)) / scale).round().clamp(0, 15)
        return ((q.double() - 8) * scale.double() + zero.double()).reshape(n, k)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    if mapping == "symmetric":
        scale, zp = torch.maximum(-lo, hi) / ((qmax - qmin) / 2), torch.zeros_like(lo)
    else:
        scale = (hi - lo) / (qmax - qmin)
        zp = (qmin - (lo / scale).round()).clamp(qmin, qmax)
    q = (wg * (1.0 / scale)).round().add(zp).clamp(qmin, qmax)
    return ((q.double() - zp.double()) * scale.double()).reshape(n, k)


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric per-token int8 fake quantization of activations, float64 result."""
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / 255
    zp = (-128 - (lo / scale).round()).clamp(-128, 127)
    return ((x * (1.0 / scale)).round().add(zp).clamp(-128, 127).double() - zp.double()) * scale.double()


# scheme, model dtype -> config class, storage, weight tensor class, reference weight quantizer, layer tolerance
CASES = {
    ("int4", torch.bfloat16): (
        "PrototypeInt4WeightOnlyConfig",
        "int4-packed",
        "Int4OpaqueTensor",
        lambda w, g: fake_quant(w, g, 4, "tinygemm"),
        0.1,
    ),
    ("int4", torch.float32): (
        "IntxWeightOnlyConfig",
        "int4-in-int8",
        "IntxUnpackedToInt8Tensor",
        lambda w, g: fake_quant(w, g, 4, "asymmetric"),
        1e-3,
    ),
    ("int8", torch.float32): (
        "Int8WeightOnlyConfig",
        "int8",
        "Int8Tensor",
        lambda w, g: fake_quant(w, w.shape[1], 8, "symmetric"),
        1e-3,
    ),
    ("int8", torch.bfloat16): ("Int8WeightOnlyConfig", "int8", "Int8Tensor", None, None),  # bf16 output rounding
    ("8da4w", torch.float32): (
        "Int8DynamicActivationIntxWeightConfig",
        "int4-in-int8",
        "IntxUnpackedToInt8Tensor",
        lambda w, g: fake_quant(w, g, 4, "symmetric"),
        1e-3,
    ),
    ("8da4w", torch.bfloat16): (
        "Int8DynamicActivationIntxWeightConfig",
        "int4-in-int8",
        "IntxUnpackedToInt8Tensor",
        lambda w, g: fake_quant(w, g, 4, "symmetric"),
        0.1,
    ),
}  # is as large as the int8 error itself, so int8/bf16 is only checked at model level


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def test_registry_matches_options():
    assert list(SCHEMES) == list(QUANT_SCHEMES)


@pytest.mark.parametrize(("scheme", "dtype"), list(CASES), ids=[f"{s}-{str(d)[6:]}" for s, d in CASES])
def test_scheme_on_cpu(load, scheme, dtype):
    config_name, storage, tensor_name, reference, tol = CASES[(scheme, dtype)]
    model = load(dtype)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(tokens).logits.double()
    report = quantize_model(model, scheme, group_size=G)

    assert (report.config_name, report.storage, report.weight_format) == (config_name, storage, tensor_name)
    assert report.config["_type"] == config_name and report.device_type == "cpu"
    assert report.model_dtype == str(dtype).removeprefix("torch.")
    assert report.group_size == (None if scheme == "int8" else G)
    assert list(report.quantized) == [n for n in linear_names(model) if n != "lm_head"]
    assert list(report.skipped) == ["lm_head"] and "quantize_lm_head=true" in report.skipped["lm_head"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # untouched by default
        param = model.get_parameter(name)
        assert type(param) is nn.Parameter and torch.equal(param, original[name])
    assert 0 < report.weight_bytes_after < report.weight_bytes_before == sum(t.nbytes for t in original.values())

    with torch.no_grad():
        after = model(tokens).logits.double()
    err = (after - before).norm() / (before - before.mean()).norm()
    assert 0 < err < (0.05 if scheme == "int8" else 0.3), err  # close to, but not the same as, the original

    if reference is not None:  # each quantized layer computes x @ Q(W)^T (8da4w: Q8(x) @ Q(W)^T)
        x = torch.randn(16, model.config.hidden_size, dtype=dtype, generator=torch.Generator().manual_seed(2))
        xr = int8_per_token(x) if scheme == "8da4w" else x.double()
        for name in [n for n in report.quantized if n.endswith(("q_proj", "gate_proj"))]:  # in_features = hidden
            w = original[f"{name}.weight"]
            with torch.no_grad():
                got = model.get_submodule(name)(x).double()
            ratio = (got - xr @ reference(w, G).T).norm() / (got - x.double() @ w.double().T).norm()
            assert ratio < tol, (name, ratio)


@pytest.mark.parametrize("scheme", ["int4", "int8", "8da4w"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_include_lm_head_unties_tied_embeddings(load, scheme, dtype):
    model = load(dtype, tie=True)
    embedding = model.get_input_embeddings().weight.detach().clone()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert weight_bytes(model) == sum(p.nbytes for p in model.parameters())  # the tied matrix counted once
    report = quantize_model(model, scheme, group_size=G, include_lm_head=True)
    assert report.quantized[-1] == "lm_head" and report.skipped == {}
    assert report.notes and "untied" in report.notes[0]
    assert type(model.model.embed_tokens.weight) is nn.Parameter
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(10)[None]).logits).all()


def test_layers_not_divisible_by_group_size_are_skipped_and_listed(load):
    model = load(torch.bfloat16)  # hidden 64: q/k/v/o/gate/up take in_features=64; down_proj takes 128
    report = quantize_model(model, "int4", group_size=128)
    narrow = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.in_features == 64][:-1]
    assert len(narrow) == 12 and list(report.skipped) == [*narrow, "lm_head"]  # lm_head: its own reason
    for name in narrow:
        assert report.skipped[name] == "in_features=64 is not divisible by group_size=128"
        assert type(model.get_submodule(name).weight) is nn.Parameter
    assert report.quantized == ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj")
    assert "12x in_features=64 is not divisible by group_size=128" in report.summary()
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(10)[None]).logits).all()


def test_cpu_int4_kernel_shape_limits_are_skipped_not_crashed():
    model = nn.Sequential(nn.Linear(128, 100), nn.ReLU(), nn.Linear(100, 64), nn.Linear(64, 32)).bfloat16()
    report = quantize_model(model, "int4", group_size=64)
    assert report.quantized == ("3",)
    assert report.skipped == {
        "0": "out_features=100 is not divisible by 16 (CPU int4 pack kernel)",
        "2": "in_features=100 is not divisible by group_size=64",
    }
    assert model(torch.randn(3, 128, dtype=torch.bfloat16)).shape == (3, 32)


def test_cpu_int4_group_size_256_falls_back_to_unpacked_and_says_why():
    model = nn.Sequential(nn.Linear(256, 64, bias=False)).bfloat16()
    report = quantize_model(model, "int4", group_size=256)
    assert (report.config_name, report.storage) == ("IntxWeightOnlyConfig", "int4-in-int8")
    assert "group_size 32, 64 or 128" in report.note and "int4-in-int8" in report.summary()


def test_weight_bytes_against_storage_formats(load):
    def dims(model, names):
        return [(model.get_submodule(n).out_features, model.get_submodule(n).in_features) for n in names]

    model = load(torch.bfloat16)
    c = model.config
    kv = c.num_key_value_heads * c.hidden_size // c.num_attention_heads
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    n_params = 2 * v * h + c.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h
    assert weight_bytes(model) == 2 * n_params
    report = quantize_model(model, "int4", group_size=G)
    shapes = dims(model, report.quantized)
    # Int4OpaqueTensor: two 4-bit values per byte, one bf16 (scale, zero) pair per group
    expected = 2 * n_params - sum(2 * n * k for n, k in shapes) + sum(n * k // 2 + 4 * n * k // G for n, k in shapes)
    assert report.weight_bytes_after == weight_bytes(model) == expected

    model = load(torch.float32)
    report = quantize_model(model, "int8")
    shapes = dims(model, report.quantized)
    # Int8Tensor: one byte per weight, a float32 scale and an int8 zero point per row
    expected = 4 * n_params - sum(4 * n * k for n, k in shapes) + sum(n * k + 5 * n for n, k in shapes)
    assert report.weight_bytes_after == expected


def test_quantization_is_deterministic(load):
    logits = []
    for _ in range(2):
        model = load(torch.bfloat16)
        quantize_model(model, "int4", group_size=G)
        with torch.no_grad():
            logits.append(model(torch.arange(20)[None]).logits)
    assert torch.equal(*logits)


def test_none_leaves_the_model_alone(load):
    model = load()
    report = quantize_model(model, "none")
    assert report.config is None and report.quantized == () and report.storage == "full"
    assert report.weight_bytes_after == report.weight_bytes_before == weight_bytes(model)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert report.summary().startswith("quantize=none")


def test_report_is_json_and_one_log_line(load):
    report = quantize_model(load(torch.bfloat16), "int4", group_size=64)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["config"]["_data"]["group_size"] == 64 and data["skipped"] == {"lm_head": report.skipped["lm_head"]}
    line = report.summary()
    assert "\n" not in line and "PrototypeInt4WeightOnlyConfig" in line and "14 Linear layers quantized" in line


def test_unknown_scheme_lists_valid_ones():
    for call in (lambda: quantize_model(nn.Linear(64, 64), "int3"), lambda: resolve_model_dtype("int3", "auto", "cpu")):
        with pytest.raises(ValueError, match="none, int4, int8, 8da4w"):
            call()


@pytest.mark.parametrize("group_size", [0, 16, 100, 512])
def test_bad_group_size_lists_allowed_values(group_size):
    with pytest.raises(ValueError, match=", ".join(map(str, GROUP_SIZES))):
        quantize_model(nn.Linear(64, 64), "int4", group_size=group_size)


def test_device_the_scheme_cannot_run_on():
    with pytest.raises(ValueError, match="cpu or cuda"):
        resolve_model_dtype("int4", "auto", "mps")
    with pytest.raises(ValueError, match="cpu or cuda"):
        quantize_model(nn.Linear(128, 64, device="meta"), "int8")
    assert resolve_model_dtype("none", "auto", "mps") == (None, "dtype=auto: the loader's default dtype")


@pytest.mark.parametrize(
    ("scheme", "requested", "expected"),
    [
        ("int4", "auto", torch.bfloat16),
        ("int4", "bfloat16", torch.bfloat16),
        ("int4", "float32", torch.float32),
        ("int4", "float16", torch.float16),
        ("int8", "auto", None),
        ("8da4w", "auto", None),
        ("8da4w", "float32", torch.float32),
        ("none", "auto", None),
        ("none", "float16", torch.float16),
    ],
)
def test_resolve_model_dtype(scheme, requested, expected):
    dtype, note = resolve_model_dtype(scheme, requested, torch.device("cpu"))
    assert dtype == expected and note
    if (scheme, requested) == ("int4", "auto"):
        assert "bfloat16" in note and "auto" in note  # the choice is reported
    if scheme == "int4" and requested in ("float32", "float16"):
        assert f"dtype={requested} as asked" in note and "one per byte" in note


def test_int4_float32_does_what_was_asked(load):
    """dtype=float32 with int4: the model stays float32, and the report says int4 is stored one value per byte."""
    dtype, _ = resolve_model_dtype("int4", "float32", "cpu")
    model = load(dtype)
    report = quantize_model(model, "int4", group_size=G)
    assert report.model_dtype == "float32" and report.storage == "int4-in-int8" and len(report.quantized) == 14
    assert "need a bfloat16 model" in report.note and "[int4-in-int8]" in report.summary()
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # embeddings, norms, lm_head, scales
    with torch.no_grad():
        assert model(torch.arange(8)[None]).logits.dtype == torch.float32


def test_import_is_cheap():
    code = "import sys, distperp_harness.model.quantize; print('torchao' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize(
    ("capability", "config_name", "storage"),
    [((9, 0), "Int4WeightOnlyConfig", "int4-packed"), ((7, 5), "IntxWeightOnlyConfig", "int4-in-int8")],
)
def test_int4_plan_on_cuda(monkeypatch, capability, config_name, storage):
    """The CUDA choice, without a GPU: tinygemm (tile_packed_to_4d) from sm80 on, unpacked int4 below."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    plan = SCHEMES["int4"].plan(torch.bfloat16, 128, torch.device("cuda", 0))
    assert (type(plan.config).__name__, plan.storage) == (config_name, storage)
    if storage == "int4-packed":
        assert plan.config.int4_packing_format == "tile_packed_to_4d" and plan.config.group_size == 128
    else:
        assert "compute capability >= 8.0" in plan.note
    fp16 = SCHEMES["int4"].plan(torch.float16, 64, torch.device("cuda", 0))
    assert fp16.storage == "int4-in-int8" and "float16" in fp16.note
