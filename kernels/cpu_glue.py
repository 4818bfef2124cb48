"""A bfloat16 layer's elementwise passes in C on the CPU: RMSNorm (alone or after the residual
add), NEOX RoPE (alone or with the K/V store), SwiGLU's
``silu(gate) * up`` (``kernels/native/layer_glue.c``, which documents their numerics: the roundings
of torch's bfloat16 ops; RoPE bit for bit, the norm and SiLU within one bfloat16 ulp on rare
elements).

Each function returns None when it does not apply (not bfloat16, not on the CPU, a layout it does
not take, the library unavailable, or :data:`active` off), and the caller runs its torch ops.
:data:`active` is set by the model runner before every forward from its ``native_kernels``
choice (``--disable-native-kernels`` turns the glue off with the other C kernels), so engines with
different choices may share one loaded model (one forward at a time per process, as the engine
loop runs them).
"""

from __future__ import annotations

import torch

from llmd.kernels.native import build
from llmd.quant.kv import SCALE_FLOOR, PagedKVCache, planes_contiguous

active = False  # set per forward by the model runner (ModelRunner.execute)


def _lib():
    return build.load_glue() if active else None


def _rows(x: torch.Tensor, dim: int) -> tuple[int, int] | None:
    """``(rows, row stride)`` of ``x`` viewed as ``[rows, dim]`` with contiguous rows, else None."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.stride(-1) != 1 or x.shape[-1] != dim:
        return None
    if x.dim() == 2:
        return x.shape[0], x.stride(0)
    if x.is_contiguous():
        return x.numel() // dim, dim
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight · x / sqrt(mean(x²) + eps)`` over the last dim (HF LlamaRMSNorm in bfloat16):
    ``x [..., dim]`` bfloat16, ``weight [dim]`` bfloat16 contiguous → a new contiguous tensor of
    x's shape, or None (see the module docstring)."""
    dim = weight.shape[0]
    shape = _rows(x, dim)
    lib = _lib() if shape is not None and weight.dtype == torch.bfloat16 and weight.is_contiguous() else None
    if lib is None:
        return None
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    lib.llmd_rms_norm_bf16(x.data_ptr(), shape[1], weight.data_ptr(), shape[0], dim, eps, out.data_ptr(),
                           torch.get_num_threads())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """NEOX rotate-half RoPE (:func:`llmd.models.layers.apply_rope`, bit for bit): ``x [T, heads,
    head_dim]`` bfloat16 with heads and channels contiguous (rows may be strided, e.g. a slice of
    the fused QKV output), ``cos`` / ``sin`` ``[T, 1, head_dim]`` bfloat16 (sin's first half
    negated) → ``[T, heads, head_dim]`` contiguous, or None."""
    if x.dim() != 3 or x.device.type != "cpu" or x.dtype != torch.bfloat16:
        return None
    t, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or d % 2:
        return None
    if cos.shape != (t, 1, d) or sin.shape != (t, 1, d):
        return None
    tables = [c[:, 0] for c in (cos, sin)]  # [T, d] views: rows of d contiguous, any row stride
    if any(c.dtype != torch.bfloat16 or c.stride(1) != 1 for c in tables):
        return None
    lib = _lib()
    if lib is None:
        return None
    out = torch.empty((t, heads, d), dtype=torch.bfloat16)
    lib.llmd_rope_bf16(x.data_ptr(), x.stride(0), t, heads, d, tables[0].data_ptr(), tables[0].stride(0),
                       tables[1].data_ptr(), tables[1].stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) · up`` of a fused ``[T, 2 · I]`` bfloat16 gate/up output (gate first, rows
    contiguous) → ``[T, I]`` contiguous, or None."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        return None
    shape = _rows(gate_up, gate_up.shape[1])
    lib = _lib() if shape is not None else None
    if lib is None:
        return None
    inter = gate_up.shape[1] // 2
    out = torch.empty((shape[0], inter), dtype=torch.bfloat16)
    lib.llmd_silu_mul_bf16(gate_up.data_ptr(), shape[1], shape[0], inter, out.data_ptr(), torch.get_num_threads())
    return out


