"""Issue 19: the int4 KV format (two codes per byte; V with a float16 scale per 16 channels, K
per channel per block: tests/kernels/test_kivi_int4.py) and ``--kv-rotation hadamard`` (QuaRot
arXiv:2404.00456): formats round trip, the rotated unquantized path equals the unrotated one,
the cpu fast path and the torch reference agree with float64 on the same stored bytes, sizes,
configuration and the prefix-cache hash."""

from __future__ import annotations

import os

import pytest
import torch
from kv_rotation_support import make_step, rel

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.kv_size import kv_cache_bytes_per_token, kv_size_rows
from llmd.daemon.kv.prefix_cache import extra_keys
from llmd.kernels import ops, reference
from llmd.quant.kv import compute_scales, dequantize, get_format, pack_int4, quantize, unpack_int4
from llmd.quant.rotation import hadamard, rotate

INT4 = get_format("int4")


def test_int4_pack_unpack_roundtrip():
    codes = torch.randint(-8, 8, (7, 3, 64), generator=torch.Generator().manual_seed(0))
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 3, 32)
    assert torch.equal(packed[0, 0, 0], ((codes[0, 0, 0] + 8) | ((codes[0, 0, 1] + 8) << 4)).to(torch.uint8))
    assert torch.equal(unpack_int4(packed), codes.to(torch.int8))


