"""``think_end_token``: the answer is the text after the trace (lm-eval's ``postprocess_generated_text`` for a string,
``hf``'s token rule for an id), and a stop string ends a row only after the trace (a deliberate difference from
``hf``). The pure functions first, then the stopping criterion and ``generate_until`` on the tiny model."""

from __future__ import annotations

import pytest
import torch
from helpers import make_lm

from distperp_harness.run.generation.engine.thinking import answer_of, stop_allowed, stop_hit, tokens_after_think

CASES = [
    ("<think>a\n\nb</think>\n\nThe answer is 4.\n\nQ: next", "</think>", ["\n\n", "Q:"]),
    ("no trace at all. Q: more", "</think>", ["Q:"]),
    ("x</think>first</think>  second Q: third", "</think>", ["Q:"]),
    ("plain text", None, ["t"]),
    ("trace</think>", "</think>", ["\n"]),
    ("a</think>b", "</think>", [""]),  # '' is no stop
    ("a</think>b<|im_end|>", "</think>", "<|im_end|>"),
]


@pytest.mark.parametrize("text, think_end, until", CASES)
def test_answer_of_is_lm_evals_postprocessing(text, think_end, until):
    from lm_eval.models.utils import postprocess_generated_text

    assert answer_of(text, think_end, until) == postprocess_generated_text(text, until, think_end)


def test_stops_count_only_after_the_trace():
    assert not stop_allowed("<think>reasoning\n\nmore", "</think>")
    assert not stop_hit("<think>reasoning\n\nmore", "</think>", ["\n\n"])
    assert stop_allowed("<think>r</think>", "</think>") and not stop_hit("<think>r\n\n</think>ok", "</think>", ["\n\n"])
    assert stop_hit("<think>r\n\n</think>ok\n\n", "</think>", ["\n\n"])
    assert stop_hit("no thinking\n\n", None, ["\n\n"]) and stop_allowed("anything", None)
    assert tokens_after_think([5, 7, 9, 7, 3, 4], 7) == [3, 4] and tokens_after_think([1, 2], 7) == [1, 2]


def test_a_stop_string_ends_a_row_only_after_the_trace(tiny_tokenizer):
    """Both decode paths ask the same question: slots (a StopRule whose ``allowed`` is :func:`stop_in_answer`) and
    ``model.generate`` batches (the per-row criterion of batchgen.py)."""
    import functools

    from distperp_harness.run.generation.engine.batchgen import _AnswerStops
    from distperp_harness.run.generation.engine.scheduler import StopRule
    from distperp_harness.run.generation.engine.thinking import stop_in_answer

    prompt = tiny_tokenizer.encode("Question:")
    rows = ["the trace says Q: here", "the trace says Q: here</think> answer", "trace</think> answer Q:"]
    hit = functools.partial(stop_in_answer, tiny_tokenizer, "</think>", ["Q:"])
    rule = StopRule.of(tiny_tokenizer, ["Q:"], [], 1000, allowed=hit)
    stops = _AnswerStops(hit, len(prompt))
    for text, expected in zip(rows, [False, False, True]):
        tokens = tiny_tokenizer.encode(text)
        assert stops(torch.tensor([prompt + tokens]), None).tolist() == [expected], text
        assert rule.done(tokens, tiny_tokenizer.decode) == expected, text


def _generate(lm, context, until, max_gen_toks=24):
    from lm_eval.api.instance import Instance

    kwargs = {"until": until, "max_gen_toks": max_gen_toks, "do_sample": False}
    return lm.generate_until([Instance("generate_until", {}, (context, kwargs), 0)], disable_tqdm=True)[0]


@pytest.fixture(scope="module")
def greedy(tiny_model_dir):
    """The tiny model's raw greedy continuation of a prompt (transformers' generate, one row, no stops)."""
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, AutoTokenizer

    PartialState(cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    context = "The quick brown fox"
    ids = torch.tensor([tokenizer.encode(context)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=24,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=None,
    )
    return context, out[0, ids.shape[1] :].tolist(), tokenizer


def _think_token(tokens):
    """A token id of the greedy continuation, at its last occurrence, with earlier tokens before it (a trace)."""
    for k in range(len(tokens) - 4, 2, -1):
        if tokens[k] not in tokens[k + 1 :]:
            return k, tokens[k]
    pytest.skip("no usable token in the greedy continuation")


def test_think_end_token_id_parity_with_hf(tiny_model_dir, greedy):
    """A token id as think_end_token, stop strings that do not occur: the same answer as lm-eval hf gives."""
    from lm_eval.models.huggingface import HFLM

    context, tokens, tokenizer = greedy
    _, think = _think_token(tokens)
    ours = _generate(make_lm(tiny_model_dir, f",think_end_token={think}"), context, ["ZZQZZ"])
    hf = HFLM(pretrained=str(tiny_model_dir), device="cpu", batch_size=1, think_end_token=str(think))
    expected = tokenizer.decode(tokens_after_think(tokens, think), skip_special_tokens=True).lstrip()
    assert ours == _generate(hf, context, ["ZZQZZ"]) == expected


def test_a_stop_string_inside_the_trace_does_not_end_the_row(tiny_model_dir, greedy):
    """The stop string is a piece of the trace: hf would stop there; the row continues to the answer."""
    context, tokens, tokenizer = greedy
    k, think = _think_token(tokens)
    stop = next((tokenizer.decode([t]).strip() for t in tokens[:k] if tokenizer.decode([t]).strip()), None)
    if not stop:
        pytest.skip("the trace has no printable token")
    answer = tokenizer.decode(tokens_after_think(tokens, think), skip_special_tokens=True).lstrip()
    ours = _generate(make_lm(tiny_model_dir, f",think_end_token={think}"), context, [stop])
    assert ours == answer_of(answer, None, [stop])
    trace = tokenizer.decode(tokens[:k], skip_special_tokens=True)
    assert stop in trace  # where hf's stopping criteria would have ended the row
