"""The C layer glue (kernels/cpu_glue.py, kernels/native/layer_glue.c) against torch's bfloat16 ops:
RoPE bit for bit; RMSNorm and SwiGLU equal but for rare one-ulp differences (measured and bounded
here), on many shapes, strided rows, small and large (threaded) row counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmd.kernels import cpu_glue
from llmd.kernels.native import build
from llmd.models.layers import apply_rope, rope_tables

pytestmark = pytest.mark.skipif(build.load_glue() is None, reason="no C compiler for the native glue")

ROWS = (1, 3, 32, 70, 600)  # from 4096 elements (layer_glue.c team_rows; 32768 for int8) the threaded split


@pytest.fixture(autouse=True)
def glue_on(monkeypatch):
    monkeypatch.setattr(cpu_glue, "active", True)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bfloat16 ulps of the larger magnitude (as int16 bit distance for same-sign values)."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ai - bi).abs()


@pytest.mark.parametrize("dim", [576, 64, 100, 88, 7])  # 88 = 2 pairs of vectors + 1 + 8: every path
def test_rms_norm_matches_torch_within_two_ulps(dim):
    g = torch.Generator().manual_seed(dim)
    w = (torch.rand(dim, generator=g) * 2).bfloat16()
    eps = 1e-5
    total = diff = 0
    for rows in ROWS:
        for scale in (1e-3, 1.0, 30.0):
            x = (torch.randn(rows, dim, generator=g) * scale).bfloat16()
            want = w * F.rms_norm(x, (dim,), eps=eps)
            got = cpu_glue.rms_norm(x, w, eps)
            assert got.shape == x.shape and got.dtype == torch.bfloat16
            d = ulps(got, want)
            assert int(d.max()) <= 2, (rows, scale)  # y one ulp off, then rounded again in w · y
            total, diff = total + d.numel(), diff + int((d > 0).sum())
    wide = torch.randn(5, 2 * dim, generator=g).bfloat16()[:, :dim]  # strided rows
    assert int(ulps(cpu_glue.rms_norm(wide, w, eps), w * F.rms_norm(wide, (dim,), eps=eps)).max()) <= 2
    x3 = torch.randn(4, 3, dim, generator=g).bfloat16()
    assert cpu_glue.rms_norm(x3, w, eps).shape == (4, 3, dim)
    print(f"rms_norm dim {dim}: {diff} of {total} differ")
    assert diff / total < 1e-3  # the order of the sum of squares moves r by an ulp, rarely visible
    tiny = (w.float() * 1e-38).bfloat16()  # subnormal outputs (the vector store's fallback), not flushed
    x = torch.randn(3, dim, generator=g).bfloat16()
    got, want = cpu_glue.rms_norm(x, tiny, eps), tiny * F.rms_norm(x, (dim,), eps=eps)
    assert got.abs().max() > 0 and int(ulps(got, want).max()) <= 2


@pytest.mark.parametrize("heads,d", [(12, 64), (3, 128), (2, 18)])
def test_rope_bit_for_bit(heads, d):
    g = torch.Generator().manual_seed(heads * d)
    for rows in ROWS:
        pos = torch.randint(0, 5000, (rows,), generator=g)
        cos, sin = rope_tables(pos, d, 10000.0, torch.bfloat16)
        qkv = torch.randn(rows, heads + 4, d, generator=g).bfloat16()
        qkv[0, 0] *= 1e-37  # subnormal products and sums (the vector store's fallback), not flushed
        x = qkv[:, :heads]  # rows strided, as a slice of the fused QKV output
        got = cpu_glue.rope(x, cos, sin)
        assert got.is_contiguous() and torch.equal(got, apply_rope(x, (cos, sin))), rows
        both = torch.cat((cos, sin), 1)  # RopeCache's [T, 2, d] gather: tables with row stride 2d
        assert torch.equal(cpu_glue.rope(x, both[:, :1], both[:, 1:]), apply_rope(x, (cos, sin)))


@pytest.mark.parametrize("inter", [1536, 64, 48, 40])
def test_silu_mul_matches_torch_within_an_ulp(inter):
    g = torch.Generator().manual_seed(inter)
    total = diff = 0
    for rows in ROWS:
        for scale in (0.1, 3.0, 40.0):
            gu = (torch.randn(rows, 2 * inter, generator=g) * scale).bfloat16()
            want = F.silu(gu[:, :inter]) * gu[:, inter:]
            got = cpu_glue.silu_mul(gu)
            d = ulps(got, want)
            d[(got.float().abs() < 1e-30) & (want.float().abs() < 1e-30)] = 0  # silu(g < -87) taken as 0
            assert int(d.max()) <= 1, (rows, scale)
            total, diff = total + d.numel(), diff + int((d > 0).sum())
    print(f"silu_mul inter {inter}: {diff} of {total} differ")
    assert diff / total < 1e-3


@pytest.mark.parametrize("inter", [128, 1040])
def test_silu_lookup_is_the_computed_silu(inter):
    """The bfloat16 SwiGLU's silu(gate) comes from a table of the 65536 bfloat16 gates (filled by
    the vector silu as the library loads): for every gate it is bit for bit the float32 glue's
    computed silu (the same vector code) rounded to bfloat16; subnormal, infinite and NaN gates
    included (up = 1). Then times up, rounded once: silu · up of tiny ups (subnormal products)."""
    lib = build.load_glue()
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    gate = torch.cat((bits, bits[: -len(bits) % inter])).view(torch.bfloat16).view(-1, inter)
    rows = gate.shape[0]
    ones = torch.ones_like(gate)
    got = cpu_glue.silu_mul(torch.cat((gate, ones), 1))
    gu32 = torch.cat((gate, ones), 1).float()
    want = torch.empty(rows, inter)
    lib.llmd_silu_mul_f32(gu32.data_ptr(), 2 * inter, rows, inter, want.data_ptr(), 1)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.bfloat16().view(torch.int16)[~nan])
    up = (torch.randn(gate.shape, generator=torch.Generator().manual_seed(inter)) * 1e-36).bfloat16()
    got = cpu_glue.silu_mul(torch.cat((gate, up), 1))
    fin = want.isfinite()
    want = (want.bfloat16().float() * up.float()).bfloat16()  # one rounding of the float32 product
    assert torch.equal(got.view(torch.int16)[fin], want.view(torch.int16)[fin])
    assert (got[fin].float().abs() < 1.2e-38).sum() > 1000  # subnormal products, not flushed


def test_declines_what_it_does_not_serve(monkeypatch):
    x = torch.randn(4, 64)
    w = torch.ones(64)
    assert cpu_glue.rms_norm(x, w, 1e-5) is None  # float32: torch's ops
    assert cpu_glue.silu_mul(x) is None
    xb = x.bfloat16()
    assert cpu_glue.rms_norm(xb.t().contiguous().t(), w.bfloat16(), 1e-5) is None  # columns strided
    monkeypatch.setattr(cpu_glue, "active", False)
    assert cpu_glue.rms_norm(xb, w.bfloat16(), 1e-5) is None


def test_engine_uses_glue_for_bfloat16_only(tmp_path):
    """A bfloat16 engine on the cpu backend runs the glue (its runner says so and the forward
    sets :data:`cpu_glue.active`); float32 and ``--disable-native-kernels`` do not. Teacher-forced
    logits of a 40-token prompt with and without it agree to bfloat16 rounding."""
    from tiny_engine import tiny_engine

    from llmd.daemon.core.config import EngineConfig
    from llmd.daemon.core.engine import Engine
    from llmd.models.gguf_loader import load_model

    base = tiny_engine(tmp_path / "t.gguf")
    assert not base.runner.native_glue  # float32
    model, _ = load_model(str(tmp_path / "t.gguf"), torch.bfloat16, "cpu")
    kw = dict(model=str(tmp_path / "t.gguf"), device="cpu", dtype="bfloat16", attention_backend="cpu",
              kv_cache_memory=4 << 20, max_model_len=256, weight_quant="none")
    on = Engine(model, base.tokenizer, EngineConfig(**kw).resolve())
    off = Engine(model, base.tokenizer, EngineConfig(**kw, disable_native_kernels=True).resolve())
    assert on.runner.native_glue and not off.runner.native_glue
    ids = list(range(3, 43))
    tables = [[1, 2, 3]] * len(on.kv_cache_groups)
    a = on.runner.prefill_logits("a", ids, 0, tables)
    assert cpu_glue.active
    b = off.runner.prefill_logits("b", ids, 0, tables)
    assert not cpu_glue.active
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("dim", [576, 64, 88, 7])
def test_add_rms_norm_is_the_add_then_the_norm(dim):
    """``residual += y`` rounds as torch's bfloat16 add (bit for bit) and the output is
    :func:`cpu_glue.rms_norm` of the new residual (bit for bit), strided ``y`` rows included."""
    g = torch.Generator().manual_seed(dim)
    w = (torch.rand(dim, generator=g) * 2).bfloat16()
    for rows in ROWS:
        res = (torch.randn(rows, dim, generator=g) * 3).bfloat16()
        wide = torch.randn(rows, dim + 5, generator=g).bfloat16()
        for y in (wide[:, :dim].contiguous(), wide[:, :dim]):
            want_res = res + y
            want = cpu_glue.rms_norm(want_res, w, 1e-5)
            got_res = res.clone()
            got = cpu_glue.add_rms_norm(y, got_res, w, 1e-5)
            assert torch.equal(got_res, want_res) and torch.equal(got, want), rows
    assert cpu_glue.add_rms_norm(y, res.float(), w, 1e-5) is None  # float32 residual: torch's ops
    assert cpu_glue.add_rms_norm(y, res[:, :3], w, 1e-5) is None  # shapes disagree


@pytest.mark.parametrize("heads,kv_heads,d,block", [(9, 3, 64, 16), (4, 2, 16, 32), (2, 2, 18, 16)])
def test_rope_store_equals_rope_then_store_kv(heads, kv_heads, d, block):
    """Q rotated as :func:`apply_rope`, K rotated and V copied into an ``auto`` bfloat16 cache at
    the step's slots exactly as rope + ``reference.store_kv`` (padding slots -1 untouched), on
    the CPU pool's skewed planes (kv_planes) and a contiguous cache."""
    from llmd.kernels import reference
    from llmd.quant.kv import kv_planes

    g = torch.Generator().manual_seed(heads * d)
    num_blocks = 40
    shape = (2, num_blocks, block, kv_heads, d)
    for rows in ROWS[:4]:
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * d + 8, generator=g).bfloat16()[:, :-8]  # strided rows
        cos, sin = rope_tables(torch.randint(0, 3000, (rows,), generator=g), d, 10000.0, torch.bfloat16)
        slots = torch.randperm(num_blocks * block, generator=g)[:rows]
        if rows > 2:
            slots[1] = -1  # a padded row: nothing stored
        for got_kv in (kv_planes(shape, torch.bfloat16, "cpu"), torch.zeros(shape, dtype=torch.bfloat16)):
            want_kv = torch.zeros(shape, dtype=torch.bfloat16)
            view = qkv.view(rows, heads + 2 * kv_heads, d)
            qk = apply_rope(view[:, : heads + kv_heads], (cos, sin))
            reference.store_kv(qk[:, heads:], view[:, heads + kv_heads :], want_kv, slots, padded=True)
            q = cpu_glue.rope_store(qkv, heads, kv_heads, cos, sin, got_kv, slots)
            assert q.shape == (rows, heads, d) and q.is_contiguous()
            assert torch.equal(q, qk[:, :heads]), rows
            assert torch.equal(got_kv, want_kv), rows
    assert cpu_glue.rope_store(qkv.float(), heads, kv_heads, cos, sin, got_kv, slots) is None
    assert cpu_glue.rope_store(qkv, heads, kv_heads, cos, sin, got_kv.float(), slots) is None
    assert cpu_glue.rope_store(qkv, heads, kv_heads, cos, sin, got_kv, slots.int()) is None


