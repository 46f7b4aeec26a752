"""The decode step a run picks (engines.decode_step), the fixed-shape step (eager here: what a CUDA graph records)
against the dynamic cache, one read of the device per forward, and CUDA graphs' control flow (captured once per bucket,
checked against the eager step on the first replay, off on any failure), run on CPU with a capture that records
nothing (no GPU here: what a real ``torch.cuda.CUDAGraph`` does is left to the GPU check)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from distperp_harness.run.compiling.state import CompileState
from distperp_harness.run.generation.engine.cudagraphs import GraphStep
from distperp_harness.run.generation.engine.engines import decode_step
from distperp_harness.run.generation.engine.loop import Decoder, decode_lane
from distperp_harness.run.generation.engine.sampling import warpers_for
from distperp_harness.run.generation.engine.scheduler import Lane, StopRule
from distperp_harness.run.generation.engine.step import CompiledStep, StaticStep, StepState, unsupported
from distperp_harness.run.generation.engine.transfer import counting_reads

CPU = torch.device("cpu")
BUCKET = 8


def _decode(model, tokenizer, lane, rule, static=None, **kw):
    return decode_lane(Decoder(model, tokenizer, CPU, static=static), lane, rule, **kw)


def test_the_run_picks_its_decode_step(peaked):
    model = peaked[0]
    off = CompileState(None, active=False)
    cuda = torch.device("cuda", 0)

    def pick(device=CPU, **kw):
        args = {"compiled": off, "batch_invariant": False, "grouped": False, "cuda_graphs": True, **kw}
        return decode_step(model, device, 0, **args)

    assert type(pick(cuda)[0]) is GraphStep  # built without touching CUDA: the pool comes at the first capture
    for eager in (pick(), pick(cuda, grouped=True), pick(cuda, cuda_graphs=False)):  # no graph: the dynamic cache
        assert eager[0] is None and "fixed shapes buy nothing without a graph" in eager[1]
    step, line = pick(batch_invariant=True)
    assert step is None and "batch-invariant" in line
    assert isinstance(pick(compiled=CompileState("default", active=True))[0], CompiledStep)
    for impl, model_type in (("sdpa", "mamba"), ("flash_attention_2", "llama")):  # no 4D mask: the dynamic cache
        config = SimpleNamespace(_attn_implementation=impl, model_type=model_type)
        step, line = decode_step(
            SimpleNamespace(config=config),
            cuda,
            0,
            compiled=off,
            batch_invariant=False,
            grouped=False,
            cuda_graphs=True,
        )
        assert step is None and "dynamic cache" in line


@pytest.mark.parametrize("prefix", [False, True])
def test_the_fixed_shape_step_gives_the_dynamic_engines_texts(peaked, prompts, prefix):
    """Greedy with stop strings ending rows at different steps, refill and a shared prefix; then EOS; then sampled
    rows on their seeds: the fixed-shape step's texts equal the dynamic cache's, with one read per forward."""
    model, tokenizer = peaked
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], 20)
    lane = Lane(prompts, tuple(prompts[0][:20]) if prefix else (), 3)
    dynamic, dstats = _decode(model, tokenizer, lane, rule)
    fixed, stats = _decode(model, tokenizer, lane, rule, StaticStep(model, CPU, tokenizer.pad_token_id, BUCKET))
    assert fixed == dynamic and len({len(t) for t in dynamic}) > 2
    assert stats.decode_forwards == dstats.decode_forwards and stats.prefill_forwards == dstats.prefill_forwards > 3
    for s in (stats, dstats):
        assert s.host_reads == s.prefill_forwards + s.decode_forwards
    assert stats.padded_positions > 0 == dstats.padded_positions


def test_eos_and_sampled_rows(peaked, prompts):
    model, tokenizer = peaked
    step = StaticStep(model, CPU, tokenizer.pad_token_id, BUCKET)
    common = _decode(model, tokenizer, Lane(prompts, (), 3), StopRule.of(tokenizer, [], [], 8))[0]
    eos = max({t for row in common for t in row[1:]}, key=lambda t: sum(row.count(t) for row in common))
    rule = StopRule.of(tokenizer, [], [eos], 20)  # the commonest token ends rows as EOS
    out = _decode(model, tokenizer, Lane(prompts, (), 3), rule, step)[0]
    assert out == _decode(model, tokenizer, Lane(prompts, (), 3), rule)[0]
    assert any(row[-1] == eos and len(row) < 20 for row in out)
    sampled = Lane(prompts, (), 3, list(range(300, 309)))
    warpers = warpers_for(model, {"temperature": 2.0})
    rule = StopRule.of(tokenizer, ["e"], [], 20)
    draws = _decode(model, tokenizer, sampled, rule, step, warpers=warpers)[0]
    assert draws == _decode(model, tokenizer, sampled, rule, warpers=warpers)[0]
    assert draws != _decode(model, tokenizer, Lane(prompts, (), 3), rule, step)[0]


@pytest.mark.parametrize("fixed", [True, False])
def test_one_read_of_the_device_per_forward_and_no_other(peaked, prompts, fixed):
    """Nothing in a forward (transformers' masks included) or in the loop reads the device back except the chosen
    tokens, once per prefill and once per decode step: at most one synchronisation a step on a GPU."""
    model, tokenizer = peaked
    step = StaticStep(model, CPU, tokenizer.pad_token_id, BUCKET) if fixed else None
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], 20)
    lane = Lane(prompts, tuple(prompts[0][:20]), 3)
    _decode(model, tokenizer, lane, rule, step)  # buffers allocated, prefix computed: the loop alone is counted
    with counting_reads() as reads:
        _, stats = _decode(model, tokenizer, lane, rule, step)
    assert stats.decode_forwards > 10
    assert reads.total == stats.host_reads == stats.prefill_forwards + stats.decode_forwards


@pytest.mark.parametrize("name", ["mistral-window", "gemma3-262k", "llama4-chunked-moe", "gpt-oss-sinks-moe"])
def test_the_fixed_shape_step_gives_the_dynamic_engines_texts_for_windowed_models(
    family, tiny_tokenizer, prompts, name
):
    """Sliding windows, sliding and full layer types, chunks, sinks over whole ``StaticLayer``s, each column's
    position kept beside it (also when the full cache moves left): the dynamic cache's texts, one read per forward."""
    model, tokenizer = family(name), tiny_tokenizer
    assert unsupported(model) is None
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], 20)
    lane = Lane(prompts[:7], tuple(prompts[0][:20]), 3)
    dynamic, _ = _decode(model, tokenizer, lane, rule)
    step = StaticStep(model, CPU, tokenizer.pad_token_id, BUCKET)
    _decode(model, tokenizer, lane, rule, step)  # buffers allocated: the loop alone is counted
    with counting_reads() as reads:
        fixed, stats = _decode(model, tokenizer, lane, rule, step)
    assert fixed == dynamic and len({len(t) for t in dynamic}) > 2
    assert reads.total == stats.host_reads == stats.prefill_forwards + stats.decode_forwards
    full = StopRule.of(tokenizer, [], [], 20)  # every row runs 20 tokens: the columns fill up and move left
    lane = Lane(prompts[:4] + prompts[:4][::-1], (), 3)
    assert _decode(model, tokenizer, lane, full, step)[0] == _decode(model, tokenizer, lane, full)[0]
    assert step.state.shifts > 0


