"""Pure-torch paged attention: the oracle for the Triton kernels and the CPU path.

The KV cache of one layer is a :class:`~llmd.quant.kv.PagedKVCache` (or a bare ``auto`` data
tensor): data ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K, 1 = V) plus,
for int8/fp8, float32 scales ``[2, num_blocks, block_size, num_kv_heads]``. A token at slot
``s`` lives at ``[:, s // block_size, s % block_size]``. Quantized rows are written with
:func:`llmd.quant.kv.quantize` and read back as ``code × scale`` (every read multiplies by
its scale).
Semantics follow vLLM's ``ref_paged_attn`` (tests/kernels/attention): each query at position
``p`` attends causally to keys ``0..p`` of its own sequence, or to ``[p - W + 1, p]`` with a
sliding window ``W``.
"""

from __future__ import annotations

import torch

from llmd.kernels import kivi
from llmd.kernels.metadata import AttentionMetadata
from llmd.quant.kv import PagedKVCache, compute_scales, dequantize, quantize


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor | PagedKVCache,
             slot_mapping: torch.Tensor, padded: bool | None = None) -> None:
    """Write new K/V rows into the paged cache, in place, quantizing on write for int8/fp8/int4
    (int4: packed codes and per-16-channel float16 scales, :mod:`llmd.quant.kv`). K arrives already
    rotated for a ``--kv-rotation`` cache (:func:`llmd.kernels.ops.store_kv` rotates it).

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``, any float dtype (cast to the cache dtype).
        kv_cache: a :class:`PagedKVCache` or an ``auto`` data tensor
            ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[T]`` int64 slots; negative slots are skipped (padding).
        padded: whether ``slot_mapping`` may hold negative slots
            (:attr:`AttentionMetadata.slots_padded`, known once per step); None = check here
            (three small ops and a host sync per call).
    """
    cache = PagedKVCache.wrap(kv_cache)
    data, fmt = cache.data, cache.fmt
    num_blocks, block_size = data.shape[1], data.shape[2]
    flat = data.view(2, num_blocks * block_size, *data.shape[3:])
    if padded is None or padded:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if not fmt.quantized:  # index_copy_: one kernel per plane (an index_put costs ~2.5x at T = 1)
        flat[0].index_copy_(0, slot_mapping, key.to(data.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(data.dtype))
        return
    flat_scales = cache.scales.view(2, num_blocks * block_size, *cache.scales.shape[3:])
    for i, x in enumerate((key, value)):
        if cache.static_scales is None:
            s = compute_scales(x, fmt)
        else:
            s = torch.full(x.shape[:2], cache.static_scales[i], dtype=torch.float32, device=x.device)
        flat[i, slot_mapping] = quantize(x, s, fmt)
        flat_scales[i, slot_mapping] = s.to(flat_scales.dtype)  # exact: float16 scales are rounded already


def gather_kv(
    kv_cache: torch.Tensor | PagedKVCache, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a sequence's first ``seq_len`` K and V rows through its block table.

    Returns:
        (K, V), each ``[seq_len, num_kv_heads, head_dim]``: the cache dtype for ``auto``, ``dtype``
        for a float16 / bfloat16 cache,
        ``code × scale`` computed in ``dtype`` for int8/fp8, and for int4 after unpacking the
        two codes of each byte (each group of 16 channels times its own float16 scale).
    """
    cache = PagedKVCache.wrap(kv_cache)
    data = cache.data
    block_size = data.shape[2]
    nblocks = -(-seq_len // block_size)
    ids = block_table[:nblocks].long()
    k = data[0, ids].reshape(-1, *data.shape[3:])[:seq_len]
    v = data[1, ids].reshape(-1, *data.shape[3:])[:seq_len]
    if cache.fmt.quantized:
        ks = cache.scales[0, ids].reshape(-1, *cache.scales.shape[3:])[:seq_len]
        vs = cache.scales[1, ids].reshape(-1, *cache.scales.shape[3:])[:seq_len]
        k, v = dequantize(k, ks, dtype), dequantize(v, vs, dtype)
    elif cache.fmt.dtype is not None:  # a 16-bit float cache (float16 / bfloat16): widened exactly
        k, v = k.to(dtype), v.to(dtype)
    return k, v


def attention_one_seq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
    own: tuple[torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``Q`` positions of a sequence over its ``L`` keys.

    Args:
        q: ``[Q, num_heads, head_dim]``, queries for positions ``L - Q .. L - 1``.
        k, v: ``[L, num_kv_heads, head_dim]``; ``num_heads % num_kv_heads == 0`` (GQA).
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: ``W`` or None; query ``p`` sees keys ``[p - W + 1, p]``.
        own: int4's read rule (:mod:`llmd.kernels.kivi`): ``(k_own [L - t0, kv_heads,
            head_dim], t0, block_size)``, the exact K of positions ``t0..L - 1``; a query reads
            the keys of its own block from it, the others from ``k``.
    Returns:
        ``[Q, num_heads, head_dim]`` in ``q.dtype``.
    """
    nq, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qf = q.to(compute_dtype)
    kf = k.to(compute_dtype).repeat_interleave(group, dim=1)
    vf = v.to(compute_dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    qpos = torch.arange(seq_len - nq, seq_len, device=q.device)[:, None]
    kpos = torch.arange(seq_len, device=q.device)[None, :]
    if own is not None:
        k_own, t0, bs = own
        exact = torch.einsum("qhd,khd->hqk", qf, k_own.to(compute_dtype).repeat_interleave(group, dim=1)) * scale
        same = kivi.own_block_mask(qpos[:, 0], kpos[0, t0:], bs)
        scores[:, :, t0:] = torch.where(same, exact, scores[:, :, t0:])
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor | PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
    tails: list | None = None,
) -> torch.Tensor:
    """Attention for a mixed batch of prefill chunks and decodes, K/V read from the paged cache.

    The step's own K/V must already be stored (store-then-read), so a chunk attends to the
    cached prefix and causally to itself.

    Args:
        query: ``[T, num_heads, head_dim]``.
        kv_cache: :class:`PagedKVCache` or an ``auto`` data tensor.
        meta: :class:`AttentionMetadata` for the step.
        compute_dtype: float32 (the CPU path) or float64 (the kernels' oracle).
        tails: int4 only: :func:`llmd.kernels.kivi.store_keys`' result for this layer (the
            chunks' exact K; the own blocks of decodes are read from the residual).
    Returns:
        ``[T, num_heads, head_dim]`` in ``query.dtype``.
    """
    out = torch.empty_like(query)
    cache = PagedKVCache.wrap(kv_cache)
    start = 0
    for b, (qlen, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        own = None
        if cache.fmt.k_per_block:
            k, v = kivi.gather_blocks(cache, meta.block_tables[b], seq_len, compute_dtype)
            s = seq_len - qlen
            own = (kivi.own_keys(cache, meta, tails or [None] * meta.num_seqs, b), s - s % meta.block_size,
                   meta.block_size)
        else:
            k, v = gather_kv(kv_cache, meta.block_tables[b], seq_len, compute_dtype)
        out[start : start + qlen] = attention_one_seq(query[start : start + qlen], k, v, scale, sliding_window,
                                                      compute_dtype, own)
        start += qlen
    return out
