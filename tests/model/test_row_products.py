"""``model/row_products.py``: every plain ``nn.Linear`` multiplies at least 16 rows within :func:`at_least_rows`, or
a smaller number that :func:`measure_row_sizes` found to compute as 16 (a row's product then has the bits it has in
any batch), a ``Linear`` subclass with its own forward (a router) is left as it is, and :func:`routed_products`
names what keeps a model's products from following the padding."""

import pytest
import torch
from helpers import family_model

import distperp_harness.model.row_products as row_products
from distperp_harness.model.row_products import (
    MIN_ROWS,
    RowSizes,
    at_least_rows,
    measure_row_sizes,
    record_row_sizes,
    routed_products,
)


class _Router(torch.nn.Linear):
    """As Llama 4's router: its own forward, a tuple out with the token axis second in the first element."""

    def forward(self, x):
        logits = super().forward(x.reshape(-1, self.in_features))
        return logits.t(), logits


def test_plain_products_get_16_rows_and_routers_keep_their_shapes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Router(8, 4))
    seen = []
    x = torch.randn(3, 8)
    with at_least_rows(model):
        model[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))  # after the padding
        scores, logits = model(x)
    assert seen == [MIN_ROWS] and scores.shape == (4, 3) and logits.shape == (3, 4)
    plain = model[0](x)
    with at_least_rows(model):
        assert torch.equal(model[0](x), model[0](torch.cat([x, torch.zeros(MIN_ROWS - 3, 8)]))[:3])
    assert plain.shape == (3, 8)


@pytest.mark.parametrize("name, says", [("llama", None), ("deepseek-v3-mla-moe", "routed experts")])
def test_routed_products_names_experts(name, says):
    why = routed_products(family_model(name))
    assert (why is None) if says is None else (says in why)
    assert "Router layers multiply with a forward of their own" in routed_products(torch.nn.Sequential(_Router(8, 4)))


def test_a_product_is_padded_to_the_next_exact_size():
    sizes = RowSizes(frozenset({4, 8, 12, 13}))
    assert [sizes.target(m) for m in (1, 4, 5, 9, 13, 14, 16, 40)] == [4, 4, 8, 12, 13, 16, 16, 40]
    assert [RowSizes().target(m) for m in (1, 15, 16, 17)] == [16, 16, 16, 17]
    assert sizes.merged(RowSizes(frozenset({1, 8, 13}))).exact == {8, 13}


def test_at_least_rows_pads_to_the_recorded_sizes():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    seen = []
    record_row_sizes(model, RowSizes(frozenset({4})))
    for rows in (2, 4, 5):
        with at_least_rows(model):
            hook = model[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))  # after it
            assert model(torch.randn(rows, 8)).shape == (rows, 8)
            hook.remove()
    assert seen == [4, 4, MIN_ROWS]


def _product_with_paths(exact_below_16):
    """A ``F.linear`` whose products of fewer than 16 rows move every row by a row-count-dependent amount, except at
    the sizes ``exact_below_16`` (as BLAS's small-matrix paths), computed in float64 so that the rest is exact."""
    plain = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        out = plain(x.double(), weight.double(), None if bias is None else bias.double())
        m = x.numel() // x.shape[-1]
        if m < MIN_ROWS and m not in exact_below_16:
            out = out * (1 + m * 2.0**-20)
        return out.to(x.dtype)

    return linear


@pytest.mark.parametrize("exact", [set(), {4, 8}, set(range(1, MIN_ROWS))])
def test_measure_finds_the_sizes_that_compute_as_16_rows(monkeypatch, exact):
    monkeypatch.setattr(torch.nn.functional, "linear", _product_with_paths(exact))
    assert measure_row_sizes(family_model("llama")).exact == exact


def test_the_measured_sizes_hold_on_other_rows_for_every_product():
    """The contract on this machine's kernels, on rows the measure never saw: each exact size's product gives every
    row the bits that row gets among 16."""
    model = family_model("llama")
    sizes = measure_row_sizes(model)
    g = torch.Generator().manual_seed(5)
    for module in row_products._plain_linears(model):
        x = torch.randn(MIN_ROWS, module.in_features, generator=g)
        whole = module(x)
        for n in sizes.exact:
            start = 3 if n <= MIN_ROWS - 3 else 0  # rows from the middle where they fit
            assert torch.equal(module(x[start : start + n]), whole[start : start + n])


def test_the_reason_is_the_same_text_in_every_process():
    """Every rank says the same reason (the run's record compares them): a configuration holding two expert-count
    keys names the same one whatever the process's string hashing (``PYTHONHASHSEED``)."""
    import os
    import subprocess
    import sys

    code = (
        "import torch; from types import SimpleNamespace as N;"
        "from distperp_harness.model.row_products import routed_products;"
        "m = torch.nn.Linear(2, 2); m.config = N(num_experts=4, num_local_experts=4, n_routed_experts=4);"
        "print(routed_products(m))"
    )
    said = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in (0, 1, 2, 3)
    }
    assert len(said) == 1 and "routed experts" in said.pop()
