"""The cpu backend's C decode kernel (``kernels/native/paged_decode.c`` via ``kernels/cpu_native.py``).

Against the float64 reference on random paged caches (shapes, formats, windows as in
``test_cpu_attention.py``, whose cases also run through this kernel), against the torch path
on the same step, its log-sum-exp, exact batch invariance, its fallbacks, and that it shares
torch's OpenMP runtime. Tolerances as the backend's: float32 ≤ 1e-5 relative to float64
(measured ≤ 3e-7), bfloat16 ≤ 2e-2 (measured ≤ 4e-3: only the query, K/V and output are bfloat16).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from test_cpu_attention import make_step, rel

from llmd.kernels import AttentionMetadata, cpu_attention, cpu_native, cpu_plan, reference
from llmd.kernels.native import build

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"no native kernel: {build.why_not}")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CASES = [("decode", 1, 16, 64, "auto", None, torch.float32), ("decode", 3, 32, 128, "int8", 7, torch.bfloat16),
         ("spread", 4, 16, 64, "fp8_e4m3", None, torch.float32), ("spread", 8, 16, 256, "fp8_e5m2", 40, torch.bfloat16),
         ("few", 3, 16, 64, "auto", 40, torch.bfloat16), ("spread", 3, 32, 64, "int8", None, torch.float32),
         ("decode", 16, 16, 64, "auto", None, torch.bfloat16)]
KEYS = ("kind", "group", "block_size", "head_dim", "fmt", "window", "dtype")


def _torch_path(meta: AttentionMetadata) -> AttentionMetadata:
    """The same step with the C kernel switched off (and no cached plan)."""
    fields = ("slot_mapping", "block_tables", "query_start_loc", "seq_lens", "query_lens_cpu", "seq_lens_cpu",
              "block_size", "attn_backend", "slots_padded")
    return AttentionMetadata(**{f: getattr(meta, f) for f in fields}, native_kernels=False)


@pytest.mark.parametrize("values", CASES, ids=lambda v: "-".join(str(x) for x in v).replace("torch.", ""))
def test_native_decodes_match_float64_reference_and_torch_path(values):
    case = dict(zip(KEYS, values))
    meta, query, cache = make_step(case, seed=5)
    scale = case["head_dim"] ** -0.5
    q = query.to(case["dtype"])
    out = cpu_attention.paged_attention(q, cache, meta, scale, case["window"])
    (plan,) = [p for k, p in meta.plans.items() if k[0] == "cpu"]
    assert plan.native is not None and not plan.decodes  # every decode went through the kernel
    ref = reference.paged_attention(q.double(), cache, meta, scale, case["window"], compute_dtype=torch.float64)
    assert out.dtype == case["dtype"] and rel(out, ref) <= TOL[case["dtype"]]
    torch_out = cpu_attention.paged_attention(q, cache, _torch_path(meta), scale, case["window"])
    assert rel(out, torch_out) <= TOL[case["dtype"]]


def test_log_sum_exp_and_untouched_rows():
    """``lse`` is each decode row's log-sum-exp of its scaled scores (float64 check); rows of
    other tokens in ``out`` are left as they were."""
    case = dict(zip(KEYS, ("mixed", 3, 16, 64, "int8", None, torch.float32)))
    meta, query, cache = make_step(case, seed=2)
    plan = cpu_plan.get_plan(meta, 2, None, 3, native=True)
    out = torch.full_like(query, 7.0)
    lse = torch.zeros(query.shape[:2])
    cpu_native.decode(query, cache, plan.native, 0.125, out, lse)
    for row, tok in enumerate(plan.native.tokens.tolist()):
        n = int(plan.native.seq_lens[row])
        table = meta.block_tables[int(plan.native.table_rows[row])].long()
        slots = table[torch.arange(n) // 16] * 16 + torch.arange(n) % 16
        codes = cache.data[0].reshape(-1, 2, 64)[slots].double()
        keys = codes * cache.scales[0].reshape(-1, 2)[slots].double()[..., None]  # [n, kv_heads, 64]
        scores = torch.einsum("hgd,nhd->hgn", query[tok].double().view(2, 3, 64), keys) * 0.125
        assert torch.allclose(lse[tok].double(), torch.logsumexp(scores, -1).reshape(6), rtol=1e-5, atol=1e-5)
    prefill_rows = torch.ones(query.shape[0], dtype=torch.bool)
    prefill_rows[plan.native.tokens] = False
    assert bool((out[prefill_rows] == 7.0).all())


def test_a_sequence_gives_the_same_bits_in_any_batch():
    """Case S4 on this path: keys in position order per (sequence, head), float32 sums, no
    padding, so a sequence's output does not change with what else the step holds."""
    case = dict(zip(KEYS, ("spread", 3, 16, 64, "auto", None, torch.bfloat16)))
    meta, query, cache = make_step(case, seed=9)
    q = query.to(torch.bfloat16)
    whole = cpu_attention.paged_attention(q, cache, meta, 0.125)
    for pick in ([5], [0, 5, 17], list(range(5, 32, 3))):
        sub = AttentionMetadata(meta.slot_mapping[pick], meta.block_tables[pick],
                                torch.arange(len(pick) + 1, dtype=torch.int32), meta.seq_lens[pick],
                                [1] * len(pick), [meta.seq_lens_cpu[i] for i in pick], 16, "cpu", slots_padded=False)
        assert torch.equal(cpu_attention.paged_attention(q[pick], cache, sub, 0.125), whole[pick])


