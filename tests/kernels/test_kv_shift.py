"""Context-shift re-rotation (``llmd.kernels.kv_shift.shift_keys``, ``shift_residual``) against
RoPE computed at the new positions from scratch, for auto / int8 / fp8 / int4 (KIVI: blocks
requantized per channel, the open block's 16-bit residual) caches, with and without the K
rotation, on SmolLM2's and Gemma 3's head sizes and RoPE bases (Gemma: 10,000 local, 1e6 global)."""

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
    name, _, group_size = fmt.partition("/g")  # "int8/g32": --kv-scale-group-size 32
    cache = PagedKVCache.allocate((2, 8, BS, HEADS, head_dim), get_format(name, int(group_size or 0)), torch.float32,
                                  "cpu", rotation=rotation)
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
                                          ("fp8_e4m3", "none"), ("fp8_e4m3", "hadamard"), ("int8/g32", "hadamard"),
                                          ("float16", "none")])
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
    elif fmt == "float16":  # the stored float16 keys re-rotated, rounded once more to float16
        exact = _rope64(first, torch.full((n,), -delta), theta)
        assert ((got - exact).abs() <= 2**-11 * exact.abs() + 1e-5 * k.abs().max().item()).all()
        assert (got - _rope64(k, pos - delta, theta)).abs().max().item() < 2**-9 * k.abs().max().item()
    else:
        exact = rotate(_rope64(rotate(first, rotation), torch.full((n,), -delta), theta), rotation)
        qfmt = get_format(fmt.partition("/g")[0])  # grouped scales: a group's step <= the vector's
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


def _kivi_fill(rotation: str, head_dim: int, k: torch.Tensor, pos: torch.Tensor, theta: float, blocks: list[int],
               model_dtype: torch.dtype) -> PagedKVCache:
    """An int4 (KIVI) cache holding RoPE(k, pos) (float32 angles), rotated by ``rotation``, as the
    engine stores it: the 16-bit keys of the first ``len(blocks)`` full blocks quantized per
    channel into ``blocks``, the rest (an open block) in residual slot 1; random V per token."""
    from llmd.kernels.kivi import _write_blocks, store_values
    from llmd.quant.kv import to_residual
    from llmd.quant.rotation import rotate

    cache = PagedKVCache.allocate((2, 8, BS, HEADS, head_dim), get_format("int4"), model_dtype, "cpu",
                                  rotation=rotation, residual_slots=3)
    keys = to_residual(rotate(apply_rope(k, rope_tables(pos, head_dim, theta, torch.float32)), rotation),
                       cache.residual.dtype)
    n_full = len(blocks) * BS
    _write_blocks(cache, torch.tensor(blocks), keys[:n_full].view(len(blocks), BS, HEADS, head_dim))
    cache.residual[1, : len(pos) - n_full] = keys[n_full:]
    store_values(torch.randn_like(k[:n_full]), cache, torch.tensor([blocks[i // BS] * BS + i % BS
                                                                     for i in range(n_full)]))
    return cache


def _kivi_stored(cache: PagedKVCache, blocks: list[int]) -> torch.Tensor:
    """Dequantized K of int4 ``blocks`` as stored, ``[blocks, block_size, heads, head_dim]`` float64."""
    from llmd.quant.kv import dequantize_k_blocks

    idx = torch.tensor(blocks)
    return dequantize_k_blocks(cache.data[0, idx], cache.k_scale()[idx], cache.k_zero()[idx], torch.float64)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])  # residual float16 / bfloat16
