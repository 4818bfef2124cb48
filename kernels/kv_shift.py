"""Context shift: move cached keys to earlier positions by re-rotating their RoPE in place.

llama.cpp's ``--context-shift`` (``llama_kv_cache::seq_add`` + its K-shift graph): RoPE
rotations compose, ``R(p − Δ) = R(−Δ) R(p)``, so a key cached at position ``p`` becomes the key
at ``p − Δ`` by one more rotation of ``−Δ`` — no recompute of the hidden states. This op does
it for whole blocks of a paged cache in every KV format:

1. read the K tile of each source block and dequantize it (``code × scale`` in float32);
2. undo the cache's K rotation (``--kv-rotation hadamard``: the stored K is ``RoPE(K) H``, and
   ``H`` is its own inverse, :mod:`llmd.quant.rotation`);
3. rotate by ``−Δ`` (NEOX rotate-half layout, as :func:`llmd.models.layers.apply_rope`), the
   angles ``Δ · θ^(−2i/d)`` computed in float64 so the shift adds no float32 angle error of its
   own (the cached keys' own angles were computed in float32 at ``p``, as HF does);
4. redo the K rotation and requantize with fresh dynamic scales (static scales stay), writing
   the destination block; V (and its scales) is copied unchanged when ``dst != src``.

int4 (KIVI, :mod:`llmd.quant.kv`): a block's K is quantized per (KV head, channel) over its 16
tokens, so step 1 dequantizes the whole block (``code × scale + zero`` per channel) and step 4
requantizes it per channel (:func:`~llmd.quant.kv.quantize_k_blocks`: fresh scales and zero
points over the rotated block). A sequence's open block is read from its 16-bit residual, not
from the block: :func:`shift_residual` rotates those rows in 16 bits (nothing is quantized), and
the open block's stale K codes, rotated too, are never read (the block is requantized from the
residual when it fills).

Requantizing adds one rounding per shift (``llmd bench context-shift`` measures the drift).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmd.quant.kv import (
    PagedKVCache,
    compute_scales,
    dequantize,
    dequantize_k_blocks,
    quantize,
    quantize_k_blocks,
    to_residual,
)
from llmd.quant.rotation import rotate


def rope_shift_tables(delta, head_dim: int, theta, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` float32 of a rotation by ``−delta`` positions (NEOX layout, ``sin``'s first
    half negated as :func:`llmd.models.layers.rope_tables` does), from float64 angles
    ``−delta · theta^(−2i/head_dim)``: ``[head_dim]`` for a scalar ``delta`` and ``theta``,
    ``[n, head_dim]`` for sequences of ``n`` (one rotation per block)."""
    scalar = isinstance(delta, (int, float)) and isinstance(theta, (int, float))
    d = torch.tensor(delta, dtype=torch.float64).reshape(-1, 1)
    th = torch.tensor(theta, dtype=torch.float64).reshape(-1, 1)
    ang = -d * th ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((-ang.sin(), ang.sin()), -1)
    if scalar:
        cos, sin = cos[0], sin[0]
    return cos.float().to(device), sin.float().to(device)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * sin


