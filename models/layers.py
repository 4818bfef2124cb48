"""Transformer building blocks shared by the model files: RMSNorm, RoPE, merged projections,
gated MLP, paged attention (the norms live in :mod:`llmd.models.rms_norm`, re-exported here).

Numerics follow HF transformers' Llama implementation (``modeling_llama.py``) so logits match it
in float32: RMSNorm in float32, RoPE angles ``inv_freq × position`` in float32, NEOX-style
rotate-half. :class:`GemmaRMSNorm` follows ``modeling_gemma3.py`` (weight applied in float32).

CPU fast path (issue 13): few, large ops per layer. Q/K/V are one matmul and gate/up another
(:class:`MergedLinear`, vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``); the RoPE
tables are built once per step and RoPE base by the decoder (:func:`rope_tables`) and Q and K
are rotated together in four ops; the norms are ``torch.nn.functional.rms_norm``. The
forwards read their submodules and parameters from the module's own dicts (``self._modules`` /
``self._parameters``): ``nn.Module.__getattr__`` costs ~1.4 µs per lookup on the 2-core CPU, ~15
lookups per layer, 30 layers per batch-1 decode step (measured: README "Speed"). On the CPU a
bfloat16 model's linears may hold oneDNN-prepacked weights (:class:`Linear`,
:mod:`llmd.quant.prepacked`) and its RMSNorm / RoPE / SwiGLU run one C pass each when the runner
says so (:mod:`llmd.kernels.cpu_glue`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from llmd import kernels
from llmd.kernels import AttentionMetadata, cpu_glue
from llmd.models.rms_norm import (  # noqa: F401 (re-exported: the norms' home before)
    FUSED_NORM_MAX_TOKENS,
    PAD_TERMS,
    GemmaRMSNorm,
    RMSNorm,
)
from llmd.quant import fp16_linear, prepacked

RopeTables = tuple[torch.Tensor, torch.Tensor]


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> RopeTables:
    """RoPE tables (Su et al. 2021, NEOX layout) for one step's positions and one RoPE base.

    Args:
        positions: ``[T]`` int64 token positions.
    Returns:
        ``(cos, sin)``, each ``[T, 1, head_dim]`` in ``dtype`` (angles computed in float32, as HF
        does); ``sin``'s first half is negated (``[-sin θ, sin θ]``) so that
        :func:`apply_rope` needs no negation.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1).to(dtype)[:, None], torch.cat((-sin, sin), -1).to(dtype)[:, None]


