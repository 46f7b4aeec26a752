"""The probe (:mod:`distperp_harness.run.scoring.engine.probe`): a declaration the weights contradict is refused, a
verdict it cannot reach cheaply or cannot tell from rounding is a fallback, and ranks merge to one decision."""

import dataclasses

import pytest
import torch
from helpers import family_model

from distperp_harness.model.attention import AttentionLayout, LayerAttention, OutputMap
from distperp_harness.run.scoring.engine import probe as probing
from distperp_harness.run.scoring.engine import support
from distperp_harness.run.scoring.engine.probe import ProbeRows, merge_paths, probe

CPU = torch.device("cpu")


def test_probe_rows_run_past_the_window_and_copy_the_root():
    """Paths a little longer than the span, at most max_length inputs; branches copy the root's start after a token
    of their own; the tree row holds both branches, the unshared rows one each."""
    rows = ProbeRows.build(1000, 16, 128)
    assert len(rows.tree) == 1 and rows.tree[0].packed and len(rows.paths) == 2
    assert all(16 < r.length <= 128 for r in rows.paths) and rows.root >= 18
    root = rows.paths[0].tokens()[: rows.root]
    for path in rows.paths:
        branch = path.tokens()[rows.root :]
        assert branch[1:] == root[: len(branch) - 1] and branch[0] != root[0]
    assert len(rows.units) == 2 * probing.SCORED and all(u.n_score == 1 for u in rows.units)
    short = ProbeRows.build(1000, 200, 64)  # a window longer than max_length allows: paths stay within it
    assert all(r.length <= 64 for r in short.paths)


def test_a_declared_window_the_weights_contradict_is_refused(monkeypatch):
    """The config says window 12 where the model applies 16: tree rows with the declared window disagree with the
    unshared rows, and packed rows are refused with the measured difference."""
    model = family_model("mistral-window")
    wrong = AttentionLayout((("sliding_attention", LayerAttention(window=12)),), keyed=False)
    monkeypatch.setattr(support, "declared_layout", lambda config: wrong)
    verdict = probe(model, CPU, 0, 128)
    assert "tree rows gave other log-likelihoods than unshared rows" in verdict.packed_rows
    assert verdict.cached_prefix == verdict.packed_rows and verdict.evidence["packed_difference"] > 1e-3


def test_a_missing_logit_map_is_refused_and_scoring_keeps_full_logits(monkeypatch):
    """Gemma 2's final soft-cap left out of the declared map: the head alone is not the model's logits, so the head
    runs on the full logits (exact, slower)."""
    model = family_model("gemma2-softcaps", scale=4.0)
    monkeypatch.setattr(support, "declared_output_map", lambda config: OutputMap())
    verdict = probe(model, CPU, 0, 128)
    assert "not the output head of the last hidden state" in verdict.head_only
    assert verdict.packed_rows is None  # the rows are probed on the full logits


def test_a_window_the_probe_cannot_tell_from_rounding_is_a_fallback(monkeypatch):
    model = family_model("gemma3-262k")
    monkeypatch.setattr(probing, "SENSITIVITY", 1e9)
    verdict = probe(model, CPU, 0, 128)
    assert "cannot tell its windows from rounding" in verdict.packed_rows
    assert verdict.evidence["window_effect"] > 0


def test_a_probe_over_its_budget_is_a_fallback_not_a_guess(monkeypatch):
    model = family_model("mistral-window")
    monkeypatch.setitem(probing.PROBE_BUDGET, "cpu", 10.0)
    verdict = probe(model, CPU, 0, 128)
    assert "would cost" in verdict.packed_rows and verdict.head_only is None


def test_no_window_within_max_length_needs_no_window_probe():
    """A 16-token window with max_length 16: no path is longer than the window, the layout is full attention."""
    verdict = probe(family_model("mistral-window"), CPU, 0, 16)
    assert verdict.packed_rows is None and verdict.layout.span == 0 and "window_effect" not in verdict.evidence


def test_ranks_merge_to_the_most_careful_decision():
    mine = support.ModelPaths(None, None, None, None, probed=True)
    other = dataclasses.replace(mine, packed_rows="tree rows failed on the probe (x)").to_dict()
    merged = merge_paths([mine.to_dict(), other], mine)
    assert merged.packed_rows == "tree rows failed on the probe (x) (on another rank)"
    assert merged.cached_prefix == merged.packed_rows and merged.head_only is None
    assert merge_paths([mine.to_dict(), mine.to_dict()], mine) == mine


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_recorded_paths_drive_the_engine_and_come_back_after_a_trial(impl):
    model = family_model("llama")
    model.config._attn_implementation = impl
    verdict = probe(model, CPU, 0, 64)
    support.record_paths(model, verdict)
    assert support.paths_of(model) is verdict
    with support.trying_paths(model, dataclasses.replace(verdict, head_only="trial")):
        assert support.paths_of(model).head_only == "trial"
    assert support.paths_of(model) is verdict
    assert "head only where scored" in verdict.line() and verdict.to_dict()["probed"]


def test_a_model_with_nan_logits_is_a_fallback_not_an_error_at_load():
    """Non-finite logits on the probe's own rows: every path falls back with that reason (nothing can be compared),
    and the error is left to scoring, which names the text (tests/test_bad_inputs.py)."""
    model = family_model("llama")
    with torch.no_grad():
        model.get_output_embeddings().weight[:, :] = float("nan")
    verdict = probe(model, CPU, 0, 128)
    assert verdict.head_only == verdict.packed_rows == verdict.cached_prefix == probing.NON_FINITE


def test_between_forwards_runs_between_the_probes_forwards():
    """The sharded hook (the executor's regather) runs after the whole-model forward of the head check and before
    every scoring forward of the rows: a root group an FSDP2 forward resharded is gathered again."""
    model = family_model("mistral-window")
    calls = []
    probe(model, CPU, 0, 128, between_forwards=lambda: calls.append(1))
    assert len(calls) >= 5