@pytest.mark.parametrize("head_dim", [64, 256])
def test_int4_quantize_roundtrip(head_dim):
    """Per (token, head, 16 channels): |x − code × scale| ≤ scale / 2, codes in [-7, 7], and the
    group holding the amax reproduces it exactly (code ±7)."""
    x = torch.randn(50, 2, head_dim, generator=torch.Generator().manual_seed(1)) * 3
    x[:, :, 5] *= 20  # an outlier channel: only its own group's scale grows
    s = compute_scales(x, INT4)
    assert s.shape == (50, 2, head_dim // 16) and s.dtype == torch.float32
    assert torch.equal(s, s.half().float())  # rounded to the stored float16 before quantizing
    q = quantize(x, s, INT4)
    assert q.shape == (50, 2, head_dim // 2) and q.dtype == torch.uint8
    codes = unpack_int4(q)
    assert codes.abs().max() <= 7
    back = dequantize(q, s)
    step = s.repeat_interleave(16, dim=-1)
    assert ((back - x).abs() <= step / 2 + 1e-6).all()
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-3)  # ±7 × the float16-rounded scale
    assert s[:, :, 0].mean() > 5 * s[:, :, 1].mean()  # grouped, not one scale per head


def test_hadamard_is_orthonormal_and_its_own_inverse():
    h = hadamard(64, torch.float64)
    assert torch.allclose(h @ h, torch.eye(64, dtype=torch.float64), atol=1e-14)
    assert torch.equal(h, h.T) and torch.allclose(h.abs(), torch.full_like(h, 64**-0.5))
    x = torch.randn(5, 3, 64, dtype=torch.float64)
    assert torch.allclose(rotate(rotate(x, "hadamard"), "hadamard"), x, atol=1e-14)
    spiky = torch.zeros(64)
    spiky[3] = 1.0
    assert rotate(spiky, "hadamard").abs().max() == 64**-0.5  # an outlier spread over every channel
    with pytest.raises(ValueError, match="power of two"):
        hadamard(96)


@pytest.mark.parametrize("backend,dtype,tol", [("torch", torch.float64, 1e-13), ("torch", torch.float32, 1e-5),
                                               ("cpu", torch.float32, 1e-5)])
def test_unquantized_rotated_path_equals_unrotated(backend, dtype, tol):
    """q·k is unchanged by rotating q and K with H: an unquantized cache with the rotation gives
    the unrotated outputs to rounding, while it really stores ``K H`` (the rotation is applied,
    not skipped) and V as it is."""
    meta, q, plain, keys = make_step("auto", "none", backend, dtype)
    _, _, rotated, _ = make_step("auto", "hadamard", backend, dtype)
    k0 = keys[0][0]
    slot0 = int(meta.block_tables[0, 0]) * 16
    stored = rotated.data[0].view(-1, 2, 64)[slot0]
    assert torch.allclose(stored, rotate(k0[0], "hadamard"), atol=1e-6) and not torch.allclose(stored, k0[0])
    assert torch.equal(rotated.data[1].view(-1, 2, 64)[slot0], keys[0][1][0])  # V unrotated
    out_plain = ops.paged_attention(q, plain, meta, 0.125)
    out_rot = ops.paged_attention(q, rotated, meta, 0.125)
    assert rel(out_rot, out_plain) <= tol


CASES = [("int8", "hadamard"), ("fp8_e4m3", "hadamard")]  # int4: tests/kernels/test_kivi_int4.py


@pytest.mark.parametrize("fmt,rotation", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_matches_float64_reference_on_the_same_bytes(fmt, rotation, dtype):
    """The cpu fast path (int4: gather codes, unpack, scale per group) vs the torch reference
    computing in float64 over the same stored bytes: ≤ 1e-5 in float32, ≤ 2e-2 in bfloat16
    (the tolerances of test_cpu_attention.py)."""
    meta, q, cache, _ = make_step(fmt, rotation, "cpu", dtype, seed=3)
    out = ops.paged_attention(q, cache, meta, 0.125)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = reference.paged_attention(rotate(q.double(), rotation), cache, meta, 0.125, compute_dtype=torch.float64)
    assert rel(out, ref) <= (1e-5 if dtype == torch.float32 else 2e-2)


def test_int4_sizes(smollm2):
    """SmolLM2 blocks: 2 · 30 · 3 · 64 · 0.6875 = 7,920 B/token (K: 32 code bytes + a float16
    scale and zero point per channel per 16 tokens; V: 32 + 8), 2.91× the blocks of 16-bit;
    with the residual of 64 sequences (11.25 MiB) out of 512 MiB: 2.85× (target ≥ 2.75×)."""
    cfg = smollm2[1]
    assert kv_cache_bytes_per_token(cfg, "int4", torch.bfloat16) == 7_920
    rows = {r.name: r for r in kv_size_rows(cfg, 8192, 512 * 2**20, 16)}
    assert 2.75 <= rows["int4"].num_blocks / rows["bf16/fp16"].num_blocks < 2.91
    assert rows["int4"].bytes_per_token > 7_920  # the residual amortized over the pool


def test_engine_int4_cache_and_startup_line(make_engine):
    e = make_engine(kv_cache_dtype="int4", kv_cache_memory=64 * 2**20, max_num_seqs=8)
    residual = 30 * 8 * 16 * 3 * 64 * 2  # 30 layers x 8 slots x [16, 3, 64] float16
    assert e.residual_bytes == residual and e.num_blocks == (64 * 2**20 - residual) // (16 * 7_920)
    assert e.runner.kv_caches[0].dtype == torch.uint8 and e.runner.kv_caches[0].shape[-1] == 32
    # per block: K scales [3, 64] + zero points [3, 64] + V scales [16, 3, 4], float16
    assert e.runner.kv_scales[0].shape == (1, e.num_blocks, 576) and e.runner.kv_scales[0].dtype == torch.float16
    assert e.runner.layer_caches[0].residual.shape == (8, 16, 3, 64)
    assert e.runner.layer_caches[0].residual.dtype == torch.float16  # a float32 model: float16 residual
    assert e.runner.layer_caches[0].rotation == "none"  # the default for int4 (KIVI): measured better
    line = e.capacity_summary()
    assert "K per channel over each 16-token block" in line and "16-bit residual (1.4 MiB, 8 slots)" in line
    assert "rotation" not in line and "2.84x the blocks of 16-bit" in line


def test_config_rotation_defaults_and_refusals(monkeypatch):
    assert EngineConfig(device="cpu", kv_cache_dtype="int8").resolve().kv_rotation == "hadamard"
    assert EngineConfig(device="cpu", kv_cache_dtype="fp8_e4m3").resolve().kv_rotation == "none"
    assert EngineConfig(device="cpu").resolve().kv_rotation == "none"
    with pytest.raises(LlmdError, match="needs a quantized"):
        EngineConfig(device="cpu", kv_rotation="hadamard").resolve()
    with pytest.raises(LlmdError, match="kv-rotation must be"):
        EngineConfig(device="cpu", kv_cache_dtype="int8", kv_rotation="spin").resolve()
    with pytest.raises(LlmdError, match="8-bit"):
        EngineConfig(device="cpu", kv_cache_dtype="int4", kv_scales=(1.0, 1.0)).resolve()
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "1")
    from llmd.daemon.core.engine import check_triton_backend

    check_triton_backend(_cfg(64), torch.bfloat16, 16, "int4")  # int4 has Triton kernels (kernels/kivi_*.py)
    with pytest.raises(LlmdError, match="--block-size a power of two >= 16 with --kv-cache-dtype int4"):
        check_triton_backend(_cfg(64), torch.bfloat16, 8, "int4")


def _cfg(head_dim: int):
    from types import SimpleNamespace

    return SimpleNamespace(head_dim=head_dim, num_heads=6, num_kv_heads=2)


def test_head_dim_refusals():
    from llmd.daemon.core.engine import check_kv_layout

    with pytest.raises(LlmdError, match="multiple of 16"):
        check_kv_layout(_cfg(40), "int4", "none")
    with pytest.raises(LlmdError, match="power of two"):
        check_kv_layout(_cfg(96), "int8", "hadamard")
    check_kv_layout(_cfg(96), "int8", "none")


def test_prefix_cache_hash_separates_rotation(make_engine):
    """A block written under one scheme is never read under another: the KV dtype, the scales
    and the rotation are all in the block hash's extra keys."""
    engines = [make_engine(kv_cache_dtype=d, kv_rotation=r, kv_cache_memory=8 * 2**20, max_num_seqs=4)
               for d, r in (("int8", "none"), ("int8", "hadamard"), ("int4", "hadamard"), ("int4", "none"))]
    keys = {extra_keys(e.kv_manager.model_id, e.kv_manager.kv_cache_dtype, None) for e in engines}
    assert len(keys) == 4
    assert engines[2].kv_manager.kv_cache_dtype.startswith("int4-kivi16|")  # the scheme, not just the name
    with pytest.raises(LlmdError, match="open-block residual"):
        make_engine(kv_cache_dtype="int4", kv_cache_memory=8 * 2**20, max_num_seqs=64)
