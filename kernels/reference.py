"""Pure-torch paged attention: the oracle for the Triton kernels and the CPU path.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = K, 1 = V). A token at slot ``s`` lives at ``[:, s // block_size, s % block_size]``.
Semantics follow vLLM's ``ref_paged_attn`` (tests/kernels/attention): each query at position
``p`` attends causally to keys ``0..p`` of its own sequence, or to ``[p - W + 1, p]`` with a
sliding window ``W``.
"""

from __future__ import annotations

import torch

from llmd.kernels.metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new K/V rows into the paged cache, in place.

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``, any float dtype (cast to the cache dtype).
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[T]`` int64 slots; negative slots are skipped (padding).
    """
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat[0, slot_mapping] = key.to(kv_cache.dtype)
    flat[1, slot_mapping] = value.to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a sequence's first ``seq_len`` K and V rows through its block table.

    Returns:
        (K, V), each ``[seq_len, num_kv_heads, head_dim]`` in the cache dtype.
    """
    block_size = kv_cache.shape[2]
    nblocks = -(-seq_len // block_size)
    ids = block_table[:nblocks].long()
    k = kv_cache[0, ids].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    v = kv_cache[1, ids].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    return k, v


def attention_one_seq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Causal attention of the last ``Q`` positions of a sequence over its ``L`` keys.

    Args:
        q: ``[Q, num_heads, head_dim]``, queries for positions ``L - Q .. L - 1``.
        k, v: ``[L, num_kv_heads, head_dim]``; ``num_heads % num_kv_heads == 0`` (GQA).
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: ``W`` or None; query ``p`` sees keys ``[p - W + 1, p]``.
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
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention for a mixed batch of prefill chunks and decodes, K/V read from the paged cache.

    The step's own K/V must already be stored (store-then-read), so a chunk attends to the
    cached prefix and causally to itself.

    Args:
        query: ``[T, num_heads, head_dim]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        meta: :class:`AttentionMetadata` for the step.
    Returns:
        ``[T, num_heads, head_dim]`` in ``query.dtype``.
    """
    out = torch.empty_like(query)
    start = 0
    for b, (qlen, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        k, v = gather_kv(kv_cache, meta.block_tables[b], seq_len)
        out[start : start + qlen] = attention_one_seq(query[start : start + qlen], k, v, scale, sliding_window)
        start += qlen
    return out