@pytest.mark.parametrize("values", CASES[:4], ids=lambda v: "-".join(str(x) for x in v).replace("torch.", ""))
def test_skewed_planes_read_like_a_contiguous_cache(values):
    """A CPU cache's V plane (and 8-bit scales' V plane) starts 2 KiB past a page multiple from
    its K plane (quant/kv.py ``kv_planes``); the kernel, told that distance, gives the same bits
    as on a contiguous copy of the same cache."""
    import dataclasses

    from llmd.quant.kv import PLANE_SKEW_BYTES, planes_contiguous

    case = dict(zip(KEYS, values))
    meta, query, cache = make_step(case, seed=3)
    for t in (cache.data, cache.scales):
        if t is not None:
            assert planes_contiguous(t)
            assert t.stride(0) * t.element_size() % 4096 == PLANE_SKEW_BYTES
    dense = dataclasses.replace(cache, data=cache.data.contiguous(),
                                scales=None if cache.scales is None else cache.scales.contiguous())
    assert dense.data.is_contiguous() and dense.data.stride(0) == dense.data[0].numel()
    plan = cpu_plan.get_plan(meta, dense.data.shape[3], case["window"], case["group"], native=True)
    q = query.to(case["dtype"])
    skewed, flat = torch.zeros_like(q), torch.zeros_like(q)
    cpu_native.decode(q, cache, plan.native, 0.125, skewed)
    cpu_native.decode(q, dense, plan.native, 0.125, flat)
    assert torch.equal(skewed, flat) and skewed.abs().sum() > 0


def test_not_served_here_falls_back_to_torch():
    """Grouped scales, head_dim not a multiple of 16, float64: the torch path (plans with buckets)."""
    for case in ({"fmt": "int8", "scale_group": 32, "head_dim": 64, "dtype": torch.float32},
                 {"fmt": "auto", "head_dim": 72, "dtype": torch.float32},
                 {"fmt": "auto", "head_dim": 64, "dtype": torch.float64}):
        full = {"kind": "decode", "group": 3, "block_size": 16, "window": None, **case}
        meta, query, cache = make_step(full, seed=1)
        q = query.to(full["dtype"])
        out = cpu_attention.paged_attention(q, cache, meta, 0.125)
        (plan,) = [p for k, p in meta.plans.items() if k[0] == "cpu"]
        assert plan.native is None and plan.decodes
        ref = reference.paged_attention(q.double(), cache, meta, 0.125, compute_dtype=torch.float64)
        assert rel(out, ref) <= 1e-5


