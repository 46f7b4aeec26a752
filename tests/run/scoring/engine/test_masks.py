"""The tree mask (:mod:`distperp_harness.run.scoring.engine.masks`): the dense mask against the rule computed by hand,
and flex attention's ``mask_mod`` and ``BlockMask`` against the dense mask, element for element."""

import numpy as np
import pytest
import torch

from distperp_harness.model.attention import FULL, AttentionLayout, LayerAttention
from distperp_harness.planning.requests import Unit
from distperp_harness.planning.rows import Row
from distperp_harness.run.scoring.engine.masks import FLEX_BLOCK, Packing


def _row(runs, parents, tag=0):
    """A row of ``runs`` (lengths) under ``parents``; tokens are distinct per run, the first run's shared."""
    tokens = tuple(
        tuple(range(10 + 100 * (r + (tag if r else 0)), 10 + 100 * (r + (tag if r else 0)) + n))
        for r, n in enumerate(runs)
    )
    return Row(tokens, tuple(parents), (Unit(tokens[0] + (1,), 1),), (0,), (0,))


def _batch():
    """Three rows sharing their 6-token root: a tree (root, two questions, answers under each), a chain, a plain
    row; different lengths, so two of them are padded."""
    return [_row([6, 4, 1, 1, 3, 2], [-1, 0, 1, 1, 0, 4]), _row([6, 2, 2], [-1, 0, 1], tag=7), _row([6], [-1])]


def _by_hand(rows, shared):
    """``allowed[b, q, k]`` from the definition: causal, and k's run on q's root path; a padding query sees its row."""
    padded = max(r.length for r in rows)
    out = np.zeros((len(rows), padded - shared, padded), dtype=bool)
    for b, row in enumerate(rows):
        run = row.run_ids()
        for q in range(shared, padded):
            for k in range(q + 1):
                if q >= row.length:
                    out[b, q - shared, k] = True
                elif k < row.length:
                    out[b, q - shared, k] = run[k] in row.path(run[q])
    return out


@pytest.mark.parametrize("shared", [0, 6])
def test_dense_mask_is_the_tree_rule(shared):
    rows = _batch()
    packing = Packing.of(rows, max(r.length for r in rows), torch.device("cpu"), shared)
    assert packing.allowed.shape == (3, 1, 17 - shared, 17)
    np.testing.assert_array_equal(packing.allowed[:, 0].numpy(), _by_hand(rows, shared))
    assert packing.position_ids[0].tolist() == list(range(6))[shared:] + [6, 7, 8, 9, 10, 10, 6, 7, 8, 9, 10]
    assert (packing.prefix_ids is None) == (shared == 0)


@pytest.mark.parametrize("shared", [0, 6])
def test_flex_mask_mod_equals_the_dense_mask(shared):
    """Same booleans for every (row, query, key), and the block mask keeps every block holding a True."""
    from torch.nn.attention.flex_attention import create_mask

    rows = _batch()
    packing = Packing.of(rows, max(r.length for r in rows), torch.device("cpu"), shared)
    dense = create_mask(packing.mask_mod(), 3, 1, 17 - shared, 17, device="cpu")
    assert torch.equal(dense, packing.allowed)
    blocks = packing.block_mask()
    assert blocks.shape == (3, 1, 17 - shared, 17) and blocks.BLOCK_SIZE == (FLEX_BLOCK, FLEX_BLOCK)
    assert bool(blocks.to_dense()[:, :, 0, 0].all())  # one 128 x 128 block, kept: it holds visible keys


