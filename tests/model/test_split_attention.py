"""``model/split_attention.py``: a decode step's attention over a cache split across members, combined from each
part's output and log-sum-exp, equals one device's attention over the whole cache within float32 rounding (against a
float64 reference), for grouped-query heads, uneven and empty parts and a sliding window; the combine's bits do not
depend on how many members there are beyond their order; new positions are stored in turn by blocks."""

import pytest
import torch

from distperp_harness.model.split_attention import combine_partials, owner_of, partial_attention


def _reference(query, keys, values, scale, reach=None):
    """Attention in float64 over all keys (the independent computation)."""
    groups = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(groups, dim=1)
    v = values.double().repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.double(), k.transpose(-1, -2)) * scale
    if reach is not None:
        scores = scores.masked_fill(~reach, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _cuts(length, sizes):
    """Slices of ``range(length)`` of the given sizes (the last takes the rest)."""
    out, start = [], 0
    for size in sizes:
        out.append(slice(start, min(length, start + size)))
        start = min(length, start + size)
    out.append(slice(start, length))
    return out


@pytest.mark.parametrize("sizes", [(), (300,), (1, 700), (0, 512, 0), (128, 128, 128)])
def test_split_attention_equals_one_device_within_float32_rounding(sizes):
    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 8, 1, 64, generator=g)
    keys = torch.randn(2, 2, 1000, 64, generator=g) * 3  # peaked scores: the combine's rescaling matters
    values = torch.randn(2, 2, 1000, 64, generator=g)
    scale = 64**-0.5
    parts = [partial_attention(query, keys[:, :, s], values[:, :, s], scale) for s in _cuts(1000, sizes)]
    got = combine_partials(parts)
    want = _reference(query, keys, values, scale)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-5), (got.double() - want).abs().max()
    if not sizes:  # one part: the member's own softmax
        alone = torch.softmax(torch.matmul(query, keys.repeat_interleave(4, 1).transpose(-1, -2)) * scale, -1)
        assert torch.allclose(got, torch.matmul(alone, values.repeat_interleave(4, 1)), atol=1e-5)


def test_a_sliding_window_and_a_part_out_of_reach():
    g = torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, 1, 32, generator=g)
    keys, values = torch.randn(1, 4, 600, 32, generator=g), torch.randn(1, 4, 600, 32, generator=g)
    reach = torch.zeros(1, 1, 1, 600, dtype=torch.bool)
    reach[..., 472:] = True  # a window of the last 128 positions: the first part has no key in reach
    parts = [
        partial_attention(query, keys[:, :, s], values[:, :, s], 0.2, reach[..., s]) for s in _cuts(600, (400, 100))
    ]
    assert torch.isinf(parts[0][1]).all() and (parts[0][0] == 0).all()
    got = combine_partials(parts)
    assert torch.allclose(got.double(), _reference(query, keys, values, 0.2, reach), rtol=0, atol=1e-5)
    none = combine_partials([partial_attention(query, keys, values, 0.2, torch.zeros_like(reach))])
    assert (none == 0).all()  # no key in reach anywhere: zeros, not NaN


def test_the_combine_is_the_same_bits_on_every_member_and_run():
    g = torch.Generator().manual_seed(2)
    query, keys, values = (torch.randn(1, 2, 1, 16, generator=g) for _ in range(3))
    keys, values = torch.randn(1, 2, 90, 16, generator=g), torch.randn(1, 2, 90, 16, generator=g)
    parts = [partial_attention(query, keys[:, :, s], values[:, :, s], 0.25) for s in _cuts(90, (30, 30))]
    first = combine_partials(parts)
    assert torch.equal(first, combine_partials([(o.clone(), s.clone()) for o, s in parts]))


def test_new_positions_are_stored_in_turn_by_blocks():
    owners = [owner_of(p, 2, first=1000, block=4) for p in range(1000, 1016)]
    assert owners == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    with pytest.raises(ValueError, match="in the prompt"):
        owner_of(999, 2, first=1000)


def test_a_reach_per_query_head():
    g = torch.Generator().manual_seed(7)
    query = torch.randn(1, 6, 2, 16, generator=g)  # 6 query heads over 2 key-value heads, 2 queries
    keys, values = torch.randn(1, 2, 200, 16, generator=g), torch.randn(1, 2, 200, 16, generator=g)
    reach = torch.rand(1, 6, 2, 200, generator=g) < 0.5
    parts = [partial_attention(query, keys[:, :, s], values[:, :, s], 0.25, reach[..., s]) for s in _cuts(200, (70,))]
    got = combine_partials(parts)
    assert torch.allclose(got.double(), _reference(query, keys, values, 0.25, reach), rtol=0, atol=1e-5)
