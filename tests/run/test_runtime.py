"""Plan cost coefficients of a model; what the probe is asked to vouch for; how ``batch_invariant`` is decided."""

import pytest
import torch
from helpers import family_model
from transformers import AutoModelForCausalLM

from distperp_harness.model.row_products import RowSizes, measure_row_sizes, record_row_sizes, row_sizes_of
from distperp_harness.options import BatchInvariant
from distperp_harness.run.rules import Batching
from distperp_harness.run.runtime import (
    attention_coefficient,
    decide_invariance,
    head_coefficient,
    invariance_blocked,
    invariance_modes,
    probe_target,
    row_budget,
)
from distperp_harness.run.scoring.engine.invariance import Invariance
from distperp_harness.run.scoring.engine.support import declared_paths, record_paths


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_cost_coefficients(model):
    config = model.config
    body = sum(p.numel() for p in model.parameters()) - 2 * config.vocab_size * config.hidden_size  # untied
    assert attention_coefficient(model) == pytest.approx(config.num_hidden_layers * config.hidden_size / body)
    assert head_coefficient(model) == pytest.approx(config.vocab_size * config.hidden_size / body)


class _OneRank:
    rank, world_size = 0, 1

    def all_gather_object(self, obj, name=""):
        return [obj]


class _TwoRanks(_OneRank):
    """Rank 0 of two whose rank 1 passes the check and finds only 4-row products exact."""

    world_size = 2

    def all_gather_object(self, obj, name=""):
        return [obj, (None, [4])]


@pytest.mark.parametrize(
    "wanted, compile_mode, cp_size, device, blocked",
    [
        (BatchInvariant.AUTO, "false", 1, "cpu", None),
        (BatchInvariant.AUTO, "default", 1, "cpu", "compile=default"),
        (BatchInvariant.AUTO, "false", 2, "cpu", "cp_size=2"),
        (BatchInvariant.AUTO, "false", 1, "cuda", "on cuda are unmeasured"),
        (BatchInvariant.ON, "false", 1, "cuda", None),  # asked for: checked, and a forward per row where it fails
        (BatchInvariant.OFF, "false", 1, "cpu", None),
    ],
)
def test_auto_is_off_where_invariance_is_not_cheap_or_not_measured(wanted, compile_mode, cp_size, device, blocked):
    why = invariance_blocked(wanted, compile_mode, cp_size, device)
    assert (why is None) if blocked is None else (blocked in why)


def test_auto_is_off_for_routed_experts():
    """An expert multiplies the tokens routed to it (fewer than 16 in a decode step, as many as the batch sends)."""
    moe, dense = family_model("gpt-oss-sinks-moe"), family_model("llama")
    assert "routed experts" in invariance_blocked(BatchInvariant.AUTO, "false", 1, "cpu", [dense, moe])
    assert invariance_blocked(BatchInvariant.AUTO, "false", 1, "cpu", [dense]) is None
    assert invariance_blocked(BatchInvariant.ON, "false", 1, "cpu", [moe]) is None  # true: the check decides


@pytest.mark.parametrize(
    "wanted, impl, expected",
    [
        (BatchInvariant.AUTO, "sdpa", Invariance.BATCHED),
        (BatchInvariant.ON, "sdpa", Invariance.BATCHED),
        (BatchInvariant.OFF, "sdpa", Invariance.OFF),
        (BatchInvariant.ON, "eager", Invariance.EACH_ROW),  # asked for and the check fails: a forward per row
        (BatchInvariant.AUTO, "eager", Invariance.OFF),  # auto never pays a forward per row: batches, and says why
    ],
)
def test_decide_invariance_follows_the_check_and_what_was_asked(wanted, impl, expected):
    model = family_model("llama")
    model.set_attn_implementation(impl)
    record_paths(model, declared_paths(model, 256))
    got, why = decide_invariance(_OneRank(), [model], torch.device("cpu"), 0, 256, wanted)
    assert got is expected
    assert (why is None) == (impl == "sdpa" or wanted is BatchInvariant.OFF)
    assert decide_invariance(_OneRank(), [model], torch.device("cpu"), 0, 256, wanted, "compile=default") == (
        Invariance.OFF,
        "compile=default",
    )


def test_the_modes_a_run_may_end_in():
    assert invariance_modes(BatchInvariant.ON, None) == (True,)
    assert invariance_modes(BatchInvariant.AUTO, None) == (True, False)
    assert invariance_modes(BatchInvariant.AUTO, "compile=default") == (False,)
    assert invariance_modes(BatchInvariant.OFF, None) == (False,)


def test_the_probe_target_covers_every_mode_the_run_may_end_in(model):
    batching = Batching(batch_size=1)  # its row budget is max_length: a token budget's is wider
    wide = Batching(token_budget=4096)
    budget = row_budget(wide, 128, attention_coefficient(model))[0]
    assert budget > 128
    assert probe_target([model], wide, 128, True, (True,)).tree_tokens == 128
    assert probe_target([model], wide, 128, True, (False,)).tree_tokens == budget
    assert probe_target([model], wide, 128, True, (True, False)).tree_tokens == budget
    assert probe_target([model], batching, 128, False, (True, False)).tree_tokens == 0
    assert probe_target([model], batching, 128, True, (True,)).cached  # a row group's prefix, even at batch size 1


def test_the_small_products_every_rank_finds_exact_are_recorded_on_every_model(model):
    record_paths(model, declared_paths(model, 256))
    record_row_sizes(model, RowSizes())
    mine = measure_row_sizes(model).exact
    decide_invariance(_OneRank(), [model], torch.device("cpu"), 0, 256, BatchInvariant.ON)
    assert row_sizes_of(model).exact == mine
    decide_invariance(_TwoRanks(), [model], torch.device("cpu"), 0, 256, BatchInvariant.ON)
    assert row_sizes_of(model).exact == mine & {4}  # what is exact on both ranks
    record_row_sizes(model, RowSizes())
