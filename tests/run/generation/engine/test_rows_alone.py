"""Continuous batching with rows attending alone (``batch_invariant=true``, :class:`~distperp_harness.run.generation.
engine.loop.Decoder` ``rows_alone``): every row's logits at every step are the same bits whatever the number of
slots, its batch-mates and the step it was admitted at, equal to decoding it in a lane of one slot; without it the
bits move with the slots (so the comparison can fail)."""

from __future__ import annotations

import pytest
import torch
from helpers import block_prompts

from distperp_harness.run.generation.engine import loop
from distperp_harness.run.generation.engine.choose import Chooser
from distperp_harness.run.generation.engine.loop import Decoder, decode_lane
from distperp_harness.run.generation.engine.scheduler import Lane, StopRule
from distperp_harness.run.generation.lanes import common_prefix

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _logits(monkeypatch, model, tokenizer, prompts, slots, rows_alone, rule, prefix=(), own=()):
    """``({(job, tokens so far): logits row}, texts)`` of one lane: each row's logits at every step it was chosen;
    ``prefix``: the lane's shared prefix (every prompt continues its cache); ``own``: each prompt's own prefix."""
    seen: dict[tuple[int, int], torch.Tensor] = {}

    class Recording(Chooser):
        def __call__(self, rows, logits):
            for i, row in enumerate(rows):
                seen[(row.job, len(row.tokens))] = logits[i].clone()
            return super().__call__(rows, logits)

    monkeypatch.setattr(loop, "Chooser", Recording)
    decoder = Decoder(model, tokenizer, CPU, rows_alone=rows_alone)
    out, stats = decode_lane(decoder, Lane(prompts, tuple(prefix), slots, None, own), rule)
    return seen, out, stats


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shared", [False, True], ids=["whole", "shared-prefix"])
def test_every_row_has_the_bits_of_a_lane_of_one_slot(
    monkeypatch, model_and_tokenizer, sample_text_path, threads, shared
):
    """Prompts prefilled whole, or continuing the lane's shared prefix (a few-shot block computed once; with rows
    alone each continuing row is prefilled in a forward of its own, so its keys are [prefix][own] with no pads)."""
    model, tokenizer = model_and_tokenizer
    prompts = block_prompts(tokenizer, sample_text_path, 7, block=shared)
    prefix = tuple(prompts[0][: common_prefix(prompts, 1)]) if shared else ()
    assert len(prefix) >= (16 if shared else 0)
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], 12)  # rows end, and slots refill, at other steps
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone, texts, _ = _logits(monkeypatch, model, tokenizer, prompts, 1, True, rule, prefix)
        for slots in (2, 3, 7):
            got, out, stats = _logits(monkeypatch, model, tokenizer, prompts, slots, True, rule, prefix)
            assert out == texts and got.keys() == alone.keys()
            assert all(torch.equal(got[k], alone[k]) for k in alone), slots
            if slots < len(prompts):  # rows were admitted at other steps as slots freed
                assert stats.prefill_forwards > -(-len(prompts) // slots)
        plain, _, _ = _logits(monkeypatch, model, tokenizer, prompts, 3, False, rule, prefix)
        assert any(not torch.equal(plain[k], alone[k]) for k in alone if k in plain)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["mistral-window", "gemma3-262k"])
def test_windowed_rows_attending_alone_keep_their_bits(monkeypatch, family, tiny_tokenizer, sample_text_path, name):
    """Sliding windows (every layer; sliding and full layer types) applied by position in each row's own mask slice:
    rows longer than the window have the bits of a lane of one slot."""
    model, tokenizer = family(name), tiny_tokenizer
    prompts = block_prompts(tokenizer, sample_text_path, 5)
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], 16)
    for prefix in ((), tuple(prompts[0][: common_prefix(prompts, 1)])):
        alone, texts, _ = _logits(monkeypatch, model, tokenizer, prompts, 1, True, rule, prefix)
        got, out, _ = _logits(monkeypatch, model, tokenizer, prompts, 3, True, rule, prefix)
        assert out == texts and all(torch.equal(got[k], alone[k]) for k in alone), len(prefix)


def test_rows_continuing_prefixes_of_their_own_keep_their_bits(monkeypatch, model_and_tokenizer, sample_text_path):
    """Batch-invariant generation's lanes: each prompt continues its own planned prefix (some none), in a forward of
    its own; every row's logits are those of a lane of one slot, whatever the slots."""
    model, tokenizer = model_and_tokenizer
    prompts = block_prompts(tokenizer, sample_text_path, 7)
    n = common_prefix(prompts, 1)
    own = [n if i % 3 else 0 for i in range(len(prompts))]
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], 12)
    alone, texts, stats = _logits(monkeypatch, model, tokenizer, prompts, 1, True, rule, own=own)
    assert stats.prefill_positions < sum(len(p) for p in prompts)  # the prefix computed once, not per row
    for slots in (2, 7):
        got, out, _ = _logits(monkeypatch, model, tokenizer, prompts, slots, True, rule, own=own)
        assert out == texts and all(torch.equal(got[k], alone[k]) for k in alone), slots