@pytest.mark.parametrize("kv_heads,d,block,rotation", [(3, 64, 16, "hadamard"), (2, 16, 32, "none")])
def test_store_int8_equals_the_reference_quantized_store(kv_heads, d, block, rotation):
    """Into an int8 cache (the engine's own allocation: skewed code and scale planes): the same
    codes and float32 scales as ``reference.store_kv`` (its compute_scales + quantize), from K
    and V that are strided views of one projection row, on rows that include exact .5 ties of
    x / scale, an all-zero head (the scale floor) and a padded slot; grouped or static scales
    are refused (False, nothing stored)."""
    from llmd.kernels import reference
    from llmd.quant.kv import PagedKVCache
    from llmd.quant.kv_format import get_format

    g = torch.Generator().manual_seed(d)
    num_blocks = 40
    shape = (2, num_blocks, block, kv_heads, d)
    for rows in ROWS[:4]:
        kv = torch.randn(rows, 2 * kv_heads + 3, d, generator=g).bfloat16()  # K heads, V heads, 3 more: strided rows
        key, value = kv[:, :kv_heads], kv[:, kv_heads : 2 * kv_heads]
        value[0, 0] = 0.0  # a zero V head: scale = the floor, codes 0
        value[-1, -1, :3] = torch.tensor([127.0, 0.5, -1.5])  # x / scale = 127, .5, -1.5
        slots = torch.randperm(num_blocks * block, generator=g)[:rows]
        if rows > 2:
            slots[1] = -1
        got, want = (PagedKVCache.allocate(shape, get_format("int8"), torch.bfloat16, "cpu", rotation=rotation)
                     for _ in range(2))
        reference.store_kv(key, value, want, slots, padded=True)
        assert cpu_glue.store_int8(key, value, got, slots)
        assert torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales), rows
        assert got.data.abs().sum() > 0
    grouped = PagedKVCache.allocate(shape, get_format("int8", 16), torch.bfloat16, "cpu")
    static = PagedKVCache.allocate(shape, get_format("int8"), torch.bfloat16, "cpu", static_scales=(0.1, 0.1))
    for refused in (grouped, static):
        assert not cpu_glue.store_int8(key, value, refused, slots)
        assert refused.data.abs().sum() == 0
    assert not cpu_glue.store_int8(key.float(), value, got, slots)
    assert not cpu_glue.store_int8(key, value, got, slots.int())
