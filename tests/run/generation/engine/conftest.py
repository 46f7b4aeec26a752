"""Fixtures of the one-lane engine's tests: accelerate's state (the engine logs through it) and the peaked tiny
model with prompts after a shared block."""

from __future__ import annotations

import pytest
from helpers import block_prompts, peaked_model


@pytest.fixture(scope="module", autouse=True)
def _accelerate_state():
    from accelerate import PartialState

    PartialState()


@pytest.fixture(scope="module")
def peaked(tiny_model_dir, tmp_path_factory):
    """The tiny model with peaked distributions (greedy choices far from ties) and its tokenizer."""
    return peaked_model(tiny_model_dir, tmp_path_factory.mktemp("peaked"))


@pytest.fixture(scope="module")
def prompts(peaked, sample_text_path):
    """Nine prompts of 4 to 50 tokens after a shared 25-token block."""
    return block_prompts(peaked[1], sample_text_path)
