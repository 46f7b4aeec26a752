"""prefill.py: rows of equal length from column 0 under plain causal layers are prefilled with no mask (sdpa's causal
path, no ``[rows, width, width]`` mask: 4 GiB as float32 for one 32k-token prompt); padded rows get the 4D mask;
both give the greedy tokens of one device's whole forwards."""

from __future__ import annotations

import torch

from distperp_harness.run.generation.engine.loop import Decoder, decode_lane
from distperp_harness.run.generation.engine.scheduler import Lane, StopRule


def _masks_seen(model, lane, tokenizer):
    """The attention masks' dimensions of every prefill forward (more than one query position) of ``lane``, and
    its tokens."""
    seen: list[int] = []

    def spy(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] > 1:
            mask = kwargs.get("attention_mask")
            seen.append(-1 if mask is None else (mask.dim() if torch.is_tensor(mask) else 4))

    hook = model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        tokens, _ = decode_lane(Decoder(model, tokenizer, torch.device("cpu")), lane, StopRule((), frozenset(), 6, 2))
    finally:
        hook.remove()
    return seen, tokens


def _whole_greedy(model, prompt, new):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def test_one_unpadded_row_takes_no_mask_and_padded_rows_the_4d_one(peaked):
    model, tokenizer = peaked
    g = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(3, model.config.vocab_size, (90,), generator=g).tolist()
    short_prompt = long_prompt[:40]
    alone, tokens = _masks_seen(model, Lane([long_prompt], (), 1), tokenizer)
    assert alone == [-1]
    assert tokens[0] == _whole_greedy(model, long_prompt, 6)
    padded, tokens = _masks_seen(model, Lane([long_prompt, short_prompt], (), 2), tokenizer)
    assert padded == [4]
    assert tokens == [_whole_greedy(model, long_prompt, 6), _whole_greedy(model, short_prompt, 6)]
