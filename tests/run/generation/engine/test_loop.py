"""slots.py: continuous batching gives every row what generating it alone gives (greedy, far from ties), stops
each row at its own stop, refills freed slots, starts rows from a shared prefix's cache, and keeps sampled rows on
their own seeds; models with sliding windows, chunks or sinks decode in slots too (windows applied by position over
whole caches), models with recurrent layers never."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers import block_prompts, peaked_model

from distperp_harness.run.generation.engine.engines import Engine, choose_engine
from distperp_harness.run.generation.engine.loop import Decoder, decode_lane
from distperp_harness.run.generation.engine.prefill import PrefixCache
from distperp_harness.run.generation.engine.sampling import generators_for, warpers_for
from distperp_harness.run.generation.engine.scheduler import Lane, StopRule
from distperp_harness.run.scoring.engine.kvcache import CacheNotShareable
from distperp_harness.run.scoring.engine.support import paths_of, trying_paths

CPU = torch.device("cpu")
WINDOWED = ["mistral-window", "gemma3-262k", "llama4-chunked-moe", "gpt-oss-sinks-moe"]
"""Families of the ``family`` fixture: sliding windows on every layer, sliding and full layer types, chunks,
sinks (eager only)."""


@pytest.fixture(scope="module")
def peaked(tiny_model_dir, tmp_path_factory):
    """The tiny model with peaked distributions (greedy choices far from ties) and its tokenizer."""
    return peaked_model(tiny_model_dir, tmp_path_factory.mktemp("peaked_slots"))


_prompts = block_prompts


def _alone(model, tokenizer, prompt, rule):
    """``model.generate`` of one prompt (no padding), cut where the rule ends it: the reference for a row."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=rule.max_new, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )[0, len(prompt) :].tolist()
    return next((out[:n] for n in range(1, len(out) + 1) if rule.done(out[:n], tokenizer.decode)), out)


@pytest.mark.parametrize("slots, prefix", [(1, False), (3, False), (3, True), (9, True)])
def test_every_row_equals_generating_it_alone(peaked, sample_text_path, slots, prefix):
    model, tokenizer = peaked
    prompts = _prompts(tokenizer, sample_text_path)
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], 20)  # "e" ends rows at different steps
    expected = [_alone(model, tokenizer, p, rule) for p in prompts]
    assert len({len(t) for t in expected}) > 2
    shared = tuple(prompts[0][:10]) if prefix else ()
    out, stats = decode_lane(Decoder(model, tokenizer, CPU), Lane(prompts, shared, slots), rule)
    assert out == expected
    assert stats.generated == sum(len(t) for t in expected)
    # each row's first token comes from its prefill, every later one from one decode position: nothing is
    # computed for a row after it stopped
    assert stats.decode_positions == stats.generated - len(prompts)
    if 1 < slots < len(prompts):  # freed slots were refilled as rows ended, not in rounds of whole batches
        assert stats.prefill_forwards > -(-len(prompts) // slots)
    if prefix:
        whole = decode_lane(Decoder(model, tokenizer, CPU), Lane(prompts, (), slots), rule)[1]
        assert stats.prefix_computed and stats.prefill_positions < whole.prefill_positions


def test_rows_that_do_not_start_with_the_prefix_are_prefilled_whole(peaked, sample_text_path):
    model, tokenizer = peaked
    prompts = _prompts(tokenizer, sample_text_path, 6) + _prompts(tokenizer, sample_text_path, 2, block=False)
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], 12)
    lane = Lane(prompts, tuple(prompts[0][:12]), 4)
    assert [lane.uses_prefix(i) for i in range(len(prompts))] == [True] * 6 + [False] * 2
    out, _ = decode_lane(Decoder(model, tokenizer, CPU), lane, rule)
    assert out == [_alone(model, tokenizer, p, rule) for p in prompts]


def test_a_prefix_is_computed_once_per_rank_across_lanes(peaked, sample_text_path):
    model, tokenizer = peaked
    prompts = _prompts(tokenizer, sample_text_path, 6)
    rule = StopRule.of(tokenizer, ["\n"], [tokenizer.eos_token_id], 4)
    cache = PrefixCache()
    first = decode_lane(
        Decoder(model, tokenizer, CPU, prefixes=cache), Lane(prompts[:3], tuple(prompts[0][:10]), 2), rule
    )[1]
    second = decode_lane(
        Decoder(model, tokenizer, CPU, prefixes=cache), Lane(prompts[3:], tuple(prompts[0][:10]), 2), rule
    )[1]
    assert first.prefix_computed and not second.prefix_computed


def test_a_stop_string_ends_a_row_only_where_allowed(peaked, sample_text_path):
    model, tokenizer = peaked
    prompts = _prompts(tokenizer, sample_text_path, 5)
    free = StopRule.of(tokenizer, ["e"], [], 20)
    held = StopRule.of(tokenizer, ["e"], [], 20, allowed=lambda tokens: len(tokens) >= 6)  # a trace still open
    early, _ = decode_lane(Decoder(model, tokenizer, CPU), Lane(prompts, (), 2), free)
    late, _ = decode_lane(Decoder(model, tokenizer, CPU), Lane(prompts, (), 2), held)
    assert any(len(t) < 6 for t in early) and all(len(t) >= 6 for t in late)
    for tokens in late:  # the row went on past its early stop and ended at the first allowed one (or the limit)
        assert len(tokens) == 20 or "e" in tokenizer.decode(tokens[-free.lookback :])


