"""Transformer building blocks shared by the model files: RMSNorm, RoPE, SwiGLU MLP, paged attention.

Numerics follow HF transformers' Llama implementation (``modeling_llama.py``) so logits match it
in float32: RMSNorm in float32, RoPE angles ``inv_freq × position`` in float32, NEOX-style
rotate-half. :class:`GemmaRMSNorm` follows ``modeling_gemma3.py`` (weight applied in float32).
"""

from __future__ import annotations

import torch
from torch import nn

from llmd import kernels
from llmd.kernels import AttentionMetadata


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``w * x / sqrt(mean(x²) + eps)``, reduced in float32.

    ``forward(x [..., dim]) -> [..., dim]`` in x's dtype.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(in_dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``(x / sqrt(mean(x²) + eps)) * w`` entirely in float32, then cast.

    HF (``Gemma3RMSNorm``) multiplies by ``1 + w_hf`` in float32; GGUF files store
    ``w = 1 + w_hf`` already (llama.cpp's converter adds the 1), so ``w`` is used as stored.
    ``forward(x [..., dim]) -> [..., dim]`` in x's dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables (Su et al. 2021, NEOX layout) for the given positions.

    Args:
        positions: ``[T]`` int64 token positions.
    Returns:
        (cos, sin), each ``[T, head_dim]`` in ``dtype``; angles computed in float32.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` with NEOX rotate-half; cos/sin ``[T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def linear(in_features: int, out_features: int, dtype: torch.dtype) -> nn.Linear:
    """Bias-free linear layer with uninitialised weights (the loader fills and checks them)."""
    layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype, device="meta")
    layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
    return layer


class GatedMLP(nn.Module):
    """SwiGLU / GeGLU MLP (Shazeer 2020): ``down(act(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, activation: str = "silu"):
        super().__init__()
        self.gate_proj = linear(hidden, intermediate, dtype)
        self.up_proj = linear(hidden, intermediate, dtype)
        self.down_proj = linear(intermediate, hidden, dtype)
        if activation == "silu":
            self.act = nn.functional.silu
        elif activation == "gelu_tanh":
            self.act = lambda t: nn.functional.gelu(t, approximate="tanh")
        else:
            raise ValueError(f"unknown MLP activation {activation!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PagedAttention(nn.Module):
    """Multi-head / grouped-query self-attention whose K/V live in the paged KV cache.

    ``forward(x [T, hidden], positions [T], kv_cache, meta) -> [T, hidden]``; ``kv_cache`` is a
    :class:`llmd.quant.kv.PagedKVCache` (data ``[2, blocks, block_size, kv_heads, head_dim]`` plus
    float32 scales ``[2, blocks, block_size, kv_heads]`` for int8/fp8) or a bare ``auto`` data
    tensor. New K/V are stored (quantized) first, then every query reads the cache back
    (store-then-read), on the backend named by ``meta.attn_backend``.

    Options: ``sliding_window`` (tokens; query ``p`` sees keys ``[p - W + 1, p]``),
    ``qk_norm_eps`` (per-head RMSNorm of Q and K before RoPE, class ``norm_cls``), ``scale``
    (softmax scale, default ``head_dim ** -0.5``).
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float,
        dtype: torch.dtype,
        sliding_window: int | None = None,
        qk_norm_eps: float | None = None,
        scale: float | None = None,
        norm_cls: type[RMSNorm] = RMSNorm,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5 if scale is None else scale
        self.q_proj = linear(hidden, num_heads * head_dim, dtype)
        self.k_proj = linear(hidden, num_kv_heads * head_dim, dtype)
        self.v_proj = linear(hidden, num_kv_heads * head_dim, dtype)
        self.o_proj = linear(num_heads * head_dim, hidden, dtype)
        self.q_norm = norm_cls(head_dim, qk_norm_eps, dtype) if qk_norm_eps is not None else None
        self.k_norm = norm_cls(head_dim, qk_norm_eps, dtype) if qk_norm_eps is not None else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kernels.store_kv(k, v, kv_cache, meta.slot_mapping, meta.attn_backend)
        out = kernels.paged_attention(q, kv_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
