"""generate.py: greedy generation from a shared prefix's KV cache equals generation without it (sdpa and eager)
and lm-eval ``hf``'s texts; sampled requests are seeded by lm-eval's seed and their own content, not by slots,
order, rank or world size, and leave the global RNG alone; lanes are resumable; ``batch_size=auto`` sizes slots
for the task's ``max_gen_toks``; lanes that slots cannot serve run as ``model.generate`` batches.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import sharpened_model

from distperp_harness.run.execution.executor import Executor, Forwards
from distperp_harness.run.generation.generate import generate
from distperp_harness.run.generation.setup import MIN_SHARED_TOKENS, NO_SHARING, GenerationSetup

SAMPLED = {"until": ["\n\n"], "max_gen_toks": 10, "do_sample": True, "temperature": 1.0}
GREEDY = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}


@pytest.fixture(scope="module")
def peaked_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with peaked distributions, so greedy choices are far from ties."""
    return sharpened_model(tiny_model_dir, tmp_path_factory.mktemp("peaked"), scale=4.0)


@pytest.fixture(scope="module")
def collective():
    from distperp_harness.distributed.collective import AccelerateCollective

    return AccelerateCollective(60, cpu=True)


def _load(model_dir, attn="sdpa"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def _setup(model, tokenizer, collective, rows=4, **kw):
    executor = Executor(collective, Forwards(score=None), device=torch.device("cpu"))
    return GenerationSetup(
        model=model,
        tokenizer=tokenizer,
        executor=executor,
        device=torch.device("cpu"),
        max_length=128,
        max_gen_toks=12,
        add_bos_token=None,
        rows_for=lambda length: rows,
        **kw,
    )


def _fewshot_prompts(sample_text_path, count=6):
    """A fixed few-shot block (~45 tokens) and ``count`` questions of different lengths after it (< 100 tokens)."""
    words = sample_text_path.read_text(encoding="utf-8").split()
    prefix = "Examples:\n" + " ".join(words[:16]) + "\nQ: " + " ".join(words[16:20]) + "\nA:"
    return [prefix + " " + " ".join(words[100 + 13 * i : 100 + 13 * i + 2 + 2 * i]) for i in range(count)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_from_a_shared_prefix_equals_left_padding(peaked_dir, collective, sample_text_path, attn):
    model, tokenizer = _load(peaked_dir, attn)
    prompts = _fewshot_prompts(sample_text_path)
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    assert len(set(lengths)) > 2  # pads between the prefix and the suffixes
    assert min(lengths) - 1 > MIN_SHARED_TOKENS and max(lengths) <= 128 - 12
    args = [(p, dict(GREEDY)) for p in prompts]
    shared_calls, alone_calls = [], []
    shared = generate(_setup(model, tokenizer, collective), args, calls=shared_calls)
    alone = generate(_setup(model, tokenizer, collective, min_shared_tokens=NO_SHARING), args, calls=alone_calls)
    assert shared == alone and len(set(shared)) > 1 and all(shared)
    call, plain = shared_calls[0], alone_calls[0]
    assert call.shared_lanes == call.lanes == 1 and plain.shared_lanes == 0
    assert call.shared_tokens_min_max[0] > MIN_SHARED_TOKENS and call.prefixes_computed == 1
    assert call.prompt_tokens == plain.prompt_tokens == sum(lengths)
    assert call.prefill_positions < 0.6 * plain.prefill_positions  # the block once, not once per row


def test_sampling_ignores_batch_size_and_order_and_follows_the_seed(tiny_model_dir, collective, sample_text_path):
    model, tokenizer = _load(tiny_model_dir)
    prompts = _fewshot_prompts(sample_text_path) + ["The river", "Once upon a time"]
    args = [(p, dict(SAMPLED)) for p in prompts]
    ids = [("task", i, 0) for i in range(len(args))]
    state = torch.get_rng_state()
    batched = generate(_setup(model, tokenizer, collective, rows=4, seed=0), args, ids)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    single = generate(_setup(model, tokenizer, collective, rows=1, seed=0), args, ids)
    order = list(reversed(range(len(args))))
    reordered = generate(
        _setup(model, tokenizer, collective, rows=3, seed=0), [args[i] for i in order], [ids[i] for i in order]
    )
    assert batched == single == [reordered[order.index(i)] for i in range(len(args))]
    other_seed = generate(_setup(model, tokenizer, collective, rows=4, seed=1), args, ids)
    assert sum(a != b for a, b in zip(batched, other_seed)) >= len(args) - 1
    greedy = generate(_setup(model, tokenizer, collective), [(p, dict(GREEDY)) for p in prompts])
    assert batched != greedy


def test_repeats_and_documents_sample_independently(tiny_model_dir, collective):
    model, tokenizer = _load(tiny_model_dir)
    arg = ("Once upon a time", dict(SAMPLED))
    # lm-eval repeats one Instance `repeats` times; two documents may hold the same prompt
    first, second, other_doc = generate(
        _setup(model, tokenizer, collective, seed=3), [arg, arg, arg], [("t", 0, 0), ("t", 0, 0), ("t", 1, 0)]
    )
    assert len({first, second, other_doc}) == 3
    again = generate(_setup(model, tokenizer, collective, rows=1, seed=3), [arg], [("t", 0, 0)])
    assert again == [first]


def test_sampling_without_a_temperature_uses_the_models_and_says_so(tiny_model_dir, collective, caplog):
    import logging

    model, tokenizer = _load(tiny_model_dir)
    kwargs = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": True}
    with caplog.at_level(logging.INFO, logger="distperp_harness"):
        logging.getLogger("distperp_harness").addHandler(caplog.handler)
        out = generate(_setup(model, tokenizer, collective, seed=0), [("The river", kwargs)], [("t", 0, 0)])
        logging.getLogger("distperp_harness").removeHandler(caplog.handler)
    at_one = generate(_setup(model, tokenizer, collective, seed=0), [("The river", kwargs)], [("t", 0, 0)])
    assert out == at_one and any("without a temperature" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="temperature > 0"):
        generate(_setup(model, tokenizer, collective), [("The river", dict(kwargs, temperature=0.0))])


def test_the_lm_reads_lm_evals_torch_seed_and_samples_each_repeat(tiny_model_dir):
    from helpers import make_lm
    from lm_eval.api.instance import Instance

    lm = make_lm(tiny_model_dir, ",max_length=128", {"batch_size": 4})
    inst = Instance("generate_until", {}, ("Once upon a time", dict(SAMPLED)), 0, metadata=("t", 0, 2))
    with torch.random.fork_rng(devices=[]):
        runs = {}
        for seed in (5, 5, 6):
            torch.manual_seed(seed)  # as lm-eval's --seed does before the run
            runs.setdefault(seed, []).append(lm.generate_until([inst, inst], disable_tqdm=True))
    (a, b), (c,) = runs[5], runs[6]
    assert a == b and a[0] != a[1] and c != a
    record = lm.stats.calls[-1]
    assert record.kind == "generate_until" and record.seed == 6 and record.jobs == 2


def test_a_model_slots_do_not_serve_runs_generate_batches(peaked_dir, collective, sample_text_path, monkeypatch):
    from distperp_harness.run.generation.engine import engines

    model, tokenizer = _load(peaked_dir)
    args = [(p, dict(GREEDY)) for p in _fewshot_prompts(sample_text_path)]
    calls = []
    expected = generate(_setup(model, tokenizer, collective), args, calls=calls)
    assert calls[0].engines == ["slots"]
    monkeypatch.setattr(engines, "slots_refused", lambda model: "its LinearAttentionLayer cache cannot be edited")
    assert generate(_setup(model, tokenizer, collective), args, calls=calls) == expected
    assert calls[1].engines == ["generate"] and calls[1].decode_positions >= calls[0].decode_positions


@pytest.mark.parametrize("name", ["mistral-window", "gemma3-262k", "llama4-chunked-moe", "gpt-oss-sinks-moe"])
def test_windowed_models_give_lm_evals_hf_texts_in_slots(family, tiny_tokenizer, sample_text_path, tmp_path, name):
    """Sliding windows, sliding and full layer types, chunks, sinks: ``--model distperp`` (its paths probed at load)
    decodes the few-shot prompts, all longer than the window, in slots from the shared block's cache, and gives the
    greedy texts of ``--model hf`` at the same batch size."""
    from helpers import make_lm
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    family(name, probed=False).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    prompts = _fewshot_prompts(sample_text_path)
    kwargs = {"until": ["e"], "max_gen_toks": 12, "do_sample": False}
    requests = [Instance("generate_until", {}, (p, dict(kwargs)), i) for i, p in enumerate(prompts)]
    expected = HFLM(pretrained=str(tmp_path), batch_size=3, device="cpu", max_length=128).generate_until(
        requests, disable_tqdm=True
    )
    lm = make_lm(tmp_path, ",max_length=128", {"batch_size": 3})
    assert lm.generate_until(requests, disable_tqdm=True) == expected and len(set(expected)) > 2
    call = lm.stats.calls[-1]
    assert call.engines == ["slots"] and call.shared_lanes == 1
    assert call.decode_positions == call.generated - len(prompts)


@pytest.mark.parametrize("name", ["qwen3-next-linear", "falcon-h1-ssm"])
def test_recurrent_layers_run_generate_batches_and_say_why(
    family, tiny_tokenizer, collective, sample_text_path, caplog, monkeypatch, name
):
    import logging

    from distperp_harness.run.generation.engine import engines

    monkeypatch.setattr(engines, "_FALLBACKS", set())  # each reason is said once per process
    model, tokenizer = family(name, probed=False), tiny_tokenizer
    args = [(p, dict(GREEDY, max_gen_toks=4)) for p in _fewshot_prompts(sample_text_path, 3)]
    calls = []
    with caplog.at_level(logging.INFO, logger="distperp_harness"):
        logging.getLogger("distperp_harness").addHandler(caplog.handler)
        texts = generate(_setup(model, tokenizer, collective), args, calls=calls)
        logging.getLogger("distperp_harness").removeHandler(caplog.handler)
    assert calls[0].engines == ["generate"] and len(texts) == 3
    assert any(
        "LinearAttention" in r.getMessage()
        and "cannot be edited row by row: lanes run as model.generate" in r.getMessage()
        for r in caplog.records
    )


def test_generate_batches_of_a_windowed_model_are_left_padded(family, tiny_tokenizer, collective, sample_text_path):
    """``model.generate`` lays windows by column: a windowed model's batches (here: generation arguments slots do
    not take) are left-padded rows, no pads between a shared block and a row's own tokens, and give the slots'
    texts."""
    model = family("mistral-window")
    args = [(p, dict(GREEDY, until=["e"])) for p in _fewshot_prompts(sample_text_path)]
    calls = []
    slots = generate(_setup(model, tiny_tokenizer, collective, rows=3), args, calls=calls)
    neutral = [(p, dict(kw, repetition_penalty=1.0)) for p, kw in args]  # neutral, but not a slots argument
    batches = generate(_setup(model, tiny_tokenizer, collective, rows=3), neutral, calls=calls)
    assert batches == slots and len(set(slots)) > 2
    assert calls[0].engines == ["slots"] and calls[0].shared_lanes == 1
    assert calls[1].engines == ["generate"] and calls[1].prefill_positions >= calls[1].prompt_tokens  # no block once


def test_arguments_slots_do_not_decode_run_generate_batches(peaked_dir, collective, sample_text_path):
    model, tokenizer = _load(peaked_dir)
    prompts = _fewshot_prompts(sample_text_path, 3)
    calls = []
    penalized = generate(
        _setup(model, tokenizer, collective), [(p, dict(GREEDY, repetition_penalty=1.3)) for p in prompts], calls=calls
    )
    assert calls[0].engines == ["generate"] and all(penalized)


@pytest.mark.parametrize("rows_alone", [False, True])
def test_generate_batches_hold_one_row_where_rows_attend_alone(
    peaked_dir, collective, sample_text_path, monkeypatch, rows_alone
):
    """``batch_invariant=true`` (``rows_alone``): a lane that runs as ``model.generate`` batches (arguments slots do
    not decode) runs them one row each, since ``model.generate``'s batched rows do not attend alone."""
    from distperp_harness.run.generation import lane_texts

    model, tokenizer = _load(peaked_dir)
    prompts = _fewshot_prompts(sample_text_path, 3)
    sizes: list[int] = []
    real = lane_texts.generate_batch

    def counted(model, tokenizer, device, prompts, *args, **kwargs):
        sizes.append(len(prompts))
        return real(model, tokenizer, device, prompts, *args, **kwargs)

    monkeypatch.setattr(lane_texts, "generate_batch", counted)
    setup = _setup(model, tokenizer, collective, rows_alone=rows_alone, min_shared_tokens=NO_SHARING)
    texts = generate(setup, [(p, dict(GREEDY, repetition_penalty=1.3)) for p in prompts])
    assert all(texts) and sum(sizes) == len(prompts)
    assert (max(sizes) == 1) == rows_alone


def test_texts_equal_lm_evals_hf(peaked_dir):
    """Greedy texts of ``--model distperp`` and ``--model hf`` on the same prompts, arguments and batch size (the
    peaked model keeps greedy choices far from ties); each row stops at its own stop string or EOS."""
    from helpers import make_lm
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    words = [
        "the",
        "river",
        "flows",
        "into",
        "the",
        "sea",
        "and",
        "the",
        "lighthouse",
        "keeper",
        "lit",
        "the",
        "lamps",
        "while",
        "the",
        "old",
        "mill",
        "turned",
        "slowly",
        "in",
        "the",
        "wind",
    ]
    prompts = [" ".join(words[i : i + 3 + i % 7]) for i in range(14)]
    kwargs = {"until": ["e", "\n"], "max_gen_toks": 12, "do_sample": False}
    requests = [Instance("generate_until", {}, (p, dict(kwargs)), i) for i, p in enumerate(prompts)]
    hf = HFLM(pretrained=str(peaked_dir), batch_size=3, device="cpu", max_length=128)
    expected = hf.generate_until(requests, disable_tqdm=True)
    lm = make_lm(peaked_dir, ",max_length=128", {"batch_size": 3})
    assert lm.generate_until(requests, disable_tqdm=True) == expected
    call = lm.stats.calls[-1]
    assert call.engines == ["slots"] and call.decode_positions == call.generated - len(prompts)


def test_finished_lanes_are_saved_and_reused_by_a_rerun(peaked_dir, tmp_path, sample_text_path):
    from helpers import make_lm
    from lm_eval.api.instance import Instance

    prompts = _fewshot_prompts(sample_text_path, 6) + ["The river", "Once upon a time"]
    requests = [Instance("generate_until", {}, (p, dict(GREEDY)), i) for i, p in enumerate(prompts)]
    args = f",max_length=128,resume_dir={tmp_path}"
    first = make_lm(peaked_dir, args, {"batch_size": 1})  # 1 slot: lanes of 4 jobs, so several files
    texts = first.generate_until(requests, disable_tqdm=True)
    lanes = first.stats.calls[-1].lanes
    assert lanes >= 2 and first.store.report()["saved"] == lanes
    files = sorted(tmp_path.glob("*.lane.json"))
    assert len(files) == lanes
    files[0].write_text(files[0].read_text().replace('"texts": ["', '"texts": ["x'))  # changed after saving
    again = make_lm(peaked_dir, args, {"batch_size": 1})
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("distperp_harness.run.generation.generate")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # the rest of the suite may have left the package's logger at WARNING
    try:
        assert again.generate_until(requests, disable_tqdm=True) == texts
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    report = again.store.report()
    assert report["reused"] == lanes - 1 and report["recomputed_corrupt"] == 1 and report["saved"] == 1
    assert again.stats.calls[-1].lanes_computed == 1
    assert [m[m.index("resume_dir:") :] for m in said if "resume_dir:" in m] == [
        f"resume_dir: generate_until: reused {lanes - 1} of {lanes} lanes saved in {tmp_path}, computed 1 "
        "(saved there for a rerun)"
    ]


def test_auto_slots_hold_the_kv_cache_of_the_tasks_new_tokens(tiny_model_dir, tmp_path):
    """``batch_size=auto``: a task asking for 1,280 new tokens gets the slots whose KV caches fit the room the
    budget was sized for, fewer than a task asking for 16; the cache never held more than that. (A copy of the tiny
    model whose config allows 1,400 positions: a longer max_length than a model's positions is refused.)"""
    import json
    import shutil
    from pathlib import Path

    from helpers import make_lm
    from lm_eval.api.instance import Instance

    from distperp_harness.model.memory import activation_bytes_per_token, kv_cache_bytes_per_token
    from distperp_harness.run.budget import generation_rows

    longer = Path(shutil.copytree(tiny_model_dir, tmp_path / "longer"))
    config = json.loads((longer / "config.json").read_text())
    (longer / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1400}))
    lm = make_lm(longer, ",max_length=1400,max_batch_size=64", {"batch_size": "auto"})
    act, kv = activation_bytes_per_token(lm.model, lm.max_length), kv_cache_bytes_per_token(lm.model)
    prompt = "Once upon a time"
    length = len(lm.tok_encode(prompt)) + 1280
    slots = generation_rows(lm.batching, length, activation_bytes=act, kv_bytes=kv)
    assert slots < generation_rows(lm.batching, length - 1280 + 16, activation_bytes=act, kv_bytes=kv)
    kwargs = {"until": ["never stops here"], "max_gen_toks": 1280, "do_sample": False}
    requests = [Instance("generate_until", {}, (f"{prompt} {i}", dict(kwargs)), i) for i in range(slots + 1)]
    lm.generate_until(requests, disable_tqdm=True)
    call = lm.stats.calls[-1]
    assert call.slots_max == slots and call.generated >= 1280
    # every row's cache spans at most its prompt and its new tokens, so the slots' caches fit the room
    assert 0 < call.peak_cache_positions * kv <= lm.batching.token_budget * act


