"""Tokenization: lm-eval hf's rules, and a context shared by several answers encoded once per loglikelihood call."""

from helpers import make_lm


def test_a_shared_context_is_encoded_once_per_call(tiny_model_dir):
    from lm_eval.api.instance import Instance

    lm = make_lm(tiny_model_dir, ",max_length=64")
    contexts = ["The river runs past the old mill and", "Bees make honey in"]
    requests = [
        Instance("loglikelihood", {}, (c, a), i)
        for i, (c, a) in enumerate((c, a) for c in contexts for a in (" one", " two", " three"))
    ]
    seen = []
    encode = lm.tokenizer.encode
    lm.tokenizer.encode = lambda text, **kw: seen.append(text) or encode(text, **kw)
    try:
        first = lm.loglikelihood(requests, disable_tqdm=True)
        assert sorted(seen) == sorted(contexts + [c + a for c, a in (r.args for r in requests)])
        seen.clear()
        again = lm.loglikelihood(requests, disable_tqdm=True)  # a new call encodes again (nothing kept between calls)
        assert len(seen) == len(contexts) + len(requests) and lm._encoded is None
    finally:
        lm.tokenizer.encode = encode
    assert [float(s) for s, _ in first] == [float(s) for s, _ in again]
    assert lm.tok_encode(contexts[0]) == encode(contexts[0])
