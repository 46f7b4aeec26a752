"""masks.py: generation's 4D masks apply each layer type's window or chunk by the tokens' positions (pads between a
shared block and a row's own tokens never count), one mask per rule, as a mapping where the layout is keyed."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from distperp_harness.model.attention import FULL, AttentionLayout, LayerAttention
from distperp_harness.run.generation.engine.masks import row_masks, row_positions

SDPA = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
"""What the masks read of a model: its attention implementation (sdpa takes the boolean mask as it is)."""


def test_windows_and_chunks_count_positions_not_columns():
    # [block of 3][2 pads][3 own tokens]: positions 0 1 2 . . 3 4 5
    row = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1]])
    assert row_positions(row)[0, [0, 1, 2, 5, 6, 7]].tolist() == [0, 1, 2, 3, 4, 5]
    window = AttentionLayout((("sliding_attention", LayerAttention(window=3)),), keyed=False)
    mask = row_masks(SDPA, window, row, 3)  # the own tokens' queries
    assert mask.shape == (1, 1, 3, 8)
    seen = [[c for c in range(8) if mask[0, 0, q, c]] for q in range(3)]
    assert seen == [[1, 2, 5], [2, 5, 6], [5, 6, 7]]  # the 3 positions up to each query, across the pads
    chunk = AttentionLayout((("chunked_attention", LayerAttention(chunk=3)),), keyed=False)
    seen = [[c for c in range(8) if row_masks(SDPA, chunk, row, 3)[0, 0, q, c]] for q in range(3)]
    assert seen == [[5], [5, 6], [5, 6, 7]]  # positions 3-5 are one chunk


def test_a_keyed_layout_gets_one_mask_per_layer_type_and_a_decode_query_its_rows_next_position():
    rows = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 1, 1]])  # each row's newest column last
    layout = AttentionLayout((("sliding_attention", LayerAttention(window=2)), ("full_attention", FULL)), keyed=True)
    masks = row_masks(SDPA, layout, rows, 1)
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert masks["full_attention"][:, 0, 0].tolist() == rows.bool().tolist()
    assert masks["sliding_attention"][:, 0, 0].int().tolist() == [[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1, 1]]