def test_flex_mask_mod_on_longer_rows_equals_the_dense_mask():
    """Rows over several 128-token blocks, with a 100-token shared prefix: mask_mod and the block structure."""
    from torch.nn.attention.flex_attention import create_mask

    rng = np.random.default_rng(0)
    rows = []
    for tag in range(3):
        n = int(rng.integers(4, 9))
        parents = [-1] + [int(rng.integers(0, r)) for r in range(1, n)]
        rows.append(_row([100] + [int(rng.integers(5, 60)) for _ in range(n - 1)], parents, tag=10 * tag))
    padded = max(r.length for r in rows)
    packing = Packing.of(rows, padded, torch.device("cpu"), 100)
    dense = create_mask(packing.mask_mod(), 3, 1, padded - 100, padded, device="cpu")
    assert torch.equal(dense, packing.allowed)
    np.testing.assert_array_equal(packing.allowed[:, 0].numpy(), _by_hand(rows, 100))
    # block level: a block is kept exactly when it holds a visible key
    q_blocks, kv_blocks = -(-(padded - 100) // FLEX_BLOCK), -(-padded // FLEX_BLOCK)
    padded_mask = torch.zeros(3, q_blocks * FLEX_BLOCK, kv_blocks * FLEX_BLOCK, dtype=torch.bool)
    padded_mask[:, : padded - 100, :padded] = packing.allowed[:, 0]
    any_true = padded_mask.view(3, q_blocks, FLEX_BLOCK, kv_blocks, FLEX_BLOCK).any(dim=(2, 4))
    assert torch.equal(packing.block_mask().to_dense()[:, 0].bool(), any_true)


def _by_hand_under(rows, shared, window=None, chunk=None):
    """:func:`_by_hand`, and a key hidden where the layer's window or chunk rule hides it, on the positions the
    columns take in their rows (a padding column's position is 0)."""
    out = _by_hand(rows, shared)
    padded = max(r.length for r in rows)
    for b, row in enumerate(rows):
        pos = row.position_ids() + [0] * (padded - row.length)
        for q in range(shared, padded):
            for k in range(padded):
                if window is not None and pos[q] - pos[k] >= window:
                    out[b, q - shared, k] = False
                if chunk is not None and pos[q] // chunk != pos[k] // chunk:
                    out[b, q - shared, k] = False
    return out


@pytest.mark.parametrize("shared", [0, 6])
@pytest.mark.parametrize("rule", [LayerAttention(window=4), LayerAttention(window=9), LayerAttention(chunk=5)])
def test_windows_and_chunks_apply_on_positions_in_every_form(shared, rule):
    """A sliding window or chunk hides keys by the distance between *positions* (a branch continues its parent's),
    the same in the dense mask and flex's mask_mod; every query still sees itself."""
    from torch.nn.attention.flex_attention import create_mask

    rows = _batch()
    packing = Packing.of(rows, max(r.length for r in rows), torch.device("cpu"), shared)
    allowed = packing.allowed_under(rule)
    np.testing.assert_array_equal(allowed[:, 0].numpy(), _by_hand_under(rows, shared, rule.window, rule.chunk))
    assert not torch.equal(allowed, packing.allowed)  # the rule hides something here
    dense = create_mask(packing.mask_mod(rule), 3, 1, 17 - shared, 17, device="cpu")
    assert torch.equal(dense, allowed)
    assert bool(allowed[:, 0].any(-1).all())  # no query without a key


def test_a_keyed_layout_gets_one_mask_per_layer_type_and_shares_equal_rules():
    """Layer types with different rules get their own masks (a mapping), types with one rule share one tensor; a
    layout of one rule is a single mask; sdpa takes booleans, eager an additive float mask."""
    from types import SimpleNamespace

    rows = _batch()
    packing = Packing.of(rows, max(r.length for r in rows), torch.device("cpu"))
    window = LayerAttention(window=4)
    keyed = AttentionLayout((("full_attention", FULL), ("sliding_attention", window), ("other", FULL)), keyed=True)
    embed = torch.nn.Embedding(4, 2)
    sdpa = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"), get_input_embeddings=lambda: embed)
    masks = packing.kwargs(sdpa, keyed)["attention_mask"]
    assert set(masks) == {"full_attention", "sliding_attention", "other"} and masks["other"] is masks["full_attention"]
    assert torch.equal(masks["sliding_attention"], packing.allowed_under(window))
    assert torch.equal(masks["full_attention"], packing.allowed)
    single = packing.kwargs(sdpa, AttentionLayout((("sliding_attention", window),), keyed=False))["attention_mask"]
    assert torch.equal(single, packing.allowed_under(window))
    eager = SimpleNamespace(config=SimpleNamespace(_attn_implementation="eager"), get_input_embeddings=lambda: embed)
    additive = packing.kwargs(eager, keyed)["attention_mask"]["sliding_attention"]
    assert additive.dtype == torch.float32 and torch.equal(additive == 0, packing.allowed_under(window))


def test_padding_columns_show_no_position_their_row_does_not_reach():
    """A padding column takes position 0: a batch's padding never shows the model a position past its rows' own (a
    learned position table ends at the context; RoPE variants pick a factor from the largest position id)."""
    rows = _batch()
    padded = max(r.length for r in rows) + 40  # as wide as an auto-widened batch
    packing = Packing.of(rows, padded, torch.device("cpu"))
    for b, row in enumerate(rows):
        assert packing.position_ids[b, : row.length].tolist() == row.position_ids()
        assert int(packing.position_ids[b].max()) == max(row.position_ids())
