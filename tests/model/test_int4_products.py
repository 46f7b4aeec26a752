"""Tests of :mod:`distperp_harness.model.int4_products`: int4 products at prefill sizes, dequantized and dense.

The packed layout is learnt from the CPU packer (and from a synthetic tile packer standing in for CUDA's, which
this machine cannot run); every dense weight is compared bit for bit with the kernel's own values (its product
with the identity), and against an independent float64 dequantization of the torchao tensor's unpacked values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from distperp_harness.errors import OptionError
from distperp_harness.model import int4_products
from distperp_harness.model.int4_products import (
    Rounding,
    dense_weight,
    derive_layout,
    install,
    kernel_columns,
)
from distperp_harness.model.quantize import quantize_model
from distperp_harness.options import Int4Prefill, Options

CPU = torch.device("cpu")


def int4_linear(n: int, k: int, group: int, seed: int = 0) -> nn.Sequential:
    """One bf16 Linear ``k -> n`` with a bias, quantized by distperp's CPU int4 scheme (packed, torchao's kernel)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(k, n)).to(torch.bfloat16)
    report = quantize_model(model, "int4", group_size=group)
    assert report.quantized == ("0",) and report.weight_format == "Int4OpaqueTensor"
    return model


def unpacked_values(n: int, k: int, group: int, seed: int = 0) -> torch.Tensor:
    """The float64 weights the int4 tensor stands for, from torchao's own quantization of the same bf16 weights
    (``_quantize_affine_tinygemm`` values and qparams, not the packed bytes): ``(q - 8) * scale + zero``."""
    from torchao.quantization.quant_primitives import (
        MappingType,
        _choose_qparams_affine_tinygemm,
        _quantize_affine_tinygemm,
    )

    torch.manual_seed(seed)
    w = nn.Linear(k, n).to(torch.bfloat16).weight.detach()
    block = (1, group)
    scale, zero = _choose_qparams_affine_tinygemm(
        w, MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6, None, torch.bfloat16
    )
    q = _quantize_affine_tinygemm(w, block, scale, zero, torch.int32, 0, 15)
    expand = lambda t: t.reshape(n, -1).double().repeat_interleave(group, dim=1)  # noqa: E731 - a local shorthand
    return (q.double() - 8) * expand(scale) + expand(zero)


@pytest.mark.parametrize("n,k,group", [(64, 64, 32), (96, 256, 32), (208, 384, 128), (128, 192, 64)])
def test_dense_weight_is_the_kernels_weight(n, k, group):
    """Every column of the dense weight equals the kernel's own value, and the float64 dequantization of torchao's
    unpacked values rounded once more; shapes with a tail of rows (96, 208: the CPU packer's blocks are 64 rows)."""
    weight = int4_linear(n, k, group)[0].weight
    layout = derive_layout(lambda v: int4_products._pack_cpu(v, weight), k, CPU, n)
    assert layout is not None and layout.block_rows == 64 and layout.tail_rows == n % 64
    dense = dense_weight(weight, layout, Rounding.FP32, torch.bfloat16)
    assert dense.shape == (n, k) and dense.dtype == torch.bfloat16
    assert torch.equal(dense, kernel_columns(weight, torch.arange(k)).to(torch.bfloat16))
    expected = unpacked_values(n, k, group)
    assert (dense.double() - expected).abs().max() <= expected.abs().max() * 2**-8  # one bf16 rounding


