"""Row-wise attention (:mod:`distperp_harness.model.row_attention`): a row's hidden states in a right-padded batch
are the same bits as the row alone (padded to 16 positions, as every forward of the engine is), for any batch-mates;
transformers' batched sdpa attention is shown to differ on the same rows, so the test can fail."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from distperp_harness.model import row_attention
from distperp_harness.model.row_attention import ATTENTION, row_lengths

LENGTHS = [40, 200, 17, 130, 64, 5]
BATCHES = [[0, 1, 2], [1, 3], [0, 1, 2, 3, 4, 5], [2, 5], [5, 3, 1]]


@pytest.fixture(scope="module")
def model():
    row_attention.register()
    config = AutoConfig.for_model(
        "llama", vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _hidden(model, rows, implementation, per_row):
    model.set_attn_implementation(implementation)
    width = max(16, *(len(r) for r in rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    with torch.no_grad(), row_lengths([len(r) for r in rows]) if per_row else torch.no_grad():
        attention_mask = None if per_row else (ids != 0).long()
        out = model.model(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    return [out[i, : len(r)] for i, r in enumerate(rows)]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_has_the_same_bits_in_any_batch(model, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(1)
        rows = [torch.randint(1, 500, (n,), generator=g) for n in LENGTHS]
        alone = [_hidden(model, [r], ATTENTION, True)[0] for r in rows]
        moved = 0.0
        for batch in BATCHES:
            got = _hidden(model, [rows[i] for i in batch], ATTENTION, True)
            assert all(torch.equal(got[j], alone[i]) for j, i in enumerate(batch)), batch
            plain = _hidden(model, [rows[i] for i in batch], "sdpa", False)
            moved = max(moved, *((plain[j] - alone[i]).abs().max().item() for j, i in enumerate(batch)))
        assert moved > 0  # batched sdpa over padded keys moves some row: the comparison above can fail
    finally:
        torch.set_num_threads(before)


def test_without_row_lengths_it_is_sdpa(model):
    ids = torch.randint(1, 500, (2, 20), generator=torch.Generator().manual_seed(2))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.set_attn_implementation(ATTENTION)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)
    with pytest.raises(ValueError, match="1 <= queries <= keys"), row_lengths([(4, 2)]):
        pass
