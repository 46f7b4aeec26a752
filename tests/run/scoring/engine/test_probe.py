"""The probe (:mod:`distperp_harness.run.scoring.engine.probe`): decided on a float64 miniature at the run's shapes;
a declaration the model contradicts is refused, a miniature that cannot tell a wrong mask from rounding shares
nothing, the real weights confirm the head's map, one decision per architecture, ranks merge to one decision."""

import dataclasses

import pytest
import torch
from helpers import family_model

from distperp_harness.model.attention import AttentionLayout, LayerAttention, OutputMap
from distperp_harness.model.lengths import LengthRule
from distperp_harness.run.scoring.engine import probe as probing
from distperp_harness.run.scoring.engine import probe_checks, support
from distperp_harness.run.scoring.engine.probe import merge_paths, probe
from distperp_harness.run.scoring.engine.probe_cases import Target

CPU = torch.device("cpu")


def test_a_declared_window_the_model_does_not_apply_is_refused(monkeypatch):
    """The config says window 12 where the model applies 16: tree rows with the declared window disagree with the
    unshared rows, and packed rows are refused with the measured difference."""
    model = family_model("mistral-window")
    wrong = AttentionLayout((("sliding_attention", LayerAttention(window=12)),), keyed=False)
    monkeypatch.setattr(support, "declared_layout", lambda config: wrong)
    verdict = probe(model, CPU, 0, 128)
    assert "nats from the unshared rows" in verdict.packed_rows and verdict.cached_prefix == verdict.packed_rows
    assert verdict.evidence["largest_difference"]["tree"] > 1e-3 > verdict.evidence["tolerance"]


def test_a_missing_logit_map_is_refused_and_scoring_keeps_full_logits(monkeypatch):
    """Gemma 2's final soft-cap left out of the declared map: the head alone is not the model's logits, so the head
    runs on the full logits (exact, slower); the rows are still probed, on the full logits."""
    model = family_model("gemma2-softcaps", scale=4.0)
    monkeypatch.setattr(support, "declared_output_map", lambda config: OutputMap())
    verdict = probe(model, CPU, 0, 128)
    assert "not the output head of the last hidden state" in verdict.head_only
    assert verdict.packed_rows is None