def test_sampled_rows_keep_their_own_seeds_whatever_the_slots(tiny_model_dir, sample_text_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = _prompts(tokenizer, sample_text_path, 6, block=False)
    rule = StopRule.of(tokenizer, ["\n\n"], [tokenizer.eos_token_id], 10)
    warpers = warpers_for(model, {"temperature": 1.0})
    seeds = list(range(100, 106))
    runs = [
        decode_lane(Decoder(model, tokenizer, CPU), Lane(prompts, (), s, seeds), rule, warpers=warpers)[0]
        for s in (1, 4)
    ]
    assert runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) == len(prompts)
    # the first token of each row is a draw from its own generator on its own logits
    for prompt, seed, tokens in zip(prompts, seeds, runs[0]):
        logits = model(torch.tensor([prompt])).logits[:, -1].float()
        assert (
            torch.multinomial(torch.softmax(logits[0], -1), 1, generator=generators_for([seed], CPU)[0]).item()
            == tokens[0]
        )
    other = decode_lane(
        Decoder(model, tokenizer, CPU), Lane(prompts, (), 4, [s + 1 for s in seeds]), rule, warpers=warpers
    )[0]
    assert sum(a != b for a, b in zip(other, runs[0])) >= len(prompts) - 1


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_models_decode_in_slots_with_generates_texts(family, tiny_tokenizer, sample_text_path, name, prefix):
    """Slots (not ``model.generate``) decode rows longer than the window or chunk, refilled as rows end, from a
    shared prefix's cache or not, and every row is ``model.generate``'s greedy alone; the same lane without the
    windows gives other texts (the windows are in play)."""
    model, tokenizer = family(name), tiny_tokenizer
    prompts = _prompts(tokenizer, sample_text_path, 7)
    paths = paths_of(model)
    assert paths.probed and paths.layout is not None and 0 < paths.layout.span < min(map(len, prompts))
    assert choose_engine(model, {"do_sample": False}) == (Engine.SLOTS, None)
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], 20)
    expected = [_alone(model, tokenizer, p, rule) for p in prompts]
    assert len({len(t) for t in expected}) > 2
    lane = Lane(prompts, tuple(prompts[0][:20]) if prefix else (), 3)
    out, stats = decode_lane(Decoder(model, tokenizer, CPU), lane, rule)
    assert out == expected
    # rows ended at their own stops and freed slots were refilled: fewer positions than batches of 3 rows waiting
    # for each batch's last (model.generate), and none computed after a row stopped
    batches = sum(len(part) * (max(map(len, part)) - 1) for part in (expected[:3], expected[3:6], expected[6:]))
    assert stats.generated - len(prompts) == stats.decode_positions < batches
    assert stats.prefix_computed == prefix
    with trying_paths(model, dataclasses.replace(paths, layout=paths.layout.without_rules())):
        assert decode_lane(Decoder(model, tokenizer, CPU), lane, rule)[0] != expected


def test_a_windowed_model_nobody_probed_decodes_in_slots_on_its_declarations(family, tiny_tokenizer, sample_text_path):
    model, tokenizer = family("cohere2-window", probed=False), tiny_tokenizer
    assert not paths_of(model).probed and choose_engine(model, {}) == (Engine.SLOTS, None)
    prompts = _prompts(tokenizer, sample_text_path, 5)
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], 16)
    out, _ = decode_lane(Decoder(model, tokenizer, CPU), Lane(prompts, tuple(prompts[0][:20]), 2), rule)
    assert out == [_alone(model, tokenizer, p, rule) for p in prompts]


def test_windows_stay_on_generate_batches_where_the_model_refuses_the_masks(family, tiny_tokenizer):
    """A probe that refused distperp's masks or a whole cache, or an attention implementation that takes no dense
    mask: ``model.generate`` batches, saying why; ``decode_lane`` refuses before any forward."""
    model = family("mistral-window")
    paths = paths_of(model)
    refusals = {
        "packed rows refused on the probe": dataclasses.replace(paths, packed_rows="packed rows refused on the probe"),
        "no cached prefix on the probe": dataclasses.replace(paths, cached_prefix="no cached prefix on the probe"),
    }
    lane = Lane([[5, 6, 7]], (), 1)
    for why, refused in refusals.items():
        with trying_paths(model, refused):
            engine, reason = choose_engine(model, {})
            assert engine is Engine.GENERATE and why in reason and "4D masks" in reason
            with pytest.raises(CacheNotShareable, match=why):
                decode_lane(Decoder(model, tiny_tokenizer, CPU), lane, StopRule.of(tiny_tokenizer, [], [], 2))
    flex = torch.nn.Module()
    flex.config = copy.copy(model.config)
    flex.config._attn_implementation = "flex_attention"
    assert "'flex_attention' does not take" in (choose_engine(flex, {})[1] or "")


@pytest.mark.parametrize("name", ["qwen3-next-linear", "falcon-h1-ssm"])
def test_recurrent_layers_stay_on_generate_batches(family, tiny_tokenizer, name):
    model = family(name, probed=False)
    engine, reason = choose_engine(model, {"do_sample": False})
    assert engine is Engine.GENERATE and "LinearAttention" in reason and "cannot be edited row by row" in reason
    with pytest.raises(CacheNotShareable, match="LinearAttention"):
        decode_lane(
            Decoder(model, tiny_tokenizer, CPU), Lane([[5, 6, 7]], (), 1), StopRule.of(tiny_tokenizer, [], [], 2)
        )
