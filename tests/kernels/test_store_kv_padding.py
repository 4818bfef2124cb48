"""``store_kv``'s padding check, once per step (``AttentionMetadata.slots_padded``): slots of -1
are skipped when the caller says the mapping may be padded or does not know (None), and a
mapping declared unpadded is written exactly as the checked path writes it."""

from __future__ import annotations

import pytest
import torch

from llmd.kernels import ops
from llmd.quant.kv import PagedKVCache, get_format


def _cache(fmt: str) -> PagedKVCache:
    return PagedKVCache.allocate((2, 6, 4, 2, 8), get_format(fmt), torch.float32, "cpu", None, "none", 0)


@pytest.mark.parametrize("fmt", ["auto", "int8"])
@pytest.mark.parametrize("padded", [None, True])
def test_negative_slots_are_skipped(fmt, padded):
    cache = _cache(fmt)
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    ops.store_kv(k, v, cache, torch.tensor([5, -1, 9, -1]), "torch", padded)
    want = _cache(fmt)
    ops.store_kv(k[[0, 2]], v[[0, 2]], want, torch.tensor([5, 9]), "torch", False)
    assert torch.equal(cache.data, want.data)
    assert cache.scales is None or torch.equal(cache.scales, want.scales)


@pytest.mark.parametrize("fmt", ["auto", "int8"])
def test_unpadded_mapping_writes_what_the_checked_path_writes(fmt):
    k, v, slots = torch.randn(7, 2, 8), torch.randn(7, 2, 8), torch.tensor([0, 3, 4, 11, 12, 13, 23])
    checked, declared = _cache(fmt), _cache(fmt)
    ops.store_kv(k, v, checked, slots, "torch", None)
    ops.store_kv(k, v, declared, slots, "torch", False)
    assert torch.equal(checked.data, declared.data) and checked.data.abs().sum() > 0
    flat = declared.data.view(2, -1, 2, 8)
    if fmt == "auto":  # the rows land at their slots (block * block_size + offset)
        assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)