def apply_rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` (any strides) with NEOX rotate-half; a new contiguous tensor.

    ``x * cos + [x₂, x₁] * [-sin, sin]``: bit-identical to HF's ``x * cos + rotate_half(x) *
    sin`` (``(-a)·b == a·(-b)`` in IEEE arithmetic), in four kernels (flip, mul, mul, add).
    """
    cos, sin = rope
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * sin


class Linear(nn.Linear):
    """Bias-free ``nn.Linear`` whose weight may be prepacked for oneDNN on the CPU
    (:func:`llmd.quant.prepacked.prepack_model`, bfloat16) or have an fp16 pack beside it for
    float32 inputs (:func:`llmd.quant.fp16_linear.pack_model`). ``forward(x [..., in]) -> [..., out]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp16 = self.__dict__.get(fp16_linear.ATTR)
        if fp16 is not None and fp16_linear.active and x.dtype == torch.float32:
            return fp16_linear.linear(x, fp16)
        return prepacked.linear(x, self._parameters["weight"])


class MergedLinear(Linear):
    """Bias-free projections of one input fused into one matmul (vLLM's ``QKVParallelLinear`` /
    ``MergedColumnParallelLinear``).

    ``weight``: ``[sum(parts.values()), in_features]`` in the model dtype, the parts' weights
    stacked by rows in ``parts`` order; ``rows[name]`` is ``(start, stop)`` of a part. The loader
    fills each part's rows from its own GGUF tensor. ``forward(x [T, in]) -> [T, sum]`` (the
    fused output; :meth:`split` cuts it into the parts, as views).
    """

    def __init__(self, in_features: int, parts: dict[str, int], dtype: torch.dtype):
        out = sum(parts.values())
        super().__init__(in_features, out, bias=False, dtype=dtype, device="meta")
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.sizes = list(parts.values())
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.rows = {name: (s, s + n) for (name, n), s in zip(parts.items(), starts)}

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``y [..., sum]`` → one view ``[..., part size]`` per part."""
        return y.split(self.sizes, dim=-1)


def linear(in_features: int, out_features: int, dtype: torch.dtype) -> Linear:
    """Bias-free linear layer with uninitialised weights (the loader fills and checks them)."""
    layer = Linear(in_features, out_features, bias=False, dtype=dtype, device="meta")
    layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
    return layer


class GatedMLP(nn.Module):
    """SwiGLU / GeGLU MLP (Shazeer 2020): ``down(act(gate(x)) * up(x))``.

    ``gate_up_proj``: :class:`MergedLinear` with parts ``gate``, ``up`` (``[2 · intermediate,
    hidden]``); ``down_proj``: ``[hidden, intermediate]``. ``forward(x [T, hidden]) -> [T, hidden]``.
    """

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, activation: str = "silu"):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate": intermediate, "up": intermediate}, dtype)
        self.down_proj = linear(intermediate, hidden, dtype)
        if activation == "silu":
            self.act = F.silu
        elif activation == "gelu_tanh":
            self.act = lambda t: F.gelu(t, approximate="tanh")
        else:
            raise ValueError(f"unknown MLP activation {activation!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self._modules
        gate_up = m["gate_up_proj"]
        y = gate_up(x)
        if self.act is F.silu and cpu_glue.active and (h := cpu_glue.silu_mul(y)) is not None:
            return m["down_proj"](h)  # one C pass (kernels/cpu_glue.py)
        gate, up = gate_up.split(y)
        return m["down_proj"](self.act(gate) * up)


class PagedAttention(nn.Module):
    """Multi-head / grouped-query self-attention whose K/V live in the paged KV cache.

    ``forward(x [T, hidden], rope, kv_cache, meta) -> [T, hidden]``; ``rope`` is this layer's
    ``(cos, sin)`` from :func:`rope_tables` (built once per step for base ``rope_theta``);
    ``kv_cache`` is a :class:`llmd.quant.kv.PagedKVCache` (data ``[2, blocks, block_size,
    kv_heads, head_dim]`` plus float32 scales ``[2, blocks, block_size, kv_heads]`` for int8/fp8)
    or a bare ``auto`` data tensor. New K/V are stored (quantized) first, then every query reads
    the cache back (store-then-read), on the backend named by ``meta.attn_backend``.

    ``qkv_proj``: :class:`MergedLinear` with parts ``q`` ``[heads · head_dim]``, ``k``, ``v``
    ``[kv_heads · head_dim]``; Q and K are adjacent in its output, so one view of both gets one
    RoPE. ``rope_theta`` records the layer's RoPE base (the decoder builds the tables from
    ``cfg.layer_rope_theta(i)``, the same value). Options: ``sliding_window`` (tokens; query ``p`` sees keys
    ``[p - W + 1, p]``),
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
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = MergedLinear(hidden, {"q": q, "k": kv, "v": kv}, dtype)
        self.o_proj = linear(q, hidden, dtype)
        self.q_norm = norm_cls(head_dim, qk_norm_eps, dtype) if qk_norm_eps is not None else None
        self.k_norm = norm_cls(head_dim, qk_norm_eps, dtype) if qk_norm_eps is not None else None

    def forward(self, x: torch.Tensor, rope: RopeTables, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        m = self._modules
        qk, v = m["qkv_proj"](x).split([(h + kvh) * d, kvh * d], dim=-1)
        qk, v = qk.view(t, h + kvh, d), v.view(t, kvh, d)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        rotated = cpu_glue.rope(qk, *rope) if cpu_glue.active else None  # one C pass, the same bits
        qk = apply_rope(qk, rope) if rotated is None else rotated
        q, k = qk[:, :h], qk[:, h:]
        kernels.store_kv(k, v, kv_cache, meta.slot_mapping, meta.attn_backend, meta.slots_padded)
        out = kernels.paged_attention(q, kv_cache, meta, self.scale, self.sliding_window)
        return m["o_proj"](out.reshape(t, h * d))
