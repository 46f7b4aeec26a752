"""generation/step.py and static_batch.py: the compiled fixed-shape decode step gives the eager engine's texts (greedy
far from ties, sampled on the same seeds, stop strings with refill, EOS, a shared prefix, the full cache moved left),
compiles once per bucket, falls back to the eager engine when compiling fails, and takes the CUDA-graph precautions
(checked with fakes: no GPU here). One engine on the peaked tiny model (a module fixture) serves the tests."""

from __future__ import annotations

import pytest
import torch

from distperp_harness.run.compiling.state import CompileState, unique_graphs
from distperp_harness.run.generation.engine.loop import Decoder, decode_lane
from distperp_harness.run.generation.engine.sampling import warpers_for
from distperp_harness.run.generation.engine.scheduler import Lane, StopRule
from distperp_harness.run.generation.engine.step import CompiledStep, capacity_for, decode_mode, uses_cudagraphs

CPU = torch.device("cpu")
MAX_NEW = 20
BUCKET = 8
"""The tests' capacity rule: multiples of 8, so that a lane's columns fill up and move left."""


class _One:
    """The collective of one process."""

    rank, world_size, local_rank = 0, 1, 0

    def barrier(self, what):
        pass

    def all_gather_object(self, obj, what):
        return [obj]


class _Plan:
    """What :meth:`CompiledStep.prepare` reads of a lane plan."""

    def __init__(self, slots, prompts, max_new=MAX_NEW):
        self.slots, self.longest, self.max_new = slots, max(len(p) for p in prompts), max_new


@pytest.fixture(scope="module")
def engine(peaked, prompts):
    model, tokenizer = peaked
    state = CompileState("default", active=True)
    engine = CompiledStep(model, state, CPU, tokenizer.pad_token_id, bucket=BUCKET)
    engine.prepare(_One(), [_Plan(3, prompts)])
    assert engine.active and engine.state.graphs == [f"3x{capacity_for(max(map(len, prompts)), MAX_NEW, BUCKET)}"]
    return engine


def _both(engine, lane, rule, **kw):
    model, tokenizer = engine.model, None
    tokenizer = kw.pop("tokenizer")
    eager, eager_stats = decode_lane(Decoder(model, tokenizer, CPU), lane, rule, **kw)
    static, stats = decode_lane(Decoder(model, tokenizer, CPU, static=engine), lane, rule, **kw)
    return eager, eager_stats, static, stats


def test_capacity_buckets_and_modes():
    assert [capacity_for(n, 20) for n in (1, 236, 237, 1000)] == [256, 256, 512, 1024]
    assert capacity_for(101, 20, 8) == 128
    assert decode_mode("default", torch.device("cuda", 0)) == "reduce-overhead"  # compile=true on CUDA: graphs
    assert decode_mode("max-autotune", torch.device("cuda", 0)) == "max-autotune"
    assert decode_mode("default", CPU) == "default" and decode_mode("reduce-overhead", CPU) == "default"
    assert uses_cudagraphs("reduce-overhead", torch.device("cuda", 0)) and not uses_cudagraphs("default", CPU)
    assert not uses_cudagraphs("max-autotune-no-cudagraphs", torch.device("cuda", 0))


@pytest.mark.parametrize("prefix", [False, True])
def test_greedy_texts_equal_the_eager_engine_with_refill(engine, peaked, prompts, prefix):
    tokenizer = peaked[1]
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], MAX_NEW)  # "e" ends rows at different steps
    lane = Lane(prompts, tuple(prompts[0][:20]) if prefix else (), 3)
    calls = engine.state.compiled_calls
    eager, eager_stats, static, stats = _both(engine, lane, rule, tokenizer=tokenizer)
    assert static == eager and len({len(t) for t in eager}) > 2
    assert stats.prefill_forwards == eager_stats.prefill_forwards > 3  # refilled as rows ended, as eager does
    assert stats.decode_forwards == eager_stats.decode_forwards == engine.state.compiled_calls - calls
    assert stats.decode_positions == eager_stats.decode_positions == stats.generated - len(prompts)
    assert stats.padded_positions == 3 * stats.decode_forwards - stats.decode_positions > 0  # the drain
    assert stats.prefix_computed == prefix and engine.state.eager_calls["not_covered"] == 0


def test_eos_and_sampled_rows_keep_their_seeds(engine, peaked, prompts):
    model, tokenizer = peaked
    common = decode_lane(Decoder(model, tokenizer, CPU), Lane(prompts, (), 3), StopRule.of(tokenizer, [], [], 8))[0]
    eos = max(set(t for row in common for t in row[1:]), key=lambda t: sum(row.count(t) for row in common))
    rule = StopRule.of(tokenizer, [], [eos], MAX_NEW)  # the commonest token ends rows as EOS
    eager, _, static, _ = _both(engine, Lane(prompts, (), 3), rule, tokenizer=tokenizer)
    assert static == eager and any(row[-1] == eos and len(row) < MAX_NEW for row in eager)
    warpers = warpers_for(model, {"temperature": 2.0})
    seeds = list(range(300, 309))
    eager, _, static, _ = _both(
        engine,
        Lane(prompts, (), 3, seeds),
        StopRule.of(tokenizer, ["e"], [], MAX_NEW),
        tokenizer=tokenizer,
        warpers=warpers,
    )
    assert static == eager
    greedy = decode_lane(
        Decoder(model, tokenizer, CPU), Lane(prompts, (), 3), StopRule.of(tokenizer, ["e"], [], MAX_NEW)
    )[0]
    assert static != greedy  # they are draws