def test_the_shape_specialized_build_matches_the_generic_one():
    """``prepare`` (engines at start-up) builds the variant with the model's shape as constants;
    it computes what the runtime-shape build does (within float32 reassociation)."""
    case = dict(zip(KEYS, ("spread", 3, 16, 64, "int8", None, torch.float32)))
    meta, query, cache = make_step(case, seed=4)
    plan = cpu_plan.get_plan(meta, 2, None, 3, native=True)
    generic, special = torch.zeros_like(query), torch.zeros_like(query)
    cpu_native.decode(query, cache, plan.native, 0.125, generic)
    assert cpu_native.prepare(64, 3) and build.loaded((4, 3)) is not None
    cpu_native.decode(query, cache, plan.native, 0.125, special)
    assert rel(special, generic) <= 1e-6
    assert not cpu_native.prepare(72, 3) and not cpu_native.prepare(64, 17)  # past the kernel's limits


def test_loading_the_kernel_keeps_subnormals():
    """Built without -ffast-math: GCC 12 would link crtfastmath.o into the shared object, whose
    constructor sets FTZ/DAZ for the loading thread and so flushes every later subnormal."""
    code = ("import sys, torch; from llmd.kernels import cpu_native; assert cpu_native.prepare(64, 3);"
            "x = float(sys.argv[1]); print(x * 1.0 > 0, bool((torch.tensor([1e-40]) * 1.0 > 0).all()))")
    res = subprocess.run([sys.executable, "-c", code, "5e-324"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["True", "True"], (res.stdout, res.stderr)


def test_one_openmp_runtime_in_the_process():
    """The kernel binds to the libgomp torch loaded: one copy mapped, not two thread teams."""
    maps = open("/proc/self/maps").read().splitlines()
    gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1, gomp


@pytest.mark.parametrize("env,why", [({"LLMD_NATIVE_KERNELS": "0"}, "LLMD_NATIVE_KERNELS=0"),
                                     ({"CC": "/nonexistent/cc"}, "no C compiler")])
def test_unavailable_kernel_says_why_and_attention_still_works(env, why, tmp_path):
    code = ("import torch, logging; logging.basicConfig(); from llmd.kernels import cpu_native;"
            "from llmd.kernels.native import build; print(cpu_native.available(), build.why_not)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "XDG_CACHE_HOME": str(tmp_path), **env})
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("False") and why in res.stdout
    assert "native CPU decode kernel unavailable" in res.stderr and why in res.stderr


AMX = cpu_native.available() and cpu_native.amx_available()
DOT = cpu_native.available() and cpu_native.dot_available()
TILE_CASES = [("decode", 1, 16, 64, None), ("spread", 3, 32, 128, 40), ("few", 16, 16, 64, 40),
              ("spread", 4, 16, 256, None), ("mixed", 8, 32, 32, 7), ("spread", 3, 16, 64, None),
              ("spread", 4, 8, 64, None), ("mixed", 2, 24, 96, 9)]
# the bfloat16 paths of the C kernel: its switch and whether it takes a configuration, skipped off this CPU
NO_AMX = pytest.mark.skipif(not AMX, reason="no AMX tile unit on this CPU (or LLMD_AMX_ATTENTION=0)")
NO_DOT = pytest.mark.skipif(not DOT, reason="no AVX512-BF16 on this CPU (or LLMD_BF16_DOT=0)")
BF16_PATHS = {"amx": pytest.param(cpu_native.set_amx, cpu_native.tile_scores, marks=NO_AMX),
              "dot": pytest.param(cpu_native.set_dot, cpu_native.dot_scores, marks=NO_DOT)}


@contextlib.contextmanager
def only_path(switch, head_dim: int, group: int):
    """The tile path off while the dot path is under test (it goes first where both exist); both
    back on afterwards."""
    try:
        if switch is cpu_native.set_dot:
            cpu_native.set_amx(False, head_dim, group)
        yield
    finally:
        cpu_native.set_amx(True, head_dim, group)
        cpu_native.set_dot(True, head_dim, group)


@pytest.mark.parametrize("switch,takes", BF16_PATHS.values(), ids=BF16_PATHS.keys())
@pytest.mark.parametrize("values", TILE_CASES, ids=lambda v: "-".join(str(x) for x in v))
def test_bf16_paths_match_float64_and_the_vector_kernel(values, switch, takes):
    """bfloat16 queries over a bfloat16 cache: scores on the AMX tile unit (amx_decode.h) or by
    VDPBF16PS (bf16dp_decode.h) against the float64 reference and the same kernel with that path
    off, float32 outputs (so the comparison is not hidden by the output's bfloat16 rounding):
    both within 1e-5 of float64 (measured <= 2.1e-7 on either path), and not bit-equal to
    each other (the path ran)."""
    case = dict(zip(("kind", "group", "block_size", "head_dim", "window"), values), fmt="auto", dtype=torch.bfloat16)
    if takes is cpu_native.tile_scores and case["block_size"] % 16:
        pytest.skip("the tile path takes blocks of a multiple of 16 slots")
    meta, query, cache = make_step(case, seed=5)
    q, scale = query.to(torch.bfloat16), case["head_dim"] ** -0.5
    plan = cpu_plan.get_plan(meta, 2, case["window"], case["group"], native=True)
    outs = {}
    with only_path(switch, case["head_dim"], case["group"]):
        assert takes(cache.data.dtype, q.dtype, case["block_size"], case["head_dim"])
        for on in (True, False):
            assert switch(on, case["head_dim"], case["group"]) == on
            outs[on] = torch.zeros(q.shape, dtype=torch.float32)
            cpu_native.decode(q, cache, plan.native, scale, outs[on])
    ref = reference.paged_attention(q.double(), cache, meta, scale, case["window"], compute_dtype=torch.float64)
    rows = plan.native.tokens
    for on in (True, False):
        assert rel(outs[on][rows], ref[rows]) <= 1e-5, on
    assert not torch.equal(outs[True][rows], outs[False][rows])


@pytest.mark.parametrize("env,report", [("LLMD_AMX_ATTENTION", "amx_available"), ("LLMD_BF16_DOT", "dot_available")])
def test_the_bf16_path_switches(env, report):
    """``LLMD_AMX_ATTENTION=0`` / ``LLMD_BF16_DOT=0`` keep the vector kernel (and a CPU without
    AMX / AVX512-BF16 reports none)."""
    code = f"from llmd.kernels import cpu_native; print(cpu_native.available(), cpu_native.{report}())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, env: "0"})
    assert res.returncode == 0 and res.stdout.split() == ["True", "False"], (res.stdout, res.stderr)


@pytest.mark.parametrize("switch,takes", BF16_PATHS.values(), ids=BF16_PATHS.keys())
def test_bf16_paths_on_random_shapes(switch, takes):
    """30 random steps through the tile or dot path (KV heads 1-8, so the heads-per-task split
    varies; G 1-16, head_dim 32-256, blocks 16/32/64/128 (and 8/24/48 for the dot path), lengths 1-300,
    random window starts) against a float64 softmax(q Kᵀ) V and log-sum-exp computed here from
    the cache's rows (measured <= 5.6e-7 tile, <= 5.7e-7 dot)."""
    import random

    from llmd.kernels.bench import random_paged_layout
    from llmd.quant.kv import PagedKVCache, get_format

    rng = random.Random(1)
    sizes = [16, 32, 64, 128] if takes is cpu_native.tile_scores else [8, 16, 24, 32, 48, 128]
    for it in range(30):
        kvh, group = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 3, 4, 5, 8, 16])
        hd, bs, batch = rng.choice([32, 64, 128, 256]), rng.choice(sizes), rng.randint(1, 12)
        g = torch.Generator().manual_seed(it)
        lens = [rng.randint(1, 300) for _ in range(batch)]
        tables, slots, nb = random_paged_layout(lens, bs, g)
        cache = PagedKVCache.allocate((2, nb, bs, kvh, hd), get_format("auto"), torch.bfloat16, "cpu")
        cache.data.copy_(torch.randn(cache.data.shape, generator=g) * 2)
        first = torch.tensor([rng.choice([0, 0, rng.randint(0, n - 1)]) for n in lens])
        q = torch.randn(batch, kvh * group, hd, generator=g).bfloat16()
        d = cpu_native.Decodes(torch.arange(batch), torch.arange(batch), first, torch.tensor(lens), tables)
        out, lse = torch.zeros(q.shape), torch.zeros(q.shape[:2])
        with only_path(switch, hd, group):
            assert takes(torch.bfloat16, torch.bfloat16, bs, hd)
            cpu_native.decode(q, cache, d, hd**-0.5, out, lse)
        for b in range(batch):
            sl = slots[b][first[b] : lens[b]]
            k, v = (cache.data[i].reshape(-1, kvh, hd)[sl].double() for i in (0, 1))
            s = torch.einsum("hgd,nhd->hgn", q[b].double().view(kvh, group, hd), k) * hd**-0.5
            ref = torch.einsum("hgn,nhd->hgd", s.softmax(-1), v).reshape(kvh * group, hd)
            assert rel(out[b], ref) <= 1e-5, (it, kvh, group, hd, bs, lens[b], int(first[b]))
            assert torch.allclose(lse[b].double(), torch.logsumexp(s, -1).reshape(-1), atol=1e-4, rtol=0)


def test_unserved_reason_names_the_limit():
    """The startup line's reason when the decodes take the torch ops: the limit that failed,
    and None exactly when serves() and supports_shape() both hold."""
    from llmd.quant.kv import get_format

    auto, int8 = get_format("auto"), get_format("int8")
    assert cpu_native.unserved_reason(auto, torch.bfloat16, 160, 64, 3) == "block size 160 > 128"
    assert cpu_native.unserved_reason(auto, torch.float64, 16, 64, 3).startswith("compute dtype float64")
    assert cpu_native.unserved_reason(get_format("int8", 32), torch.float32, 16, 64, 3).startswith("grouped KV")
    assert cpu_native.unserved_reason(auto, torch.float32, 16, 72, 3).startswith("head_dim 72")
    assert cpu_native.unserved_reason(auto, torch.float32, 16, 64, 17) == "17 query heads per KV head > 16"
    for fmt, cdt, bs, hd, g in [(auto, torch.bfloat16, 16, 64, 3), (int8, torch.float32, 32, 256, 16),
                                (auto, torch.float32, 8, 128, 1), (auto, torch.bfloat16, 128, 64, 3)]:
        assert cpu_native.unserved_reason(fmt, cdt, bs, hd, g) is None
        assert cpu_native.serves(fmt, cdt, bs) and cpu_native.supports_shape(hd, g)


def test_startup_line_names_the_bf16_path(tmp_path):
    """A bfloat16 engine's startup line says which bfloat16 path scores its decodes: AMX tiles
    where granted, else VDPBF16PS where the CPU has AVX512-BF16, else neither (the generic kernel)."""
    from tiny_engine import ByteTokenizer
    from tiny_gguf import write_tiny_llama

    from llmd.daemon.core.config import EngineConfig
    from llmd.daemon.core.engine import Engine
    from llmd.models.gguf_loader import load_model

    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, vocab=256, hidden=192, heads=3, kv_heads=1, ffn=384)  # head_dim 64
    model, _ = load_model(path, torch.bfloat16)
    cfg = EngineConfig(model="tiny", device="cpu", dtype="bfloat16", attention_backend="cpu",
                       kv_cache_memory=4 * 2**20, threads=1)
    line = Engine(model, ByteTokenizer(), cfg).runtime_summary()
    want = "scores on AMX tiles" if AMX else "scores by VDPBF16PS" if DOT else None
    if want:
        assert f"(decodes: C kernel, {want}" in line, line
    else:
        assert "(decodes: C kernel" in line and "scores" not in line, line
