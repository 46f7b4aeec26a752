"""Fixtures of the generation tests: the tiny family models of :data:`helpers.FAMILIES` (sliding windows, mixed layer
types, chunks, sinks, recurrent layers), as a run holds them."""

from __future__ import annotations

import pytest
import torch
from helpers import family_model

PROBE_LENGTH = 256
"""``max_length`` of the families' probe: longer than every test row, so every window and chunk applies."""


@pytest.fixture(scope="session")
def family(tiny_tokenizer):
    """``make(name, probed=True)``: :data:`helpers.FAMILIES`' ``name`` (weights times 4: greedy choices far from
    ties) cut to the tiny tokenizer's vocabulary, with its EOS and pad as generation defaults, one per name and
    ``probed`` for the session. ``probed``: its paths probed and recorded as a run does (``stages.prepare``); else
    nobody probed it and its declarations stand."""
    from distperp_harness.run.scoring.engine.probe import probe
    from distperp_harness.run.scoring.engine.support import record_paths

    built: dict = {}

    def make(name: str, probed: bool = True):
        if (name, probed) not in built:
            model = family_model(name, scale=4.0)
            model.resize_token_embeddings(len(tiny_tokenizer))  # every token one the stop strings can read
            model.generation_config.eos_token_id = tiny_tokenizer.eos_token_id
            model.generation_config.pad_token_id = tiny_tokenizer.pad_token_id
            if probed:
                verdict = probe(model, torch.device("cpu"), tiny_tokenizer.pad_token_id, PROBE_LENGTH)
                record_paths(model, verdict)
            built[name, probed] = model
        return built[name, probed]

    return make