def test_layout_of_a_tile_packer():
    """A packer of another kind (8-row tiles, columns interleaved, bytes in int32 words, as CUDA's tile layout is
    built): its layout is learnt, and unpacking a packed weight gives the weight back."""

    def tiles(values: torch.Tensor) -> torch.Tensor:
        rows, k = values.shape
        if rows % 8 or k % 16:
            raise RuntimeError("tile packer: rows % 8 and k % 16 must be 0")
        t = values.reshape(rows // 8, 8, k // 16, 16).permute(0, 2, 3, 1).reshape(-1, 2)  # column-major in tiles
        return (t[:, 0] | t[:, 1] << 4).to(torch.uint8).view(torch.int32)

    layout = derive_layout(tiles, 32, CPU, 24)
    assert layout is not None and layout.block_rows == 8 and layout.tail_rows == 0
    torch.manual_seed(1)
    values = torch.randint(0, 16, (24, 32), dtype=torch.int32)
    got = int4_products.nibbles(tiles(values)).view(3, -1).index_select(1, layout.gather).view(24, 32)
    assert torch.equal(got.int(), values)


def test_a_packer_that_is_not_a_permutation_has_no_layout():
    assert derive_layout(lambda v: torch.zeros(v.numel() // 2, dtype=torch.uint8), 32, CPU, 16) is None


def test_install_routes_products_by_rows():
    """Inputs of >= rows rows use the dense weight (the same bits as ``F.linear`` with it), fewer the kernel (the
    same bits as torchao's own product); the results agree to bf16 precision."""
    model = int4_linear(96, 256, 32)
    linear = model[0]
    torch.manual_seed(2)
    few, many = torch.randn(3, 256, dtype=torch.bfloat16), torch.randn(2, 5, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        kernel_few, kernel_many = F.linear(few, linear.weight, linear.bias), F.linear(many, linear.weight, linear.bias)
        report = install(model, 8)
        assert report.rows == 8 and report.layers == 1 and report.rounding == {"Int4OpaqueTensor": "fp32"}
        assert report.transient_bytes == 96 * 256 * (2 + 4 + 3)  # bf16 weight; float32 values, nibbles, gathered
        dense = kernel_columns(linear.weight, torch.arange(256)).to(torch.bfloat16)
        assert torch.equal(model(few), kernel_few)
        assert torch.equal(model(many), F.linear(many, dense) + linear.bias)
    assert (model(many).float() - kernel_many.float()).abs().max() < 0.05


def test_kernel_setting_and_models_without_int4():
    model = int4_linear(64, 64, 32)
    report = install(model, Int4Prefill.KERNEL)
    assert report.rows is None and report.layers == 0 and "as asked" in report.summary()
    assert "forward" not in vars(model[0])
    assert install(nn.Sequential(nn.Linear(8, 8)), Int4Prefill.AUTO) is None
    auto = install(int4_linear(64, 64, 32), Int4Prefill.AUTO)
    assert auto.rows == int4_products.AUTO_ROWS["cpu"] and auto.layers == 1


def test_a_wrong_layout_keeps_the_kernel(monkeypatch):
    """A packer whose layout is not the weight's (rows reversed): the check against the kernel's values fails, every
    layer keeps the kernel, and the report says why."""
    real = int4_products._FORMATS["Int4OpaqueTensor"]
    flipped = int4_products._Format(real.name, lambda v, w: real.pack(v.flip(1).contiguous(), w))
    monkeypatch.setitem(int4_products._FORMATS, "Int4OpaqueTensor", flipped)
    model = int4_linear(64, 64, 32)
    report = install(model, 8)
    assert report.rows is None and report.layers == 0
    assert "does not reproduce the kernel's values" in report.reason
    assert "forward" not in vars(model[0])


@pytest.mark.parametrize(
    "given,expected",
    [("auto", Int4Prefill.AUTO), ("KERNEL", Int4Prefill.KERNEL), ("64", 64), (1, 1)],
)
def test_option_values(given, expected):
    options = Options.from_kwargs(pretrained="m", int4_prefill=given)
    assert options.int4_prefill == expected
    assert options.to_dict()["int4_prefill"] == (expected.value if isinstance(expected, Int4Prefill) else expected)


@pytest.mark.parametrize("given", ["fast", "0", 0, True, "-3"])
def test_option_refuses(given):
    with pytest.raises(OptionError, match="int4_prefill=.*allowed: auto, kernel, or an integer N >= 1"):
        Options.from_kwargs(pretrained="m", int4_prefill=given)


def test_tensor_parallel_and_replaced_forwards_keep_the_kernel():
    """A tensor-parallel plan moves a layer's inputs and outputs across ranks around its forward: such a model, and
    any layer whose forward something else replaced, keep torchao's kernel, said in the report."""
    model = int4_linear(64, 64, 32)
    report = install(model, 8, tensor_parallel=True)
    assert report.rows is None and report.layers == 0 and "tensor-parallel layers" in report.reason
    assert "forward" not in vars(model[0])
    wrapped = int4_linear(64, 64, 32)
    wrapped[0].forward = wrapped[0].forward  # an instance-level forward, as a wrapping library leaves
    report = install(wrapped, 8)
    assert report.rows is None and "1 layers whose forward was replaced" in report.reason
