"""The KV-gather read ``llmd bench step`` times (``kernels/native/kv_read.c`` via
``cpu_native.gather_read``): it reads exactly the bytes the decode kernel attends to — each
decode's K and V rows (and 8-bit scales) of positions ``[first, seq_len)`` through its block table
— shown by its sum, recomputed in numpy from those bytes alone, and by a byte outside them that
changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmd.kernels import cpu_native
from llmd.kernels.bench import random_paged_layout
from llmd.kernels.native import build
from llmd.quant.kv import PagedKVCache, get_format

pytestmark = pytest.mark.skipif(build.load_kv_read() is None, reason=f"no native kernels: {build.why_not}")


def sum64(b: np.ndarray) -> int:
    """kv_read.c's sum of a byte run: its whole 64-byte lines as uint64 words, then the tail bytes."""
    whole = len(b) // 64 * 64
    words = int(b[:whole].view(np.uint64).sum(dtype=np.uint64)) if whole else 0
    return (words + int(b[whole:].sum(dtype=np.uint64))) % 2**64


def expected(cache: PagedKVCache, d: cpu_native.Decodes) -> int:
    data, bs = cache.data, cache.data.shape[2]
    planes = [data[i].contiguous().view(torch.uint8).numpy().reshape(-1) for i in range(2)]
    scales = None
    if cache.fmt.quantized:
        scales = [cache.scales[i].contiguous().view(torch.uint8).numpy().reshape(-1) for i in range(2)]
    row = data.shape[3] * data.shape[4] * data.element_size()
    total = 0
    for i in range(d.tokens.shape[0]):
        table = d.block_tables[int(d.table_rows[i])]
        pos, end = int(d.first[i]), int(d.seq_lens[i])
        while pos < end:
            off = pos % bs
            n = min(bs - off, end - pos)
            slot = int(table[pos // bs]) * bs + off
            for p in planes:
                total += sum64(p[slot * row : (slot + n) * row])
            if scales is not None:
                sb = cache.scales.shape[3] * cache.scales.element_size()
                for p in scales:
                    total += sum64(p[slot * sb : (slot + n) * sb])
            pos += n
    return total % 2**64


@pytest.mark.parametrize("fmt,block,window", [("auto", 16, None), ("auto", 32, 20), ("int8", 16, None)])
def test_gather_read_reads_the_attended_bytes(fmt, block, window):
    g = torch.Generator().manual_seed(block)
    lens = [1, 17, 40, 33, 100]
    tables, _, num_blocks = random_paged_layout(lens, block, g)
    cache = PagedKVCache.allocate((2, num_blocks, block, 3, 64), get_format(fmt), torch.bfloat16, "cpu")
    cache.data.view(torch.uint8).random_(0, 256, generator=g)
    if cache.scales is not None:
        cache.scales.uniform_(0.01, 0.1, generator=g)
    seq_lens = torch.tensor(lens)
    first = torch.zeros(5, dtype=torch.int64) if window is None else torch.clamp(seq_lens - window, min=0)
    d = cpu_native.Decodes(torch.arange(5), torch.arange(5), first, seq_lens, tables.contiguous())
    want = expected(cache, d)
    assert cpu_native.gather_read(cache, d) == want
    unread = int(tables[0, 0]) * block + 1  # sequence 0 holds one token: slot 1 of its block is not attended
    cache.data[0].view(-1, 3, 64)[unread] += 1
    assert cpu_native.gather_read(cache, d) == want


def test_gather_read_refuses_int4():
    cache = PagedKVCache.allocate((2, 4, 16, 2, 64), get_format("int4"), torch.bfloat16, "cpu")
    d = cpu_native.Decodes(*(torch.zeros(1, dtype=torch.int64),) * 4, torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="does not read"):
        cpu_native.gather_read(cache, d)