def test_a_scale_in_the_weights_alone_is_found_by_the_real_weights(monkeypatch):
    """The miniature agrees with the declarations, but the loaded head's output is scaled before the logits (as a
    scale kept in the weights would be): the real-weights check refuses the head alone."""
    model = family_model("llama")
    real_forward = model.forward

    def scaled(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        out.logits = out.logits * 1.5
        return out

    monkeypatch.setattr(model, "forward", scaled)
    verdict = probe(model, CPU, 0, 64)
    assert "not its head's output" in verdict.head_only and verdict.packed_rows is None


@pytest.mark.parametrize("scale", [1.0, 1.5])
def test_a_wide_head_is_checked_on_rows_spread_over_it_and_left_whole(monkeypatch, scale):
    """A head wider than NARROW_HEAD computes that many of its rows during the real weights' forward: the map is
    still checked (a scale found), and the head's own weight (tied to the embeddings) is back afterwards."""
    monkeypatch.setattr(probe_checks, "NARROW_HEAD", 16)
    model = family_model("llama")
    head, weight = model.get_output_embeddings(), model.get_output_embeddings().weight
    rows = probe_checks._narrow_rows(head)
    assert rows is not None and len(rows) == 16 and rows[0] == 0 and rows[-1] == weight.shape[0] - 1
    real_forward = model.forward

    def scaled(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        out.logits = out.logits * scale
        return out

    monkeypatch.setattr(model, "forward", scaled)
    why, evidence = probe_checks.head_map(model, CPU, OutputMap(), pad=0)
    assert head.weight is weight and head.out_features == weight.shape[0]
    assert evidence["padding_relative_difference"] <= probe_checks.PAD_TOLERANCE[torch.float32]
    if scale == 1.0:
        assert why is None and evidence["head_rows_checked"] == 16
    else:  # the narrowed forward fails, and so does the whole head's, which decides
        assert "not its head's output" in why and "head_rows_checked" not in evidence


def test_a_miniature_that_cannot_tell_a_wrong_mask_from_rounding_shares_nothing(monkeypatch):
    monkeypatch.setattr(probe_checks, "SENSITIVITY", 1e12)
    verdict = probe(family_model("cohere2-window"), CPU, 0, 128)
    assert "cannot tell a wrong mask from rounding" in verdict.packed_rows
    assert verdict.lengths.exact_above == 0 and verdict.evidence["sensitivity"] > 1e-3


def test_without_a_miniature_float32_weights_are_probed_and_narrower_ones_share_nothing(monkeypatch):
    from distperp_harness.model import miniature

    monkeypatch.setattr(miniature, "build_miniature", lambda *a, **k: "no miniature (the test's)")
    verdict = probe(family_model("llama"), CPU, 0, 64)
    assert verdict.packed_rows is None and verdict.evidence["probed_on"] == "the model's own weights"
    narrow = probe(family_model("llama", dtype=torch.bfloat16), CPU, 0, 64)
    assert "cannot tell a wrong mask from rounding" in narrow.packed_rows and narrow.lengths.exact_above == 0
    monkeypatch.setitem(probing.PROBE_BUDGET, "cpu", 10.0)
    assert "would cost" in probe(family_model("mistral-window"), CPU, 0, 64).packed_rows


def test_a_window_one_short_of_max_length_is_probed_with_forwards():
    """A 15-token window with max_length 16 hides one key of the longest paths: the probe runs its cases there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mistral", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=15,
    )  # fmt: skip
    verdict = probe(AutoModelForCausalLM.from_config(config).eval(), CPU, 0, Target(16, 16))
    assert verdict.layout.span == 15
    assert verdict.packed_rows is None and "tree" in verdict.evidence["largest_difference"]


def test_trees_wider_than_a_models_column_table_fall_back_to_trees_as_wide_as_a_path():
    """GPT-Neo's causal mask is a buffer of max_position_embeddings columns: a tree row wider fails inside the model,
    one as wide as a path is exact (its global layers mask by column, which a tree keeps)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gpt_neo", vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64,
        attention_types=[[["global"], 2]],
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    verdict = probe(model, CPU, 0, Target(64, 256))
    assert verdict.packed_rows is None and verdict.tree_tokens == 64
    assert "failed" in verdict.evidence["wider_trees"]


def test_an_architecture_is_decided_once():
    """A second model of one architecture (another checkpoint of a series) reuses the miniature's verdict; the real
    weights' head check runs for each."""
    first = probe(family_model("llama", seed=0), CPU, 0, 64)
    second = probe(family_model("llama", seed=1), CPU, 0, 64)
    assert "decided_before" not in first.evidence and second.evidence["decided_before"]
    assert "head_relative_difference" in second.evidence
    other = probe(family_model("mistral-window"), CPU, 0, 64)
    assert "decided_before" not in other.evidence


def test_ranks_merge_to_the_most_careful_decision():
    mine = support.ModelPaths(None, None, None, None, probed=True, tree_tokens=512)
    other = dataclasses.replace(
        mine, packed_rows="tree rows failed on the probe (x)", lengths=LengthRule((32,), None, ("side",))
    ).to_dict()
    merged = merge_paths([mine.to_dict(), other], mine)
    assert merged.packed_rows == "tree rows failed on the probe (x) (on another rank)"
    assert merged.cached_prefix == merged.packed_rows and merged.head_only is None
    assert merged.lengths.sides == (32,) and merged.tree_tokens is None
    narrower = dataclasses.replace(mine, tree_tokens=256).to_dict()
    assert merge_paths([mine.to_dict(), narrower], mine).tree_tokens == 256


def test_alibi_stored_in_bfloat16_is_decided_in_float64_and_refused():
    """MPT's ALiBi bias reads column distance, so tree rows are wrong; in bfloat16 (how mpt-7b is stored) a tolerance
    of bfloat16 rounding let them through. The float64 miniature decides, with float64's tolerance."""
    from transformers import AutoModelForCausalLM

    from distperp_harness.commands.families import published_config

    model = AutoModelForCausalLM.from_config(published_config("mpt")).to(torch.bfloat16).eval()
    verdict = probe(model, CPU, 0, Target(96, 192))
    assert "nats from the unshared rows" in verdict.packed_rows
    assert verdict.evidence["tolerance"] < 1e-3 < verdict.evidence["largest_difference"]["tree"]


def test_a_model_that_reads_columns_after_a_position_is_refused():
    """BERT registered as a causal LM without ``is_decoder`` attends both ways: every forward distperp runs is
    right-padded to 16 positions at least, which would move its scores. Refused in one line, not scored wrong."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from distperp_harness.errors import InputError

    config = AutoConfig.for_model(
        "bert", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    with pytest.raises(InputError, match="change when padding columns instead of tokens follow the row"):
        probe(AutoModelForCausalLM.from_config(config).eval(), CPU, 0, 64)


def test_a_model_whose_short_rows_move_when_padded_is_refused(monkeypatch):
    """CPM-Ant attends both ways (its mask is all ones): its logits move when padding follows a row, on the real
    weights; and on the float64 miniature, a row of 10 tokens right-padded to 16 positions as every forward of
    distperp is gives other scores than alone (the check that remains where the real weights hide it). Refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from distperp_harness.errors import InputError

    config = AutoConfig.for_model(
        "cpmant", vocab_size=300, hidden_size=32, num_attention_heads=2, dim_head=16, dim_ff=64, num_hidden_layers=1
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(InputError, match="change when padding columns instead of tokens follow the row"):
        probe(model, CPU, 0, 64)
    monkeypatch.setattr(probing, "padding_refusal", lambda model, evidence: None)
    with pytest.raises(InputError, match="a row of 10 tokens alone, right-padded gave"):
        probe(model, CPU, 0, 64)