def test_share_prefix_false_and_claim_false_apply_to_generation(peaked_dir, sample_text_path):
    from helpers import make_lm
    from lm_eval.api.instance import Instance

    requests = [
        Instance("generate_until", {}, (p, dict(GREEDY)), i)
        for i, p in enumerate(_fewshot_prompts(sample_text_path, 4))
    ]
    on = make_lm(peaked_dir, ",max_length=128", {"batch_size": 4})
    off = make_lm(peaked_dir, ",max_length=128,share_prefix=false,claim=false", {"batch_size": 4})
    assert on.generate_until(requests, disable_tqdm=True) == off.generate_until(requests, disable_tqdm=True)
    assert on.stats.calls[-1].shared_lanes == 1 and off.stats.calls[-1].shared_lanes == 0
    assert off.stats.calls[-1].claiming == "static"


def test_reference_measures_the_quantized_models_own_generations(peaked_dir):
    """``reference=base`` on a generation task: the int8 model's answers scored by both models; the recorded KL
    and top-1 agreement equal a float64 computation along the same tokens."""
    from helpers import make_lm
    from lm_eval.api.instance import Instance

    lm = make_lm(peaked_dir, ",max_length=128,dtype=float32,quantize=int8,reference=base", {"batch_size": 2})
    prompts = ["The river flows into the", "Once upon a time there", "A B C D E", "The lighthouse keeper lit"]
    kwargs = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    requests = [
        Instance("generate_until", {}, (p, dict(kwargs)), 0, metadata=("gen_task", i, 1)) for i, p in enumerate(prompts)
    ]
    texts = lm.generate_until(requests, disable_tqdm=True)
    entry = lm.comparison.entries()["gen_task"]
    kl_sum, agree, count = 0.0, 0, 0
    for prompt, text in zip(prompts, texts):
        ctx, cont = lm._encode_pair(prompt, text)
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(ids).logits[0].double(), -1)[len(ctx) - 1 : -1]
            ref = torch.log_softmax(lm.reference(ids).logits[0].double(), -1)[len(ctx) - 1 : -1]
        kl_sum += float((ref.exp() * (ref - logp)).sum())
        agree += int((ref.argmax(-1) == logp.argmax(-1)).sum())
        count += len(cont)
    assert entry["n_docs"] == len(prompts) and entry["n_tokens"] == count > 0
    assert entry["kl_divergence"] == pytest.approx(kl_sum / count, rel=1e-4, abs=1e-6)
    assert entry["top1_agreement"] == pytest.approx(agree / count)
