"""CPU weight prepacking (``compile=`` on CPU): packed linears match a float64 ``F.linear``, one compiled graph serves
layers with different weights, restore gives the eager module back, and only plain dense weights are packed."""

from __future__ import annotations

import torch

from distperp_harness.run.compiling import prepack


def _stack(seed: int = 0) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(
        [torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 16, bias=False)) for _ in range(2)]
    )


def _float64(layer: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for linear in layer:
        b = linear.bias.double() if linear.bias is not None else None
        x = torch.nn.functional.linear(x.double(), linear.weight.double(), b)
    return x


def test_packed_linears_match_float64_and_restore_gives_eager_back():
    layers = _stack()
    x = torch.randn(3, 5, 16)
    eager = [layer(x) for layer in layers]
    expected_bytes = prepack.packable_bytes(layers, torch.device("cpu"))
    state = prepack.prepack(layers, torch.device("cpu"), hint=15)
    assert state.linears == 4 and state.hint == 15
    assert state.packed_bytes == expected_bytes == 4 * 16 * 24 * 4
    assert all("forward" in m.__dict__ for layer in layers for m in layer)
    with torch.no_grad():
        for layer in layers:
            torch.testing.assert_close(layer(x).double(), _float64(layer, x), atol=1e-5, rtol=0)
    state.restore()
    assert state.linears == 0 and not any("forward" in m.__dict__ for layer in layers for m in layer)
    assert not any((m.weight.data_ptr(), tuple(m.weight.shape)) in prepack._PACKED for layer in layers for m in layer)
    assert all(torch.equal(layer(x), e) for layer, e in zip(layers, eager))  # the eager kernels' bits again


def test_bfloat16_weights_are_packed_where_the_cpu_can():
    torch.manual_seed(2)
    layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(32, 48)).to(torch.bfloat16)])
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    packs = torch.bfloat16 in prepack.packable_dtypes()  # oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT
    assert packs == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert prepack.packable_bytes(layers, torch.device("cpu")) == (32 * 48 * 2 if packs else 0)  # the budget's count
    state = prepack.prepack(layers, torch.device("cpu"), hint=10)
    try:
        assert (state.linears, state.packed_bytes) == ((1, 32 * 48 * 2) if packs else (0, 0))
        with torch.no_grad():
            out = layers[0](x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), _float64(layers[0], x), atol=0.05, rtol=0.02)  # bf16 rounding
    finally:
        state.restore()


def test_one_compiled_graph_serves_layers_with_their_own_weights():
    from torch._dynamo.utils import counters

    layers = _stack(seed=1)
    state = prepack.prepack(layers, torch.device("cpu"), hint=8)
    try:
        torch._dynamo.reset()
        calls = [torch.compile(layer.forward, dynamic=True) for layer in layers]
        before = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            for n in (4, 7):  # two row counts: one dynamic graph
                x = torch.randn(n, 16)
                for layer, call in zip(layers, calls):
                    torch.testing.assert_close(call(x).double(), _float64(layer, x), atol=1e-5, rtol=0)
        assert counters["stats"]["unique_graphs"] - before == 1
    finally:
        state.restore()
        torch._dynamo.reset()


def test_only_plain_dense_weights_of_nn_linear_are_packed():
    class MyLinear(torch.nn.Linear):  # a subclass (e.g. a quantized wrapper) keeps its own forward
        pass

    layers = torch.nn.ModuleList(
        [torch.nn.Sequential(MyLinear(8, 8), torch.nn.Linear(8, 8).half(), torch.nn.Linear(8, 8))]
    )
    hooked = layers[0][2]
    hooked.forward = hooked.forward  # an instance forward (a hook's wrapper): left alone
    assert prepack.packable_bytes(layers, torch.device("cpu")) == 0
    assert prepack.prepack(layers, torch.device("cpu"), hint=4).linears == 0


def test_nothing_is_packed_off_cpu():
    assert "CPU" in prepack.unsupported(torch.device("cuda"))
    assert prepack.packable_bytes(_stack(), torch.device("cuda")) == 0
    assert prepack.prepack(_stack(), torch.device("cuda"), hint=4).linears == 0
