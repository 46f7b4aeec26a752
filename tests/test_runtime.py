"""batch_size=auto: token budgets from a memory budget (CPU) or a probe (CUDA); plan cost coefficients."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from distperp_harness import runtime
from distperp_harness.options import Options
from distperp_harness.plan import make_batches
from distperp_harness.runtime import (activation_bytes_per_token, attention_coefficient, batching_for,
                                      clamp_budget, head_coefficient, memory_budget, probe_budget, scoring_probe)
from distperp_harness.scoring import _CHUNK_ELEMENTS

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GIB = 1 << 30


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _options(**kwargs):
    return Options.from_kwargs(pretrained="m", **kwargs)


def _free(nbytes):
    return lambda device: nbytes


def test_fixed_batch_size_is_rows(model):
    batching = batching_for(_options(batch_size=8), model, CPU, 128, free_memory=_free(0))
    assert (batching.batch_size, batching.token_budget) == (8, None)


@pytest.mark.parametrize("tokens, expected", [(1, 128), (128, 128), (129, 128), (255, 128), (256, 256),
                                              (5000, 4096), (10**9, 8192)])
def test_clamp_rounds_down_to_a_power_of_two_within_bounds(tokens, expected):
    assert clamp_budget(tokens, max_length=128, max_batch_size=64) == expected


def test_clamp_with_a_max_batch_size_that_is_not_a_power_of_two():
    # 48 rows x 100 = 4800 tokens allowed: the largest power of two below it, never above the limit
    assert clamp_budget(10**9, max_length=100, max_batch_size=48) == 4096
    # ... and never below one full row, even when that row is not a power of two
    assert clamp_budget(1, max_length=100, max_batch_size=48) == 100


def test_memory_budget_math(model):
    per_token = activation_bytes_per_token(model, 128)
    free = 64 * GIB
    usable = int(runtime._MEMORY_FRACTION * free) - 8 * _CHUNK_ELEMENTS
    expected = clamp_budget(usable // per_token, 128, 10**6)
    assert memory_budget(model, 128, 10**6, free) == expected
    assert expected & (expected - 1) == 0 and expected <= usable // per_token < 2 * expected


def test_auto_on_cpu_uses_a_quarter_of_free_memory(model):
    per_token = activation_bytes_per_token(model, 128)
    free = 4 * GIB
    batching = batching_for(_options(batch_size="auto", max_batch_size=10**6), model, CPU, 128,
                            free_memory=_free(free))
    assert batching.batch_size is None
    budget = batching.token_budget
    assert budget * per_token <= runtime._MEMORY_FRACTION * free  # fits the memory budget
    assert 2 * budget * per_token > runtime._MEMORY_FRACTION * free - 8 * _CHUNK_ELEMENTS  # the largest that does


def test_auto_respects_max_batch_size(model):
    batching = batching_for(_options(batch_size="auto", max_batch_size=16), model, CPU, 128,
                            free_memory=_free(1 << 50))
    assert batching.token_budget == 16 * 128 and batching.max_batch_size == 16
    rows = [b.rows for b in make_batches([128] * 40 + [8] * 100, token_budget=batching.token_budget,
                                         max_batch_size=batching.max_batch_size)]
    assert max(rows) == 16


def test_auto_never_below_max_length(model):
    batching = batching_for(_options(batch_size="auto"), model, CPU, 128, free_memory=_free(0))
    assert batching.token_budget == 128  # one full-length row always


def test_budget_depends_on_machine_and_model_only(model):
    a = batching_for(_options(batch_size="auto"), model, CPU, 128, free_memory=_free(3 * GIB))
    b = batching_for(_options(batch_size="auto"), model, CPU, 128, free_memory=_free(3 * GIB + 12345))
    assert a == b  # power-of-two rounding absorbs small differences in free memory


def test_auto_n_is_accepted_and_logged_as_auto(model, caplog):
    with caplog.at_level(logging.INFO, logger="distperp_harness.runtime"):
        n = batching_for(_options(batch_size="auto:4"), model, CPU, 128, free_memory=_free(GIB))
    assert n == batching_for(_options(batch_size="auto"), model, CPU, 128, free_memory=_free(GIB))
    assert "auto:4" in caplog.text and "treated as batch_size=auto" in caplog.text


def _oom_above(limit, calls):
    def probe(budget):
        calls.append(budget)
        if budget > limit:
            raise torch.OutOfMemoryError("fake OOM")
        return budget * 1000  # bytes at the probe's peak
    return probe


def test_cuda_probe_halves_on_oom_until_it_fits(model):
    calls = []
    batching = batching_for(_options(batch_size="auto", max_batch_size=64), model, CUDA, 128,
                            free_memory=_free(GIB), probe=_oom_above(1500, calls))
    assert calls == [8192, 4096, 2048, 1024]  # from max_batch_size rows down, halving
    assert batching.token_budget == 1024


def test_cuda_probe_keeps_headroom(model):
    # No OOM, but a probe that would take more than _PROBE_FRACTION of the free memory is refused.
    calls = []
    free = 4096 * 1000
    batching = batching_for(_options(batch_size="auto", max_batch_size=64), model, CUDA, 128,
                            free_memory=_free(free), probe=_oom_above(10**9, calls))
    assert batching.token_budget * 1000 <= runtime._PROBE_FRACTION * free
    assert batching.token_budget == 2048


def test_cuda_probe_that_never_fits_names_the_fix():
    with pytest.raises(RuntimeError, match="max_length=128 .*Fix: lower max_length"):
        probe_budget(_oom_above(0, []), 1024, 128, GIB)


def test_scoring_probe_runs_a_real_batch_on_cpu(model):
    probe = scoring_probe(model, CPU, 32, pad_token_id=3)
    assert probe(64) == 0  # two rows of 32 scored; no allocator statistics on CPU


def test_cost_coefficients(model):
    config = model.config
    body = sum(p.numel() for p in model.parameters()) - 2 * config.vocab_size * config.hidden_size  # untied
    assert attention_coefficient(model) == pytest.approx(config.num_hidden_layers * config.hidden_size / body)
    assert head_coefficient(model) == pytest.approx(config.vocab_size * config.hidden_size / body)
