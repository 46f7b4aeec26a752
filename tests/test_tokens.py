"""Tokenization: lm-eval hf's rules, every string a call needs encoded once, in batches, to the same ids as one
``encode`` each (rolling texts, multiple choice with shared and unshared contexts, empty contexts, trailing
spaces, text starting with the BOS string, chat-templated prompts, generation prompts, a shared few-shot prefix
ending inside a special token)."""

import pytest
from helpers import make_lm

import distperp_harness.tokens as tokens_module
from distperp_harness.planning.encoding import encode_many
from distperp_harness.planning.tokenizer_cuts import find_cut
from distperp_harness.tokens import loglikelihood_strings


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return make_lm(tiny_model_dir, ",max_length=64")


def _texts(tokenizer):
    bos = tokenizer.decode(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else "<s>"
    return [
        "The river runs past the old mill and",
        "Bees make honey in ",  # trailing space: moves to the continuation
        "  spaces first\n\nthen a blank line and a tab\t",
        bos + "a text that starts with the BOS string",
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n",
        "ünïcödé, emoji 🙂 and CJK 漢字 " * 3,
        "x",
    ]


def _spy(monkeypatch):
    """Every batch ``encode_many`` gets while inside (the strings of each call)."""
    calls = []

    def spying(tokenizer, strings, **special):
        calls.append(list(strings))
        return encode_many(tokenizer, strings, **special)

    monkeypatch.setattr(tokens_module, "encode_many", spying)
    return calls


def test_every_string_of_a_loglikelihood_call_is_encoded_once_in_batches(lm, monkeypatch):
    from lm_eval.api.instance import Instance

    contexts = ["The river runs past the old mill and", "Bees make honey in "]
    requests = [
        Instance("loglikelihood", {}, (c, a), i)
        for i, (c, a) in enumerate((c, a) for c in contexts + [""] for a in (" one", " two", " three"))
    ]
    calls = _spy(monkeypatch)
    plain = []
    encode = lm.tokenizer.encode
    monkeypatch.setattr(lm.tokenizer, "encode", lambda text, **kw: plain.append(text) or encode(text, **kw))
    first = lm.loglikelihood(requests, disable_tqdm=True)
    assert plain == []  # nothing encoded one by one
    moved = [(c.rstrip(), c[len(c.rstrip()) :] + a) for c, a in (r.args for r in requests) if c]
    wanted = {c for c, _ in moved} | {c + a for c, a in moved} | {a for c, a in (r.args for r in requests) if not c}
    encoded = [s for call in calls for s in call]
    assert sorted(encoded) == sorted(wanted) and len(calls) <= 2  # one batch per special-token rule
    calls.clear()
    again = lm.loglikelihood(requests, disable_tqdm=True)  # a new call encodes again (nothing kept between calls)
    assert sorted(s for call in calls for s in call) == sorted(wanted) and lm._encoded is None
    assert [float(s) for s, _ in first] == [float(s) for s, _ in again]


def test_batched_ids_equal_one_encode_each(lm):
    """The memo a batch fills gives exactly what ``tok_encode`` computes alone, for every special-token rule."""
    texts = _texts(lm.tokenizer)
    keys = [(t, add) for t in texts for add in (None, False, True)]
    alone = {key: lm.tok_encode(*key) for key in keys}  # no memo outside a call: one encode each
    lm._encoded = {}
    try:
        lm.pre_encode(keys)
        assert len(lm._encoded) == len(set(keys))
        assert {key: lm.tok_encode(*key) for key in keys} == alone
    finally:
        lm._encoded = None
    assert encode_many(lm.tokenizer, texts) == [lm.tokenizer.encode(t) for t in texts]


def test_rolling_texts_are_encoded_in_a_batch_per_rule(lm, monkeypatch):
    from lm_eval.api.instance import Instance

    texts = _texts(lm.tokenizer)[:4]
    expected = [lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), 0)], True)[0] for t in texts]
    calls = _spy(monkeypatch)
    out = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)], True)
    assert [float(x) for x in out] == [float(x) for x in expected]
    assert sorted(s for call in calls for s in call) == sorted(texts) and len(calls) == 2  # the BOS text apart
    assert lm._encoded is None


def test_generation_prompts_are_encoded_in_batches_with_hf_rules(lm):
    from distperp_harness.run.generation.prompts import encode_prompts

    setup = type("Setup", (), {"tokenizer": lm.tokenizer, "add_bos_token": None})()
    texts = _texts(lm.tokenizer)
    batched = encode_prompts(setup, texts + texts[:2])
    bos = getattr(lm.tokenizer, "bos_token", None)
    for text in texts:  # lm-eval hf's tok_batch_encode rule: no special tokens after a BOS string
        rule = {"add_special_tokens": False} if bos and text.startswith(bos) else {}
        assert batched[text] == lm.tokenizer.encode(text, **rule)


def test_a_shared_prefix_ending_inside_a_special_token_keeps_every_id(lm):
    """Contexts share a few-shot block that ends inside ``</s>``; some complete the token, some do not: ``pre_encode``
    cuts the block (a proved position, before the token's first character can matter) and ``tok_encode`` reads
    exactly what one encode per string gives."""
    block = "Question: what is the river called? Answer: the Velmire. " * 6 + "</"
    contexts = [block + rest for rest in ("s>", "s> next", "sx", "a", "s>\n", "b c", "s></s>", "x y z")]
    keys = list(dict.fromkeys(loglikelihood_strings((c, a) for c in contexts for a in (" yes", " no"))))
    alone = {key: lm.tok_encode(*key) for key in keys}
    assert find_cut(lm.tokenizer, block, {}).position is not None
    with lm.one_call():
        lm.pre_encode(keys)
        assert {key: lm.tok_encode(*key) for key in keys} == alone
