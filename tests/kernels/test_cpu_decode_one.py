"""The cpu backend's one-decode path (``kernels/cpu_decode_one.py``, a step of one sequence with
one query over an ``auto`` cache) vs the general batched path and the float64 reference.

Contexts of 1, a block boundary (16, 17), a non-multiple of the block size and a long one, on
a shuffled block table with a spare column; GQA 1 and 3; sliding windows none / 7 / 40 (a window
starting inside a block); float32, bfloat16 and float64 models. Against the general path (the
same gathered values, matmuls and softmax in the same compute dtype): ≤ 1e-6 relative in every
dtype (measured: equal); against the float64 reference the backend's own bounds.
"""

from __future__ import annotations

import pytest
import torch

from llmd.kernels import AttentionMetadata, cpu_attention, cpu_decode_one, reference
from llmd.kernels.bench import random_paged_layout
from llmd.quant.kv import PagedKVCache, get_format

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}
CASES = [(ctx, group, window, dtype) for ctx, group, window, dtype in [
    (1, 3, None, torch.float32), (16, 1, None, torch.bfloat16), (17, 3, 7, torch.float32),
    (100, 3, 40, torch.bfloat16), (600, 3, None, torch.bfloat16), (331, 1, 40, torch.float64),
    (600, 3, None, torch.float32), (57, 3, 7, torch.bfloat16)]]


def one_decode(ctx: int, group: int, dtype: torch.dtype, seed: int = 0, bs: int = 16, kv_heads: int = 2,
               head_dim: int = 64):
    """A cache holding one sequence's ``ctx`` keys (the last one this step's) and its metadata."""
    g = torch.Generator().manual_seed(seed)
    tables, (slots,), num_blocks = random_paged_layout([ctx], bs, g, spare_blocks=4, spare_columns=1)
    cache = PagedKVCache.allocate((2, num_blocks, bs, kv_heads, head_dim), get_format("auto"), dtype, "cpu")
    k = torch.randn(ctx, kv_heads, head_dim, generator=g, dtype=torch.float64) * 2
    reference.store_kv(k, torch.randn(ctx, kv_heads, head_dim, generator=g, dtype=torch.float64), cache, slots)
    meta = AttentionMetadata(slots[-1:], tables, torch.tensor([0, 1], dtype=torch.int32),
                             torch.tensor([ctx], dtype=torch.int32), [1], [ctx], bs, "cpu", slots_padded=False,
                             native_kernels=False)  # the torch paths (the C kernel: test_cpu_native.py)
    query = torch.randn(1, kv_heads * group, head_dim, generator=g, dtype=torch.float64).to(dtype)
    return meta, query, cache


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("ctx,group,window,dtype", CASES)
def test_one_decode_equals_the_general_path_and_the_reference(ctx, group, window, dtype, monkeypatch):
    meta, query, cache = one_decode(ctx, group, dtype)
    assert cpu_decode_one.applies(meta, cache.fmt.quantized)
    out = cpu_attention.paged_attention(query, cache, meta, 0.125, window)
    assert ("cpu-one", window) in meta.plans and out.dtype == dtype and out.shape == query.shape
    monkeypatch.setattr(cpu_decode_one, "applies", lambda *a: False)  # the batched path on the same step
    general = cpu_attention.paged_attention(query, cache, AttentionMetadata(**{
        f: getattr(meta, f) for f in ("slot_mapping", "block_tables", "query_start_loc", "seq_lens", "query_lens_cpu",
                                      "seq_lens_cpu", "block_size", "attn_backend", "native_kernels")}), 0.125, window)
    assert rel(out, general) <= 1e-6
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    ref = reference.paged_attention(query.double(), cache, meta, 0.125, window, torch.float64)
    assert rel(out, ref) <= TOL[dtype] and rel(reference.paged_attention(query, cache, meta, 0.125, window, compute),
                                               ref) <= TOL[dtype]


def test_the_plan_is_built_once_and_reads_only_the_window():
    meta, query, cache = one_decode(100, 3, torch.float32)
    first = cpu_decode_one.get_plan(meta, 40)
    assert cpu_decode_one.get_plan(meta, 40) is first  # the group's other layers reuse it
    assert (first.span, first.offset) == (40, 60 % 16)
    assert first.block_ids.tolist() == meta.block_tables[0, 60 // 16 : 99 // 16 + 1].tolist()


@pytest.mark.parametrize("fmt,qlens,ctx", [("int8", [1], [40]), ("auto", [1, 1], [40, 9]), ("auto", [3], [40]),
                                           ("auto", [1], [0])])
def test_other_steps_keep_the_general_path(fmt, qlens, ctx):
    meta = AttentionMetadata(torch.zeros(sum(qlens), dtype=torch.int64), torch.ones(len(qlens), 4, dtype=torch.int32),
                             torch.zeros(len(qlens) + 1, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
                             qlens, ctx, 16, "cpu")
    assert not cpu_decode_one.applies(meta, get_format(fmt).quantized)
