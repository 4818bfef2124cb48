"""The float32 layer glue (kernels/native/layer_glue_f32.h, called by models/glue_forward.py)
against torch's float32 ops: RoPE and the K/V store bit for bit (float32 and float16 caches),
SwiGLU within a few float32 ulps, RMSNorm within a few ulps of a float64 one (its Σx² is summed
in double), on several shapes, strided rows, small and threaded row counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmd.kernels.native import build
from llmd.models.layers import apply_rope, rope_tables

lib = build.load_glue()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler for the native glue")

ROWS = (1, 3, 32, 600)  # 600 x 576 > the 32,768-element threshold: the threaded split
THREADS = 2


def close(got: torch.Tensor, want: torch.Tensor, ulps: int) -> None:
    """|got - want| within ``ulps`` float32 ulps of |want| (plus a tiny absolute floor)."""
    tol = want.abs() * (ulps * 2.0**-23) + 1e-30
    bad = (got - want).abs() > tol
    assert not bool(bad.any()), f"{int(bad.sum())} of {bad.numel()} outside {ulps} ulps"


def exact_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float64, rounded once to float32."""
    xd = x.double()
    return (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


@pytest.mark.parametrize("dim", [576, 64, 100, 7])
def test_rms_norm_and_fused_add(dim):
    g = torch.Generator().manual_seed(dim)
    w = torch.rand(dim, generator=g) * 2
    eps = 1e-5
    for rows in ROWS:
        for scale in (1e-3, 1.0, 30.0):
            wide = torch.randn(rows, dim + 3, generator=g) * scale  # rows dim + 3 apart
            x = wide[:, :dim]
            out = torch.empty(rows, dim)
            lib.llmd_rms_norm_f32(x.data_ptr(), dim + 3, w.data_ptr(), rows, dim, eps, out.data_ptr(), THREADS)
            close(out, exact_norm(x, w, eps), 3)
            res = torch.randn(rows, dim, generator=g) * scale
            want_res = res + x
            lib.llmd_add_rms_norm_f32(x.data_ptr(), dim + 3, res.data_ptr(), w.data_ptr(), rows, dim, eps,
                                      out.data_ptr(), THREADS)
            assert torch.equal(res, want_res)  # the residual add is torch's, bit for bit
            close(out, exact_norm(want_res, w, eps), 3)
            close(out, F.rms_norm(want_res, (dim,), w, eps), 8)  # torch sums x² in float32


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 128), (2, 1, 18)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_rope_store_bit_for_bit(heads, kv_heads, d, kv_dtype):
    g = torch.Generator().manual_seed(heads * d)
    blocks, bs = 64, 16
    for rows in ROWS[:3] + (300,):
        pos = torch.randint(0, 5000, (rows,), generator=g)
        cos, sin = rope_tables(pos, d, 10000.0, torch.float32)
        width = (heads + 2 * kv_heads) * d
        qkv = (torch.randn(rows, width + 8, generator=g) * 4)[:, :width]  # strided rows, as a slice would have
        kv = torch.zeros(2, blocks, bs, kv_heads, d, dtype=kv_dtype)
        slots = torch.randperm(blocks * bs, generator=g)[:rows]
        slots[0] = -1  # padding: nothing stored
        q = torch.empty(rows, heads, d)
        c, s = cos[:, 0], sin[:, 0]
        lib.llmd_rope_store_f32(qkv.data_ptr(), width + 8, rows, heads, kv_heads, d, c.data_ptr(), c.stride(0),
                                s.data_ptr(), s.stride(0), q.data_ptr(), kv.data_ptr(), kv.stride(0),
                                slots.data_ptr(), int(kv_dtype == torch.float16), THREADS)
        x = qkv.view(rows, heads + 2 * kv_heads, d)
        qk = apply_rope(x[:, : heads + kv_heads], (cos, sin))
        assert torch.equal(q, qk[:, :heads])
        flat = kv.view(2, blocks * bs, kv_heads, d)
        keep = slots >= 0
        assert torch.equal(flat[0, slots[keep]], qk[keep, heads:].to(kv_dtype))
        assert torch.equal(flat[1, slots[keep]], x[keep, heads + kv_heads:].to(kv_dtype))
        stored = torch.zeros(blocks * bs, dtype=torch.bool)
        stored[slots[keep]] = True
        assert not flat[:, ~stored].any()  # nothing else written


@pytest.mark.parametrize("inter", [1536, 64, 13])
def test_silu_mul(inter):
    g = torch.Generator().manual_seed(inter)
    for rows in ROWS:
        gu = torch.randn(rows, 2 * inter + 5, generator=g) * 6
        gu[0, :4] = torch.tensor([-100.0, -88.0, 0.0, 90.0])  # past exp's clamp, zero, large
        out = torch.empty(rows, inter)
        lib.llmd_silu_mul_f32(gu.data_ptr(), 2 * inter + 5, rows, inter, out.data_ptr(), THREADS)
        want = F.silu(gu[:, :inter]) * gu[:, inter: 2 * inter]
        close(out, want, 6)  # paged_decode.c's exp (1-2 ulp), the division, the product
