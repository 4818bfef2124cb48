"""The C decode kernel's vector path (kernels/native/paged_decode.c; on AVX2-only builds its
8-lane loops in decode_avx2.h, and with them off) with float32 queries on random shapes, against a float64
softmax(q Kᵀ) V and log-sum-exp computed here from the cache's rows (dequantized for int8)."""

from __future__ import annotations

import random

import pytest
import torch
from test_cpu_attention import rel

from llmd.kernels import cpu_native
from llmd.kernels.bench import random_paged_layout
from llmd.kernels.native import build
from llmd.quant.kv import PagedKVCache, get_format

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"no native kernel: {build.why_not}")


@pytest.mark.parametrize("fmt", ["auto", "float16", "bfloat16", "int8"])
def test_float32_queries_on_random_shapes(fmt):
    """25 random steps per format: KV heads 1-8 (the heads-per-task split varies), G 1-16 (blocks
    of 3 query rows and their remainders), head_dim 16-256, blocks 8/16/24/32 (tiles of 8 keys
    and partial ones) and 48/64/128 (taken as runs of 16 slots, 48's last run cut short), lengths
    1-300, random window starts; within 1e-5 of float64."""
    rng = random.Random(hash(fmt) % 1000)
    for it in range(25):
        kvh, group = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 3, 4, 5, 7, 8, 16])
        hd, bs, batch = rng.choice([16, 48, 64, 128, 256]), rng.choice([8, 16, 24, 32, 48, 64, 128]), rng.randint(1, 12)
        g = torch.Generator().manual_seed(it)
        lens = [rng.randint(1, 300) for _ in range(batch)]
        tables, slots, nb = random_paged_layout(lens, bs, g)
        cache = PagedKVCache.allocate((2, nb, bs, kvh, hd), get_format(fmt), torch.float32, "cpu")
        if fmt == "int8":
            cache.data.copy_(torch.randint(-127, 128, cache.data.shape, generator=g))
            cache.scales.copy_(torch.rand(cache.scales.shape, generator=g) * 0.05 + 1e-3)
        else:
            cache.data.copy_(torch.randn(cache.data.shape, generator=g) * 2)
        first = torch.tensor([rng.choice([0, 0, rng.randint(0, n - 1)]) for n in lens])
        q = torch.randn(batch, kvh * group, hd, generator=g)
        d = cpu_native.Decodes(torch.arange(batch), torch.arange(batch), first, torch.tensor(lens), tables)
        runs = []
        for avx2 in (True, False):  # decode_avx2.h's loops and decode_task's own (AVX2-only builds)
            out, lse = torch.zeros(q.shape), torch.zeros(q.shape[:2])
            on = cpu_native.set_avx2(avx2, hd, group)
            try:
                cpu_native.decode(q, cache, d, hd**-0.5, out, lse)
            finally:
                cpu_native.set_avx2(True, hd, group)
            runs.append((out, lse))
            if not on:  # no such loops in this build: one path
                break
        for (out, lse), b in ((r, b) for r in runs for b in range(batch)):
            sl = slots[b][first[b]: lens[b]]
            k, v = (cache.data[i].reshape(-1, kvh, hd)[sl].double() for i in (0, 1))
            if fmt == "int8":
                k = k * cache.scales[0].reshape(-1, kvh)[sl].double()[..., None]
                v = v * cache.scales[1].reshape(-1, kvh)[sl].double()[..., None]
            s = torch.einsum("hgd,nhd->hgn", q[b].double().view(kvh, group, hd), k) * hd**-0.5
            ref = torch.einsum("hgn,nhd->hgd", s.softmax(-1), v).reshape(kvh * group, hd)
            assert rel(out[b], ref) <= 1e-5, (it, kvh, group, hd, bs, lens[b], int(first[b]))
            assert torch.allclose(lse[b].double(), torch.logsumexp(s, -1).reshape(-1), atol=1e-4, rtol=0)