def test_no_recompilation_across_lanes_of_one_bucket(engine, peaked, prompts):
    tokenizer = peaked[1]
    rule = StopRule.of(tokenizer, ["\n"], [tokenizer.eos_token_id], MAX_NEW)
    graphs, calls = unique_graphs(), engine.state.compiled_calls
    longest = max(prompts, key=len)
    for part in (prompts[5:] + [longest], prompts[::-1], [longest] + prompts[:2]):  # other lanes, the same bucket
        engine.prepare(_One(), [_Plan(3, part)])  # nothing new to compile
        decode_lane(Decoder(engine.model, tokenizer, CPU, static=engine), Lane(part, (), 3), rule)
    assert unique_graphs() == graphs and engine.state.compiled_calls > calls
    assert engine.state.eager_calls["not_covered"] == 0 and len(engine.state.graphs) == 1


def test_a_full_cache_moves_left_in_place(engine, peaked, prompts):
    tokenizer = peaked[1]
    rule = StopRule.of(tokenizer, [], [], MAX_NEW)  # every row runs MAX_NEW tokens: the columns fill up
    shifts = engine.state.shifts
    lane = Lane(prompts + prompts[::-1], (), 3)  # six rounds of 20 tokens: more than the 120 columns
    eager, _, static, stats = _both(engine, lane, rule, tokenizer=tokenizer)
    assert static == eager and engine.state.shifts > shifts
    assert stats.peak_cache_positions == 3 * capacity_for(max(map(len, prompts)), MAX_NEW, BUCKET)


def test_compile_failure_decodes_with_the_eager_engine(peaked, prompts, monkeypatch):
    model, tokenizer = peaked
    monkeypatch.setenv("DISTPERP_TEST_DECODE_FAILURE", "no graphs today")
    state = CompileState("default", active=True)
    failed = CompiledStep(model, state, CPU, tokenizer.pad_token_id, bucket=BUCKET)
    failed.prepare(_One(), [_Plan(3, prompts)])
    assert not failed.active and "no graphs today" in state.to_dict()["decode"]["state"]
    rule = StopRule.of(tokenizer, ["e"], [], MAX_NEW)
    out, stats = decode_lane(Decoder(model, tokenizer, CPU, static=failed), Lane(prompts, (), 3), rule)
    assert out == decode_lane(Decoder(model, tokenizer, CPU), Lane(prompts, (), 3), rule)[0]
    assert stats.padded_positions == 0 and failed.state.compiled_calls == 0
    assert failed.state.eager_calls["compile_failed"] == stats.decode_forwards > 0


def test_cuda_graph_steps_mark_each_replay_and_clone_the_logits(engine, peaked, prompts, monkeypatch):
    """With CUDA graphs a replay's outputs live in the graph's pool and the next replay overwrites them: every step
    calls ``cudagraph_mark_step_begin`` first and returns a copy of the logits (checked with a fake replay that
    writes one output tensor every time)."""
    tokenizer = peaked[1]
    rule = StopRule.of(tokenizer, ["e"], [], MAX_NEW)
    expected = decode_lane(Decoder(engine.model, tokenizer, CPU), Lane(prompts, (), 3), rule)[0]
    real, pool, marks = engine._step, {}, []

    def replay(*args):
        out = real(*args)
        return pool.setdefault("out", torch.empty_like(out)).copy_(out)

    monkeypatch.setattr(engine, "_step", replay)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    buffers = engine.buffers_for(3, capacity_for(max(map(len, prompts)), MAX_NEW, BUCKET))
    buffers.reset()
    buffers.allowed[:, 0] = True
    ids = [5, 6, 7]
    for graphs, kept_apart in ((False, False), (True, True)):
        monkeypatch.setattr(engine, "cudagraphs", graphs)
        marks.clear()
        with torch.no_grad():
            buffers.feed(ids, [0, 0, 0])
            first = engine.run(buffers)
            saved = first.clone()
            buffers.set_length(0)
            buffers.feed([i + 1 for i in ids], [0, 0, 0])
            engine.run(buffers)
        assert torch.equal(first, saved) == kept_apart and len(marks) == (2 if graphs else 0)
    marks.clear()
    out, stats = decode_lane(Decoder(engine.model, tokenizer, CPU, static=engine), Lane(prompts, (), 3), rule)
    assert out == expected and len(marks) == stats.decode_forwards > 0


def test_the_compiled_step_of_a_windowed_model_gives_the_eager_engines_texts(family, tiny_tokenizer, prompts):
    """Sliding and full layer types (one mask each, as a mapping), windows by position: compiled once for the
    bucket, the same texts as the dynamic cache, rows refilled and the full cache moved left. Last in the module: a
    model class's first forward grows a transformers registry the other compiled steps' guards read (they would
    run eager from then on)."""
    model = family("qwen3-mixed-window")
    engine = CompiledStep(model, CompileState("default", active=True), CPU, tiny_tokenizer.pad_token_id, bucket=BUCKET)
    lane = Lane(prompts[:4] + prompts[:4][::-1], tuple(prompts[0][:20]), 3)
    engine.prepare(_One(), [_Plan(3, lane.prompts)])
    assert engine.active
    rule = StopRule.of(tiny_tokenizer, [], [], MAX_NEW)  # every row runs MAX_NEW tokens: the columns fill up
    eager, _, static, _ = _both(engine, lane, rule, tokenizer=tiny_tokenizer)
    assert static == eager and engine.state.shifts > 0 and engine.state.compiled_calls > 0
    assert engine.state.eager_calls["not_covered"] == 0
