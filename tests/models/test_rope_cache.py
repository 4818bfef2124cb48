"""The decoder's RoPE table cache (``models/decoder.py`` ``RopeCache``): a CPU step's cos/sin
gathered from the cached tables of every position equal ``rope_tables`` of the step's positions
bit for bit (float32 / bfloat16 / float64, two bases, head_dim 64 and 256), including positions
past the first table (it doubles) and unsorted, repeated ones."""

from __future__ import annotations

import pytest
import torch

from llmd.models.decoder import RopeCache
from llmd.models.layers import rope_tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("head_dim,theta", [(64, 1e4), (256, 1e6)])
def test_lookup_equals_rope_tables(dtype, head_dim, theta):
    cache = RopeCache(head_dim)
    for pos in (torch.tensor([0]), torch.tensor([4095]), torch.tensor([7, 3, 7, 2000]), torch.arange(500, 1013),
                torch.tensor([4096]), torch.tensor([9000, 1])):  # the last two reach past 4,096, then 8,192
        cos, sin = cache.lookup(pos, theta, dtype)
        want_cos, want_sin = rope_tables(pos, head_dim, theta, dtype)
        assert cos.shape == want_cos.shape == (pos.shape[0], 1, head_dim)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert cache.tables[(theta, dtype)].shape[0] == 16384  # 4,096 -> 8,192 -> 16,384


def test_tables_are_built_once_per_base_and_dtype():
    cache = RopeCache(64)
    cache.lookup(torch.tensor([3]), 1e4, torch.bfloat16)
    table = cache.tables[(1e4, torch.bfloat16)]
    cache.lookup(torch.tensor([17, 4]), 1e4, torch.bfloat16)
    assert cache.tables[(1e4, torch.bfloat16)] is table and table.shape[0] == RopeCache.MIN_LENGTH
    cache.lookup(torch.tensor([3]), 1e6, torch.bfloat16)
    assert len(cache.tables) == 2
