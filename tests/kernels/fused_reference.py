"""A float64 torch reference of ``kernels/native/fused_decode.c``'s decode step, for its tests.

The same math in float64 except for what the kernel defines as its numerics: each product's input
is quantized per block of 32 to int8 exactly as the kernel does (float32 ``x · (127 / absmax)``
rounded half to even), and its K/V rows are stored in the cache's dtype. Everything after that
(products over the packs' dequantized weights, RMSNorm, RoPE, softmax, SwiGLU, the residual
stream) is float64, so the comparison measures the kernel's float32 arithmetic only.
"""

from __future__ import annotations

import torch

from llmd.quant.native_packs import dequantize, unpack

LEVELS = 2  # the kernel's act_levels the reference mirrors (tests set it)


def quantized_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [K]`` → ``(q [K] float64 codes, dx [K/32], sx [K/32])`` as the kernel forms them
    (with 2 levels ``q`` is ``q1 + q2 / 254``: the residual's codes folded in)."""
    x32 = x.float().view(-1, 32)
    amax = x32.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x32 * inv[:, None]).clamp(-128, 127)  # torch.round: half to even, like cvtps2dq
    d = amax / 127.0
    if LEVELS == 2:
        r = torch.addcmul(x32, q, -d[:, None])  # x - d q1 in float32 (the kernel's fnmadd, one rounding)
        q = q.double() + torch.round(r * (inv * 254.0)[:, None]).clamp(-128, 127).double() / 254.0
    return q.double().flatten(), d.double(), x32.sum(-1).double()


def product(kind_pack: tuple, x: torch.Tensor) -> torch.Tensor:
    """``W x`` [N] float64 with x quantized as the kernel does; Q4 with centred codes, its offset
    term from the exact block sums (the kernel's form)."""
    kind, pack = kind_pack
    q, dx, sx = quantized_input(x)
    codes, scales, mins = unpack(kind, pack)
    n = codes.shape[0]
    w = codes.double().view(n, -1, 32)
    if kind == "q8":
        return ((w * q.view(1, -1, 32)).sum(-1) * scales.double() * dx).sum(-1)
    dots = ((w - 8) * q.view(1, -1, 32)).sum(-1)  # w = (q - 8) s + (min + 8 s)
    return (dots * scales.double() * dx + (mins.double() + 8 * scales.double()) * sx).sum(-1)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean() + eps) * w.double()


def rope(v: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """NEOX rotate-half of ``v [heads, D]`` at ``position`` (angles in float64)."""
    d = v.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = position * inv
    c, s = torch.cat((ang.cos(), ang.cos())), torch.cat((-ang.sin(), ang.sin()))
    swapped = torch.cat((v[..., d // 2 :], v[..., : d // 2]), -1)
    return v * c + swapped * s


def decode_step(layers, final_norm, head, embed_row, heads, kv_heads, head_dim, eps, scale, theta,
                position, slot, block_table, seq_len, block_size):
    """Logits ``[vocab]`` float64 of one step; writes the new K/V row into each layer's cache
    (``layer.kv``, rounded to its dtype) first and reads the cache back (store-then-read)."""
    x = embed_row.double()
    g = heads // kv_heads
    inter = None
    for lay in layers:
        h = rms_norm(x, lay.attn_norm, eps)
        qkv = product(lay.qkv, h)
        q = qkv[: heads * head_dim].view(heads, head_dim)
        k = qkv[heads * head_dim : (heads + kv_heads) * head_dim].view(kv_heads, head_dim)
        v = qkv[(heads + kv_heads) * head_dim :].view(kv_heads, head_dim)
        q, k = rope(q, position, theta), rope(k, position, theta)
        kv = lay.kv.view(2, -1, kv_heads, head_dim)
        kv[0, slot], kv[1, slot] = k.to(kv.dtype), v.to(kv.dtype)
        first = max(0, seq_len - lay.window) if lay.window else 0
        pos = torch.arange(first, seq_len)
        slots = block_table[pos // block_size].long() * block_size + pos % block_size
        keys, vals = kv[0, slots].double(), kv[1, slots].double()  # [L, kvh, D]
        out = torch.empty(heads, head_dim, dtype=torch.float64)
        for j in range(heads):
            s = keys[:, j // g] @ q[j] * scale
            out[j] = torch.softmax(s, 0) @ vals[:, j // g]
        x = x + product(lay.o, out.flatten())
        h = rms_norm(x, lay.ffn_norm, eps)
        gu = product(lay.gate_up, h)
        inter = gu.shape[0] // 2
        act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
        x = x + product(lay.down, act)
    return product(head, rms_norm(x, final_norm, eps))


def dense(kind_pack: tuple) -> torch.Tensor:
    """A pack's weights as float64 ``[N, K]`` (for building comparisons)."""
    return dequantize(*kind_pack).double()

