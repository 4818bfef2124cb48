"""Context-shift re-rotation (``llmd.kernels.kv_shift.shift_keys``) against RoPE computed at the
new positions from scratch, for auto / int8 / fp8 caches, with and without the K rotation, on
SmolLM2's and Gemma 3's head sizes and RoPE bases (Gemma: 10,000 local, 1e6 global)."""

from __future__ import annotations

import pytest
import torch

from llmd.kernels import shift_keys, store_kv
from llmd.models.layers import apply_rope, rope_tables
from llmd.quant.kv import PagedKVCache, get_format

BS, HEADS = 16, 2


def _rope64(k: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE in float64 (angles too): the oracle for "K at these positions from scratch"."""
    d = k.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1)[:, None], torch.cat((-ang.sin(), ang.sin()), -1)[:, None]
    return apply_rope(k.double(), (cos, sin))


def _fill(fmt: str, rotation: str, head_dim: int, k: torch.Tensor, pos: torch.Tensor, theta: float,
          blocks: list[int]) -> PagedKVCache:
    """A cache holding RoPE(k, pos) (float32 angles, as the model computes them) in ``blocks``."""
    cache = PagedKVCache.allocate((2, 8, BS, HEADS, head_dim), get_format(fmt), torch.float32, "cpu",
                                  rotation=rotation)
    roped = apply_rope(k, rope_tables(pos, head_dim, theta, torch.float32))
    slots = torch.tensor([blocks[i // BS] * BS + i % BS for i in range(len(pos))])
    store_kv(roped, torch.randn_like(k), cache, slots)
    return cache


def _stored(cache: PagedKVCache, blocks: list[int]) -> torch.Tensor:
    """Dequantized K of ``blocks`` as stored (rotated by H for a hadamard cache),
    ``[tokens, heads, head_dim]`` float64."""
    from llmd.quant.kv import dequantize

    idx = torch.tensor(blocks)
    data = cache.data[0, idx]
    k = dequantize(data, cache.scales[0, idx], torch.float64) if cache.fmt.quantized else data.double()
    return k.flatten(0, 1)


@pytest.mark.parametrize("head_dim,theta", [(64, 100_000.0), (256, 10_000.0), (256, 1_000_000.0)])
@pytest.mark.parametrize("fmt,rotation", [("auto", "none"), ("int8", "none"), ("int8", "hadamard"),
                                          ("fp8_e4m3", "none"), ("fp8_e4m3", "hadamard")])
def test_shifted_keys_equal_rope_at_the_new_positions(head_dim, theta, fmt, rotation):
    """Keys cached at positions 48.. (3 blocks), shifted by Δ = 32 in place and into fresh
    blocks, equal RoPE(k, p − Δ) from scratch: for the float32 cache to 1e-5 of the keys'
    magnitude (both sides carry float32 RoPE angles at their own positions); for quantized ones
    the stored codes are the exact re-rotation of what was cached, requantized (within half a
    grid step), and each (token, head) vector is within that step of the from-scratch key plus
    the first rounding's error (L2: H and RoPE are orthonormal)."""
    from llmd.quant.rotation import rotate

    torch.manual_seed(head_dim + int(theta) % 97)
    n, delta = 3 * BS, 32
    k = torch.randn(n, HEADS, head_dim) * torch.linspace(0.2, 3.0, head_dim)  # uneven channels
    pos = torch.arange(48, 48 + n)
    cache = _fill(fmt, rotation, head_dim, k, pos, theta, [1, 2, 3])
    v_before = cache.data[1, torch.tensor([1, 2, 3])].clone()
    first = _stored(cache, [1, 2, 3])  # what the cache held before the shift
    shift_keys(cache, [1, 2, 3], [1, 5, 6], delta, theta)  # block 1 in place, 2 and 3 moved
    got = _stored(cache, [1, 5, 6])
    if fmt == "auto":
        want32 = apply_rope(k, rope_tables(pos - delta, head_dim, theta, torch.float32)).double()
        assert (got - want32).abs().max().item() < 1e-5 * k.abs().max().item()
        assert (got - _rope64(k, pos - delta, theta)).abs().max().item() < 1e-5 * k.abs().max().item()
    else:
        exact = rotate(_rope64(rotate(first, rotation), torch.full((n,), -delta), theta), rotation)
        qfmt = get_format(fmt)
        step = exact.abs().amax(-1, keepdim=True) / (qfmt.qmax if not qfmt.is_fp8 else 8)  # e4m3: <= amax / 8
        assert ((got - exact).abs() <= 0.5 * step * 1.001 + 1e-5).all()
        want = _rope64(k, pos - delta, theta)
        first_err = (rotate(first, rotation) - _rope64(k, pos, theta)).norm(dim=-1)
        bound = first_err + 0.5 * step[..., 0] * head_dim**0.5 + 1e-5
        assert ((rotate(got, rotation) - want).norm(dim=-1) <= bound).all()
    assert torch.equal(cache.data[1, torch.tensor([1, 5, 6])][1:], v_before[1:])  # V moved unchanged


def test_shift_composes_over_several_shifts_float32():
    """Three shifts of 16 positions each equal one RoPE at p − 48 (float32 cache, to 1e-5 of the
    keys' magnitude)."""
    torch.manual_seed(0)
    k = torch.randn(BS, HEADS, 64)
    pos = torch.arange(200, 200 + BS)
    cache = _fill("auto", "none", 64, k, pos, 10_000.0, [2])
    for _ in range(3):
        shift_keys(cache, [2], [2], 16, 10_000.0)
    assert (_stored(cache, [2]) - _rope64(k, pos - 48, 10_000.0)).abs().max().item() < 1e-5 * k.abs().max().item()


@pytest.mark.parametrize("fmt,rotation", [("auto", "none"), ("int8", "hadamard")])
def test_one_call_reads_every_source_before_writing(fmt, rotation):
    """Block 2 is op 0's source (moved to 5 by 16 positions) and op 1's destination (block 3 moved
    into it by 32, another base): one call equals op 0 then op 1 run separately, and equals each
    block's own rotation, whatever the order of the ops."""
    torch.manual_seed(1)
    k = torch.randn(2 * BS, HEADS, 64)
    pos = torch.arange(100, 100 + 2 * BS)
    torch.manual_seed(2)
    first = _fill(fmt, rotation, 64, k, pos, 10_000.0, [2, 3])
    torch.manual_seed(2)  # the same random V
    apart = _fill(fmt, rotation, 64, k, pos, 10_000.0, [2, 3])
    shift_keys(first, [3, 2], [2, 5], [32, 16], [1e6, 10_000.0])  # the hazardous order in one call
    shift_keys(apart, [2], [5], 16, 10_000.0)
    shift_keys(apart, [3], [2], 32, 1e6)
    assert torch.equal(first.data[:, torch.tensor([2, 5])], apart.data[:, torch.tensor([2, 5])])
    if first.scales is not None:
        assert torch.equal(first.scales[:, torch.tensor([2, 5])], apart.scales[:, torch.tensor([2, 5])])
