"""The Triton backend's int4 (KIVI) attention: :func:`llmd.kernels.ops.paged_attention` calls
:func:`paged_attention` here for an int4 cache with ``--attention-backend triton``.

Storing stays :mod:`llmd.kernels.kivi`'s vectorized torch (V per token in ``ops.store_kv``, K
through the residual in :func:`~llmd.kernels.kivi.store_keys` before the read), on whatever
device the cache lives: the index math is planned once per step on the host and each layer
runs a handful of ``index_copy_`` / quantize ops; one code path means the Triton backend stores
the bytes the cpu and torch backends store (tested). The reads are the kernels:

* a decode-only step: :func:`~llmd.kernels.kivi_decode.kivi_paged_decode_attention`, each
  sequence's own block read straight from the residual (rows ``slot · block_size ..``);
* any step with a prefill chunk: :func:`~llmd.kernels.kivi_prefill.kivi_paged_prefill_attention`,
  with one ``own`` tensor per layer: every sequence's exact K of positions ``t0 .. seq_len - 1``
  (a chunk's tail, a decode's residual rows) concatenated, ``own_rows`` their first rows.

The per-step row indices are device tensors built once per metadata (``meta.plans``). Decode
steps of an int4 cache run eagerly: the store's host-planned indexing is not captured in a CUDA
graph (the model runner captures none for int4).
"""

from __future__ import annotations

import torch

from llmd.kernels import kivi
from llmd.kernels.metadata import AttentionMetadata
from llmd.quant.kv import PagedKVCache


def _decode_rows(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """``[B]`` int64 on ``device``: each sequence's residual row ``slot · block_size`` (built once per step)."""
    rows = meta.plans.get("kivi-triton-decode")
    if rows is None:
        rows = meta.plans["kivi-triton-decode"] = torch.tensor(
            [s * meta.block_size for s in meta.residual_slots], dtype=torch.int64).to(device)
    return rows


def own_keys(cache: PagedKVCache, meta: AttentionMetadata, tails: list) -> tuple[torch.Tensor, torch.Tensor]:
    """``(own [R, kv_heads, head_dim], own_rows [B] int64)``: every sequence's exact 16-bit K of
    positions ``t0 .. seq_len - 1`` (:func:`llmd.kernels.kivi.own_keys`) back to back, and the row
    where each sequence's begins."""
    parts = [kivi.own_keys(cache, meta, tails, b) for b in range(meta.num_seqs)]
    rows = meta.plans.get("kivi-triton-rows")
    if rows is None:
        starts = [0]
        for p in parts[:-1]:
            starts.append(starts[-1] + p.shape[0])
        rows = meta.plans["kivi-triton-rows"] = torch.tensor(starts, dtype=torch.int64).to(cache.residual.device)
    return torch.cat(parts), rows


def paged_attention(query: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None, tails: list | None) -> torch.Tensor:
    """int4 attention of ``query [T, num_heads, head_dim]`` for the step, after
    :func:`llmd.kernels.kivi.store_keys` (``tails`` its result). Returns ``[T, num_heads,
    head_dim]`` in ``query.dtype``. Raises ValueError without residual slots."""
    kivi.get_plan(meta)  # raises without residual slots
    tails = tails or [None] * meta.num_seqs
    if max(meta.query_lens_cpu) == 1:
        from llmd.kernels.kivi_decode import kivi_paged_decode_attention

        res = cache.residual
        own = res.view(-1, *res.shape[2:])
        return kivi_paged_decode_attention(query, cache, meta.block_tables, meta.seq_lens, own,
                                           _decode_rows(meta, res.device), max(meta.seq_lens_cpu), scale,
                                           sliding_window)
    from llmd.kernels.kivi_prefill import kivi_paged_prefill_attention

    own, rows = own_keys(cache, meta, tails)
    return kivi_paged_prefill_attention(query, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, own,
                                        rows, max(meta.query_lens_cpu), scale, sliding_window)