def add_rms_norm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The residual add and the next RMSNorm in one pass (vLLM's ``fused_add_rms_norm``):
    ``residual += y`` in place (torch's bfloat16 add), then returns :func:`rms_norm` of it.

    ``y [T, dim]`` bfloat16 with contiguous rows (any row stride), ``residual [T, dim]`` bfloat16
    contiguous (updated), ``weight [dim]`` bfloat16 contiguous → a new ``[T, dim]``, or None
    (``residual`` untouched) when it does not apply (see the module docstring)."""
    dim = weight.shape[0]
    shape = _rows(y, dim)
    ok = (shape is not None and weight.dtype == torch.bfloat16 and weight.is_contiguous()
          and residual.dtype == torch.bfloat16 and residual.is_contiguous() and residual.shape == (shape[0], dim))
    lib = _lib() if ok else None
    if lib is None:
        return None
    out = torch.empty(residual.shape, dtype=torch.bfloat16)
    lib.llmd_add_rms_norm_bf16(y.data_ptr(), shape[1], residual.data_ptr(), weight.data_ptr(), shape[0], dim, eps,
                               out.data_ptr(), torch.get_num_threads())
    return out


def rope_store(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
               kv: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """RoPE of Q and K and the K/V store of a fused QKV projection in one pass: the same bits as
    :func:`rope` of Q and K followed by :func:`llmd.kernels.reference.store_kv` into an ``auto`` cache.

    Args:
        qkv: ``[T, (heads + 2 kv_heads) · head_dim]`` bfloat16 with contiguous rows (Q heads, K
            heads, V heads; NEOX channel order).
        cos, sin: ``[T, 1, head_dim]`` bfloat16 (sin's first half negated), rows of head_dim contiguous.
        kv: the layer's bfloat16 cache data ``[2, num_blocks, block_size, kv_heads, head_dim]``,
            each plane contiguous (:func:`llmd.quant.kv.planes_contiguous`).
        slot_mapping: ``[T]`` int64 contiguous; negative slots are skipped (padding).
    Returns:
        the rotated queries ``[T, heads, head_dim]`` contiguous, or None (nothing stored) when it
        does not apply.
    """
    t = qkv.shape[0]
    d = kv.shape[-1]
    shape = _rows(qkv, (heads + 2 * kv_heads) * d) if qkv.dim() == 2 else None
    tables = [c[:, 0] for c in (cos, sin)] if cos.shape == (t, 1, d) and sin.shape == (t, 1, d) else []
    ok = (shape is not None and d % 2 == 0 and kv.dtype == torch.bfloat16 and kv.dim() == 5 and kv.shape[3] == kv_heads
          and len(tables) == 2 and all(c.dtype == torch.bfloat16 and c.stride(1) == 1 for c in tables)
          and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.shape == (t,)
          and planes_contiguous(kv))
    lib = _lib() if ok else None
    if lib is None:
        return None
    q = torch.empty((t, heads, d), dtype=torch.bfloat16)
    lib.llmd_rope_store_bf16(qkv.data_ptr(), shape[1], t, heads, kv_heads, d, tables[0].data_ptr(),
                             tables[0].stride(0), tables[1].data_ptr(), tables[1].stride(0), q.data_ptr(),
                             kv.data_ptr(), kv.stride(0), slot_mapping.data_ptr(), torch.get_num_threads())
    return q


def int8_store_ok(cache: PagedKVCache) -> bool:
    """``cache`` is one :func:`store_int8` writes: int8 codes with dynamic float32 scales per
    (token, KV head) (not grouped, not static; any ``--kv-rotation``, applied to K before the
    store), codes and scales each in contiguous planes."""
    fmt, data = cache.fmt, cache.data
    return (fmt.name == "int8" and not fmt.group_size and not fmt.k_per_block and cache.static_scales is None
            and data.dtype == torch.int8 and data.dim() == 5 and cache.scales is not None
            and cache.scales.dtype == torch.float32 and planes_contiguous(data) and planes_contiguous(cache.scales))


def store_int8(key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, slot_mapping: torch.Tensor) -> bool:
    """The K/V store into an int8 cache in one C pass (``llmd_store_int8``): the same codes and
    scales as :func:`llmd.kernels.reference.store_kv` (``compute_scales`` + ``quantize``: scale =
    max(amax |x| / 127, ``SCALE_FLOOR``), codes = round-half-even(clamp(x / scale, ±127))).

    Args:
        key, value: ``[T, kv_heads, head_dim]`` bfloat16, each row's heads and channels contiguous
            (a row stride of its own is fine); K already rotated if the cache is.
        cache: a cache :func:`int8_store_ok` accepts.
        slot_mapping: ``[T]`` int64 contiguous; negative slots are skipped (padding).
    Returns:
        True, or False (nothing stored) when it does not apply.
    """
    t, kv_heads, d = key.shape if key.dim() == 3 else (0, 0, 0)
    ok = (int8_store_ok(cache) and key.shape == value.shape == (t, cache.data.shape[3], cache.data.shape[4])
          and all(x.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(1) == d for x in (key, value))
          and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.shape == (t,))
    lib = _lib() if ok else None
    if lib is None:
        return False
    lib.llmd_store_int8(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), t, kv_heads, d,
                        cache.data.data_ptr(), cache.data.stride(0), cache.scales.data_ptr(), cache.scales.stride(0),
                        slot_mapping.data_ptr(), SCALE_FLOOR, torch.get_num_threads())
    return True
