"""Grouped int8 weights (``llmd.quant.int8_groups``, CPU ``--weight-quant int8``): the codes and
scales of the quantizer, the nibble-split pack read back exactly, and both kernels (the bfloat16
nibble split over torch's int4 kernel, dequantize + matmul) against a float64 matmul of
``codes · scales``."""

import pytest
import torch

from llmd.quant import int8_groups as ig


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Float32 ``[n, k]`` whose groups of 32 span ~8 decades of magnitude, one group all zero."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(4 * torch.randn(n, k // 32, 1, generator=g))
    w = (torch.randn(n, k // 32, 32, generator=g) * mag).reshape(n, k)
    w[1, 32:64] = 0
    return w


def _reference(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    return (codes.double().view(n, -1, 32) * scale.double()[..., None]).view(n, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_codes_and_scales(dtype):
    w = _weights(64, 256)
    codes, scale = ig.quantize(w, dtype)
    assert codes.dtype == torch.int8 and scale.shape == (64, 8) and scale.dtype == torch.float32
    assert codes.abs().max() <= 127
    amax = w.view(64, 8, 32).abs().amax(-1)
    assert scale[1, 1] == 1 and (codes[1, 32:64] == 0).all()  # the all-zero group
    nz = amax > 0
    if dtype == torch.bfloat16:  # rounded up to exact bfloat16 values: >= absmax / 127, < one bf16 step above
        assert torch.equal(scale.bfloat16().float(), scale)
        assert (scale[nz] >= amax[nz] / 127).all() and (scale[nz] <= amax[nz] / 127 * (1 + 2**-7)).all()
    else:
        assert torch.equal(scale[nz], amax[nz] / 127)
    err = (_reference(codes, scale) - w.double()).abs().view(64, 8, 32)
    assert (err <= scale.double()[..., None] * (0.5 + 1e-6)).all()  # round to nearest
    with pytest.raises(ValueError, match="K % 32"):
        ig.quantize(torch.ones(4, 48), dtype)


@pytest.mark.parametrize("n,dtype", [(96, torch.bfloat16), (48, torch.bfloat16), (96, torch.float32)])
def test_pack_reads_back_exactly(n, dtype):
    """The nibble-split pack (bfloat16, N % 32 == 0) dequantizes to exactly ``codes · s`` in
    bfloat16 (transposed, ``[K, N]``); other shapes and float32 keep the codes themselves."""
    codes, scale = ig.quantize(_weights(n, 128), dtype)
    packed, scales = ig.pack(codes, scale, dtype)
    want = _reference(codes, scale).to(dtype)
    if n % 32 == 0 and dtype == torch.bfloat16:
        assert packed.shape == (2 * n, 64) and packed.dtype == torch.uint8 and scales.shape == (4, 2 * n, 2)
        assert torch.equal(ig.dequantize(packed, scales).t(), want)
        assert torch.equal(ig.dequantize(packed, scales, rows=slice(32, 96)).t(), want[32:96])
    else:
        assert torch.equal(packed, codes) and scales.dtype == dtype
        assert torch.equal(ig.dequantize(packed, scales), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 4, 33])
@pytest.mark.parametrize("kernel", ["small", "large"])
def test_linear_matches_float64(dtype, m, kernel, monkeypatch):
    """Both paths at M = 1, 4, 33 (``small``: the nibble-split kernel for bfloat16, every M;
    ``large``: dequantize + matmul, in chunks of 64 rows here) vs float64 ``x · (codes · s)ᵀ``.

    Bounds, elementwise against ``|x| · |w|ᵀ`` (the sum's own scale): float32 1e-5 (the
    dequantized weights are exact); bfloat16 2⁻⁶: the kernel rounds each half's output and their
    sum to bfloat16 (≤ ~1.5 ulp), the dense path once."""
    n, k = 192, 256
    codes, scale = ig.quantize(_weights(n, k, seed=m), dtype)
    packed, scales = ig.pack(codes, scale, dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    w = _reference(codes, scale)
    ref, size = x.double() @ w.t(), x.double().abs() @ w.abs().t()
    if kernel == "large":
        monkeypatch.setattr(ig, "CHUNK", 64 * k)  # three chunks of 64 rows
    y = ig.linear(x, packed, scales, small_batch=10**6 if kernel == "small" else 0)
    assert y.shape == (m, n) and y.dtype == dtype
    tol = 2**-6 if dtype == torch.bfloat16 else 1e-5
    assert ((y.double() - ref).abs() <= tol * size).all(), ((y.double() - ref).abs() / size).max()
    if dtype == torch.float32:
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_unknown_pack_layout_runs_the_kernel_for_every_batch(monkeypatch):
    """Where the probe finds no known int4 pack layout, nothing is unpacked: the kernel (layout-free)
    serves every M, and :func:`dequantize` refuses."""
    monkeypatch.setattr(ig, "pack_block", lambda: 0)
    codes, scale = ig.quantize(_weights(64, 128), torch.bfloat16)
    packed, scales = ig.pack(codes, scale, torch.bfloat16)
    x = torch.randn(40, 128).bfloat16()
    ref = x.double() @ _reference(codes, scale).t()
    y = ig.linear(x, packed, scales, small_batch=4)
    assert ((y.double() - ref).abs() <= 2**-6 * (x.double().abs() @ _reference(codes, scale).abs().t())).all()
    with pytest.raises(ValueError, match="cannot be unpacked"):
        ig.dequantize(packed, scales)


def test_probe_finds_this_machines_layout():
    assert ig.pack_block() in (64, 32)  # AVX-512 or AVX2 builds of torch's pack
