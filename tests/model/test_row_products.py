"""``model/row_products.py``: every plain ``nn.Linear`` multiplies at least 16 rows within :func:`at_least_rows` (a
row's product then has the bits it has in any batch), a ``Linear`` subclass with its own forward (a router) is left
as it is, and :func:`routed_products` names what keeps a model's products from following the padding."""

import pytest
import torch
from helpers import family_model

from distperp_harness.model.row_products import MIN_ROWS, at_least_rows, routed_products


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