class _Capture:
    """A capture that records nothing: the replay runs the step (eager) and can be told to disturb its logits."""

    def __init__(self, fail=None, disturb=False):
        self.captured, self.replays, self.fail, self.disturb = [], 0, fail, disturb

    def __call__(self, step, buffers):
        if self.fail:
            raise RuntimeError(self.fail)
        self.captured.append((buffers.slots, buffers.capacity))
        step()  # what a real capture does to the buffers: a step on empty ones

        def replay():
            self.replays += 1
            out = step()
            return out + 1e-3 if self.disturb else out

        return replay


def test_graphs_are_captured_once_per_bucket_and_checked_before_use(peaked, prompts):
    model, tokenizer = peaked
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], 20)
    capture = _Capture()
    step = GraphStep(model, CPU, tokenizer.pad_token_id, BUCKET, capture=capture)
    expected, _ = _decode(model, tokenizer, Lane(prompts, (), 3), rule)
    for lane in (Lane(prompts, (), 3), Lane(prompts[::-1], (), 3)):  # two lanes of one bucket: one capture
        out, stats = _decode(model, tokenizer, lane, rule, step)
        assert out == (expected if lane.prompts == prompts else _decode(model, tokenizer, lane, rule)[0])
    assert len(capture.captured) == 1 and step.state.graphs == [f"3x{capture.captured[0][1]}"]
    assert step.state.step is StepState.COMPILED and step.state.failure is None
    assert capture.replays == step.state.compiled_calls > stats.decode_forwards


@pytest.mark.parametrize(
    "capture", [_Capture(fail="operation not permitted when stream is capturing"), _Capture(disturb=True)]
)
def test_a_graph_that_fails_or_differs_is_dropped_for_the_eager_step(peaked, prompts, capture):
    model, tokenizer = peaked
    rule = StopRule.of(tokenizer, ["e"], [tokenizer.eos_token_id], 20)
    step = GraphStep(model, CPU, tokenizer.pad_token_id, BUCKET, capture=capture)
    out, stats = _decode(model, tokenizer, Lane(prompts, (), 3), rule, step)
    assert out == _decode(model, tokenizer, Lane(prompts, (), 3), rule)[0]
    assert step.state.step is StepState.EAGER
    assert ("capturing" if capture.fail else "differed") in step.state.failure
    assert step.state.compiled_calls == 0 and capture.replays <= 1
    assert step.state.eager_calls["compile_failed"] >= stats.decode_forwards - 1


def test_the_stop_rule_checks_a_step_in_one_batched_decode(tiny_tokenizer):
    rule = StopRule.of(tiny_tokenizer, ["e"], [7], 5)
    rows = [tiny_tokenizer.encode(t) for t in ("the", "abc", "xy", "a b c d f g")] + [[3, 7]]
    calls = []

    def batch(tails):
        calls.append(len(tails))
        return tiny_tokenizer.batch_decode(tails)

    ended = rule.ended(rows, batch)
    assert ended == [rule.done(r, tiny_tokenizer.decode) for r in rows]
    assert calls == [sum(not (r[-1] == 7 or len(r) >= 5) for r in rows)]
