"""The fast CPU attention backend (``kernels/cpu_attention.py``) vs the float64 reference.

Random paged caches over a pairwise covering set of: batch kind (decode-only, prefill-only,
mixed), GQA ratio (1, 3, 4, 8), block size (16, 32), head_dim (64, 128), KV dtype (auto, int8,
fp8_e4m3, fp8_e5m2), sliding window (none, 7, 40), model dtype (float32, bfloat16). Contexts
include a 1-token sequence and lengths that are not multiples of the block size. Both backends
read the same stored bytes; the reference dequantizes them in float64.

Tolerances (‖fast − reference‖ / ‖reference‖, measured over this set): float32 ≤ 1e-5 (measured
≤ 5e-7 over 3 seeds); bfloat16 ≤ 2e-2 (measured ≤ 7e-3: bf16 queries, bf16 scores, bf16 probabilities).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from covering import pairwise

from llmd.kernels import AttentionMetadata, cpu_plan, ops, reference
from llmd.kernels.bench import random_paged_layout
from llmd.quant.kv import PagedKVCache, get_format

PARAMS = {
    "kind": ["decode", "prefill", "mixed"],
    "group": [1, 3, 4, 8],
    "block_size": [16, 32],
    "head_dim": [64, 128],
    "fmt": ["auto", "int8", "fp8_e4m3", "fp8_e5m2"],
    "window": [None, 7, 40],
    "dtype": [torch.float32, torch.bfloat16],
}
SHAPES = pairwise(PARAMS, seed=1)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def ctx_and_queries(kind: str, g: torch.Generator) -> list[tuple[int, int]]:
    """(cached tokens, query tokens) per sequence."""
    r = int(torch.randint(60, 200, (1,), generator=g))
    decodes = [(0, 1), (16, 1), (r, 1), (31, 1), (r + 37, 1)]
    prefills = [(0, 21), (45, 17), (r, 40)]
    spread = [(int(c), 1) for c in torch.randint(0, 400, (30,), generator=g)] + [(0, 1), (600, 1)]
    return {"decode": decodes, "prefill": prefills, "mixed": decodes[:3] + prefills[:2] + decodes[3:],
            "spread": spread, "spread-mixed": spread[:16] + prefills[:2] + spread[16:], "few": decodes[1:4]}[kind]


def make_step(case: dict, seed: int):
    """A random cache holding every sequence's K/V and a step's metadata and queries.

    Returns:
        (meta, query ``[T, heads, head_dim]`` float32, cache in ``case['dtype']``, cache's dtype).
    """
    g = torch.Generator().manual_seed(seed)
    bs, hd, group = case["block_size"], case["head_dim"], case["group"]
    nkv = 2
    ctx_q = ctx_and_queries(case["kind"], g)
    seq_lens = [c + q for c, q in ctx_q]
    tables, seq_slots, num_blocks = random_paged_layout(seq_lens, bs, g)
    fmt = get_format(case["fmt"], case.get("scale_group", 0))
    cache = PagedKVCache.allocate((2, num_blocks, bs, nkv, hd), fmt, case["dtype"], "cpu")
    new_slots = []
    for (c, _), s, slots in zip(ctx_q, seq_lens, seq_slots):
        k, v = torch.randn(s, nkv, hd, generator=g) * 2, torch.randn(s, nkv, hd, generator=g)
        reference.store_kv(k, v, cache, slots)
        new_slots.append(slots[c:])
    qlens = [q for _, q in ctx_q]
    query = torch.randn(sum(qlens), nkv * group, hd, generator=g)
    qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32)
    meta = AttentionMetadata(torch.cat(new_slots), tables, qsl, torch.tensor(seq_lens, dtype=torch.int32),
                             qlens, seq_lens, bs, "cpu")
    return meta, query, cache


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("case", SHAPES, ids=lambda c: "-".join(str(v) for v in c.values()).replace("torch.", ""))
def test_cpu_backend_matches_float64_reference(case):
    meta, query, cache = make_step(case, seed=hash(repr(case)) % 2**31)
    scale = case["head_dim"] ** -0.5
    q = query.to(case["dtype"])
    out = ops.paged_attention(q, cache, meta, scale, case["window"])
    assert out.dtype == case["dtype"] and out.shape == q.shape
    ref = reference.paged_attention(q.double(), cache, meta, scale, case["window"], compute_dtype=torch.float64)
    assert torch.isfinite(out).all()
    assert rel(out, ref) <= TOL[case["dtype"]]


def test_plan_is_built_once_per_group_and_window():
    case = {"kind": "mixed", "group": 3, "block_size": 16, "head_dim": 64, "fmt": "int8", "window": None,
            "dtype": torch.float32}
    meta, query, cache = make_step(case, seed=0)
    for _ in range(3):
        ops.paged_attention(query, cache, meta, 0.125, None)
    ops.paged_attention(query, cache, meta, 0.125, 40)
    assert sorted(k[2] or 0 for k in meta.plans if k[0] == "cpu") == [0, 40]


def test_window_plan_reads_only_the_window():
    """A decode at position 300 with W = 40 gathers 40 keys per head, not 301."""
    meta = AttentionMetadata(torch.tensor([300]), torch.arange(1, 21, dtype=torch.int32)[None], torch.tensor([0, 1]),
                             torch.tensor([301]), [1], [301], 16, "cpu")
    plan = cpu_plan.build_plan(meta, kv_heads=2, sliding_window=40)
    (_, dec), = plan.decodes
    assert dec.bias.shape[-1] == 40 and dec.rows.numel() == 2 * 40
    assert bool(torch.isfinite(dec.bias).all())


def test_float64_model_computes_in_float64():
    case = {"kind": "mixed", "group": 4, "block_size": 16, "head_dim": 64, "fmt": "auto", "window": 7,
            "dtype": torch.float64}
    meta, query, cache = make_step(case, seed=3)
    q = query.double()
    out = ops.paged_attention(q, cache, meta, 0.125, 7)
    ref = reference.paged_attention(q, cache, meta, 0.125, 7, compute_dtype=torch.float64)
    assert rel(out, ref) <= 1e-12


@pytest.mark.parametrize("kind,fmt,window,dtype", [
    ("spread", "auto", None, torch.float32), ("spread", "int8", 40, torch.bfloat16),
    ("spread-mixed", "fp8_e4m3", None, torch.bfloat16), ("spread-mixed", "auto", 7, torch.float32),
    ("few", "auto", None, torch.bfloat16), ("few", "int8", 40, torch.bfloat16)])
def test_length_buckets_and_small_decodes_match_reference(kind, fmt, window, dtype):
    """32 decodes with contexts 1..600 are split into length buckets (each padded to its own
    longest); <= 4 decodes of a bfloat16 model compute in float32. Same bounds as above."""
    case = {"kind": kind, "group": 3, "block_size": 16, "head_dim": 64, "fmt": fmt, "window": window, "dtype": dtype}
    meta, query, cache = make_step(case, seed=7)
    plan = cpu_plan.get_plan(meta, 2, window, 3)
    assert (len(plan.decodes) > 1) == kind.startswith("spread") or window is not None
    q = query.to(dtype)
    out = ops.paged_attention(q, cache, meta, 0.125, window)
    ref = reference.paged_attention(q.double(), cache, meta, 0.125, window, compute_dtype=torch.float64)
    assert out.dtype == dtype and rel(out, ref) <= TOL[dtype]


def test_length_buckets_split_only_where_it_pays():
    assert cpu_plan.length_buckets([500] * 20) == [(0, 20)]
    spans = [600, 590, 580, 570, 560, 550, 540, 530, 300, 290, 280, 270, 260, 250, 240, 230, 100, 90]
    assert cpu_plan.length_buckets(spans) == [(0, 8), (8, 18)]  # the 18th cannot start a bucket of 8
    assert cpu_plan.length_buckets(list(range(1000, 0, -10)), max_buckets=3)[-1][1] == 100
    assert cpu_plan.length_buckets([]) == [(0, 0)] and cpu_plan.length_buckets([5]) == [(0, 1)]


@pytest.mark.parametrize("kind,fmt,group_size,dtype", [
    ("mixed", "int8", 32, torch.float32), ("spread-mixed", "int8", 64, torch.bfloat16),
    ("decode", "fp8_e4m3", 32, torch.bfloat16), ("mixed", "fp8_e5m2", 64, torch.float32)])
def test_grouped_scales_match_reference(kind, fmt, group_size, dtype):
    """--kv-scale-group-size: the gathers dequantize codes × their group's scale (no per-key
    folding); same bounds as above, over buckets, prefill chunks, and head_dim 128 (4 or 2 groups)."""
    case = {"kind": kind, "group": 4, "block_size": 16, "head_dim": 128, "fmt": fmt, "window": None, "dtype": dtype,
            "scale_group": group_size}
    meta, query, cache = make_step(case, seed=11)
    assert cache.scales.shape[-1] == 128 // group_size
    q = query.to(dtype)
    out = ops.paged_attention(q, cache, meta, 128**-0.5)
    ref = reference.paged_attention(q.double(), cache, meta, 128**-0.5, compute_dtype=torch.float64)
    assert out.dtype == dtype and torch.isfinite(out).all() and rel(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("kind,fmt,window,dtype,group", [
    ("decode", "float16", None, torch.float32, 3), ("mixed", "float16", 7, torch.float32, 4),
    ("prefill", "float16", 40, torch.float32, 8), ("spread-mixed", "float16", None, torch.float32, 1),
    ("few", "float16", None, torch.float32, 4), ("mixed", "bfloat16", None, torch.float32, 3),
    ("spread", "bfloat16", 40, torch.float32, 4), ("mixed", "float16", None, torch.bfloat16, 4)])
@pytest.mark.parametrize("native", [True, False])
def test_16bit_float_caches_match_reference(kind, fmt, window, dtype, group, native):
    """``--kv-cache-dtype float16 / bfloat16``: K/V stored rounded to that dtype, no scales (the
    default of a float32-by-auto CPU model is float16). Both backends read the same stored values
    (the reference widens them to float64), through the C decode kernel and the torch gathers, so the
    bounds are the model dtype's above."""
    case = {"kind": kind, "group": group, "block_size": 16, "head_dim": 64, "fmt": fmt, "window": window,
            "dtype": dtype}
    meta, query, cache = make_step(case, seed=13)
    assert cache.data.dtype == getattr(torch, fmt) and cache.scales is None
    meta.native_kernels = native
    q = query.to(dtype)
    out = ops.paged_attention(q, cache, meta, 0.125, window)
    ref = reference.paged_attention(q.double(), cache, meta, 0.125, window, compute_dtype=torch.float64)
    assert out.dtype == dtype and torch.isfinite(out).all() and rel(out, ref) <= TOL[dtype]
