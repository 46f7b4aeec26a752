"""Plan cost coefficients of a model."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from distperp_harness.run.runtime import attention_coefficient, head_coefficient


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_cost_coefficients(model):
    config = model.config
    body = sum(p.numel() for p in model.parameters()) - 2 * config.vocab_size * config.hidden_size  # untied
    assert attention_coefficient(model) == pytest.approx(config.num_hidden_layers * config.hidden_size / body)
    assert head_coefficient(model) == pytest.approx(config.vocab_size * config.hidden_size / body)
