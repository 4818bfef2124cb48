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

Requantizing adds one rounding per shift (``llmd bench context-shift`` measures the drift).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmd.quant.kv import PagedKVCache, compute_scales, dequantize, quantize
from llmd.quant.rotation import rotate


def rope_shift_tables(delta: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[head_dim]`` float32 of a rotation by ``−delta`` positions (NEOX layout,
    ``sin``'s first half negated as :func:`llmd.models.layers.rope_tables` does), from float64
    angles ``−delta · theta^(−2i/head_dim)``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = -float(delta) * inv_freq
    cos, sin = ang.cos(), ang.sin()
    return (torch.cat((cos, cos)).float().to(device), torch.cat((-sin, sin)).float().to(device))


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * sin


@torch.inference_mode()
def shift_keys(cache: PagedKVCache, src: Sequence[int], dst: Sequence[int], delta: int, theta: float) -> None:
    """Re-rotate the keys of blocks ``src`` by ``−delta`` positions into blocks ``dst``.

    Args:
        cache: one layer's paged cache (any format; ``data [2, num_blocks, block_size, kv_heads,
            head_dim]``, int4 packed to ``head_dim // 2``).
        src, dst: block ids, pairwise (``dst[i]`` may equal ``src[i]``: in place); every
            destination block must be distinct from every other source block.
        delta: positions to move the keys back by (> 0).
        theta: this layer's RoPE base (Gemma 3: 10,000 on sliding-window layers, 1e6 on global).

    Every slot of a block is rotated, filled or not: the block's unfilled slots hold stale or
    zero codes that attention never reads (the runner's sequence lengths bound every read).
    """
    if not src:
        return
    dev = cache.data.device
    s_idx = torch.tensor(list(src), dtype=torch.long, device=dev)
    d_idx = torch.tensor(list(dst), dtype=torch.long, device=dev)
    head_dim = cache.head_dim
    cos, sin = rope_shift_tables(delta, head_dim, theta, dev)
    fmt = cache.fmt
    codes = cache.data[0, s_idx]  # [n, block_size, kv_heads, head_dim (or //2)]
    if fmt.quantized:
        k = dequantize(codes, cache.scales[0, s_idx])
    else:
        k = codes.float() if codes.dtype != torch.float64 else codes
    k = rotate(k, cache.rotation)  # undo (H is its own inverse)
    k = rotate(_rotate_half(k, cos.to(k.dtype), sin.to(k.dtype)), cache.rotation)
    if fmt.quantized:
        n, bs, heads = k.shape[:3]
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
        if cache.scales is not None:
            cache.scales[1, m_dst] = cache.scales[1, m_src]