@pytest.mark.parametrize("head_dim,theta", [(64, 100_000.0), (256, 1_000_000.0)])
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_int4_kivi_blocks_and_residual_shift_like_rope_at_the_new_positions(rotation, head_dim, theta,
                                                                            model_dtype):
    """int4 (KIVI): 3 full blocks (positions 48..95) and an open block of 7 tokens (96..102, in
    residual slot 1), shifted by Δ = 32 (block 1 in place, 2 and 3 into fresh blocks 5 and 6).
    Each block's K is dequantized per channel, re-rotated and requantized per channel: the new
    codes are the exact re-rotation of what the block held within half a step of the new
    per-channel scale (plus the float16 rounding of the zero point and scale), and each (token,
    head) vector is within that of RoPE(k, p − Δ) from scratch plus the first quantization's
    error; the residual rows are rotated in 16 bits (one rounding of the residual dtype, nothing
    quantized). V codes and V scales move with their blocks unchanged."""
    from llmd.kernels.kv_shift import shift_residual
    from llmd.quant.rotation import rotate

    torch.manual_seed(head_dim + int(theta) % 89)
    n_full, n_open, delta = 3 * BS, 7, 32
    k = torch.randn(n_full + n_open, HEADS, head_dim) * torch.linspace(0.2, 3.0, head_dim)  # uneven channels
    pos = torch.arange(48, 48 + n_full + n_open)
    cache = _kivi_fill(rotation, head_dim, k, pos, theta, [1, 2, 3], model_dtype)
    v_before = cache.data[1, torch.tensor([1, 2, 3])].clone()
    vs_before = cache.v_scale()[torch.tensor([1, 2, 3])].clone()
    first = _kivi_stored(cache, [1, 2, 3])
    res_first = cache.residual[1, :n_open].double()
    other = cache.residual[torch.tensor([0, 2])].clone()
    shift_keys(cache, [1, 2, 3], [1, 5, 6], delta, theta)
    shift_residual(cache, [1], delta, theta)
    got = _kivi_stored(cache, [1, 5, 6])

    def back(x):  # re-rotation of stored keys by −Δ in float64, in the cache's rotated space
        flat = x.reshape(-1, HEADS, head_dim)
        return rotate(_rope64(rotate(flat, rotation), torch.full((flat.shape[0],), -delta), theta),
                      rotation).reshape(x.shape)

    exact = back(first)
    scale = cache.k_scale()[torch.tensor([1, 5, 6])].double()[:, None]  # [3, 1, heads, head_dim]
    lo, hi = exact.amin(1, keepdim=True), exact.amax(1, keepdim=True)
    f16 = 2.0**-11 * (lo.abs() + (hi - lo))  # the zero point's and the scale's rounding to float16
    assert ((got - exact).abs() <= 0.5 * scale * 1.001 + f16 + 1e-6).all()
    want = _rope64(k, pos - delta, theta)
    first_err = (rotate(first.flatten(0, 1), rotation) - _rope64(k, pos, theta)[:n_full]).norm(dim=-1)
    bound = first_err + ((0.5 * scale * 1.001 + f16) ** 2).sum(-1).sqrt().expand(-1, BS, -1).flatten(0, 1) + 1e-5
    assert ((rotate(got.flatten(0, 1), rotation) - want[:n_full]).norm(dim=-1) <= bound).all()
    # the open block: 16-bit rows rotated, one rounding to the residual dtype
    eps = 2.0**-8 if model_dtype == torch.bfloat16 else 2.0**-11
    res_got = cache.residual[1, :n_open].double()
    res_exact = back(res_first)
    assert ((res_got - res_exact).abs() <= eps * res_exact.abs() + 1e-6).all()
    res_first_err = (rotate(res_first, rotation) - _rope64(k, pos, theta)[n_full:]).norm(dim=-1)
    res_err = (rotate(res_got, rotation) - want[n_full:]).norm(dim=-1)
    assert (res_err <= res_first_err + eps * want[n_full:].norm(dim=-1) + 1e-5).all()
    assert torch.equal(cache.residual[torch.tensor([0, 2])], other)  # other sequences' slots untouched
    assert torch.equal(cache.data[1, torch.tensor([1, 5, 6])], v_before)  # V moved unchanged
    assert torch.equal(cache.v_scale()[torch.tensor([1, 5, 6])], vs_before)


def test_int4_one_call_reads_every_source_before_writing():
    """int4: block 2 is op 0's source and op 1's destination (the hazardous order in one call):
    one call equals the two ops run one after the other (codes, K scales and zero points, V and
    its scales)."""
    torch.manual_seed(4)
    k = torch.randn(2 * BS + 1, HEADS, 64)
    pos = torch.arange(100, 100 + 2 * BS + 1)
    torch.manual_seed(5)
    first = _kivi_fill("none", 64, k, pos, 10_000.0, [2, 3], torch.float32)
    torch.manual_seed(5)
    apart = _kivi_fill("none", 64, k, pos, 10_000.0, [2, 3], torch.float32)
    shift_keys(first, [3, 2], [2, 5], [32, 16], [1e6, 10_000.0])
    shift_keys(apart, [2], [5], 16, 10_000.0)
    shift_keys(apart, [3], [2], 32, 1e6)
    idx = torch.tensor([2, 5])
    assert torch.equal(first.data[:, idx], apart.data[:, idx])
    assert torch.equal(first.scales[:, idx], apart.scales[:, idx])