def _tables(delta, theta, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_shift_tables` shaped to broadcast over ``[n, block_size, kv_heads, head_dim]``."""
    cos, sin = rope_shift_tables(delta if isinstance(delta, int) else list(delta), head_dim,
                                 theta if isinstance(theta, (int, float)) else list(theta), device)
    if cos.dim() == 2:  # one rotation per block (or residual slot)
        cos, sin = cos[:, None, None], sin[:, None, None]
    return cos, sin


def _rerotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotation: str) -> torch.Tensor:
    """Undo the K rotation, RoPE by the tables' ``-delta``, redo the K rotation (float32 or 64)."""
    k = rotate(k, rotation)  # undo (H is its own inverse)
    return rotate(_rotate_half(k, cos.to(k.dtype), sin.to(k.dtype)), rotation)


@torch.inference_mode()
def shift_residual(cache: PagedKVCache, slots: Sequence[int], delta: int | Sequence[int],
                   theta: float | Sequence[float]) -> None:
    """int4: re-rotate the 16-bit open-block K of residual ``slots`` by ``-delta`` positions in place.

    Args:
        cache: an int4 :class:`PagedKVCache` (``residual [R, block_size, kv_heads, head_dim]``
            bfloat16 / float16).
        slots: residual slot ids (distinct), one per (sequence, KV cache group) that shifts.
        delta, theta: as :func:`shift_keys` (one for all, or one per slot).

    The rows are rotated in float32 (angles from float64) and rounded once back to the residual
    dtype (float16 clamped to ±65504, :func:`~llmd.quant.kv.to_residual`). Every row of a slot is
    rotated; rows past the open block's tokens are stale and never read.
    """
    if not slots:
        return
    res = cache.residual
    idx = torch.tensor(list(slots), dtype=torch.long, device=res.device)
    cos, sin = _tables(delta, theta, cache.head_dim, res.device)
    res[idx] = to_residual(_rerotate(res[idx].float(), cos, sin, cache.rotation), res.dtype)


@torch.inference_mode()
def shift_keys(cache: PagedKVCache, src: Sequence[int], dst: Sequence[int], delta: int | Sequence[int],
               theta: float | Sequence[float]) -> None:
    """Re-rotate the keys of blocks ``src`` by ``−delta`` positions into blocks ``dst``.

    Args:
        cache: one paged cache tensor (any format; ``data [2, num_blocks, block_size, kv_heads,
            head_dim]``, int4 packed to ``head_dim // 2``).
        src, dst: block ids, pairwise (``dst[i]`` may equal ``src[i]``: in place). Every source
            is read before any destination is written, so a block may be one op's destination
            and another's source (a block one shift released, taken by the next).
        delta: positions to move the keys back by (> 0), one for all or one per block.
        theta: the RoPE base (Gemma 3: 10,000 on sliding-window layers, 1e6 on global), one for
            all or one per block (blocks of several KV cache groups sharing this tensor).

    Every slot of a block is rotated, filled or not: the block's unfilled slots hold stale or
    zero codes that attention never reads (the runner's sequence lengths bound every read).
    """
    if not src:
        return
    dev = cache.data.device
    s_idx = torch.tensor(list(src), dtype=torch.long, device=dev)
    d_idx = torch.tensor(list(dst), dtype=torch.long, device=dev)
    head_dim = cache.head_dim
    n = len(src)
    cos, sin = _tables(delta, theta, head_dim, dev)
    fmt = cache.fmt
    codes = cache.data[0, s_idx]  # [n, block_size, kv_heads, head_dim (or //2)]
    if fmt.k_per_block:  # int4 KIVI: per channel over the block, scale + zero point
        k = dequantize_k_blocks(codes, cache.k_scale()[s_idx], cache.k_zero()[s_idx])
    elif fmt.quantized:
        k = dequantize(codes, cache.scales[0, s_idx])
    else:
        k = codes.float() if codes.dtype != torch.float64 else codes
    k = _rerotate(k, cos, sin, cache.rotation)
    if fmt.k_per_block:
        new_codes, scale, zero = quantize_k_blocks(k)
        cache.data[0, d_idx] = new_codes
        cache.k_scale()[d_idx] = scale
        cache.k_zero()[d_idx] = zero
    elif fmt.quantized:
        bs, heads = k.shape[1:3]
        flat = k.reshape(n * bs, heads, head_dim)
        if cache.static_scales is None:
            s = compute_scales(flat, fmt)
        else:
            s = torch.full((n * bs, heads), cache.static_scales[0], dtype=torch.float32, device=dev)
        cache.data[0, d_idx] = quantize(flat, s, fmt).reshape(codes.shape)
        cache.scales[0, d_idx] = s.reshape(cache.scales[0, s_idx].shape).to(cache.scales.dtype)
    else:
        cache.data[0, d_idx] = k.to(cache.data.dtype)
    moved = [i for i, (a, b) in enumerate(zip(src, dst)) if a != b]
    if moved:
        m_src, m_dst = s_idx[moved], d_idx[moved]
        cache.data[1, m_dst] = cache.data[1, m_src]
        if fmt.k_per_block:  # only V's part of the block's scales (K's were just written)
            cache.v_scale()[m_dst] = cache.v_scale()[m_src]
        elif cache.scales is not None:
            cache.scales[1, m_dst] = cache.scales[1, m_src]
