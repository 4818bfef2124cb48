"""The attention ops the models call: ``store_kv`` and ``paged_attention``, per backend.

``cpu`` runs :mod:`llmd.kernels.cpu_attention` (batched over the step; the CPU default);
``torch`` runs :mod:`llmd.kernels.reference` (per sequence: the oracle); ``triton`` runs
the kernels in ``kv_store.py``, ``decode_attention.py`` (batches of decodes only) and
``prefill_attention.py`` (any batch with a prefill chunk), and for int4 caches the torch store
of ``kivi.py`` with the kernels of ``kivi_triton.py``. The Triton modules are imported on
first use, so ``TRITON_INTERPRET=1`` (the interpreter that runs them on CPU for tests) can be
set after ``llmd`` is imported.

``--kv-rotation`` (:mod:`llmd.quant.rotation`, QuaRot arXiv:2404.00456) lives here, around
every backend: :func:`store_kv` stores ``K H`` (K after RoPE) for a cache whose ``rotation``
is not "none", and :func:`paged_attention` attends with ``q H`` (``(q H)·(k H) = q·k``), so
scores equal the unrotated ones in exact arithmetic and no backend needs to know (the Triton
kernels included). V is stored as it is: rotating it too (and the output back) measured no
better (README, "Quantized KV cache": Gemma 3 int8 ΔNLL 0.86 % with V rotated vs 0.21 % without,
int4 27.6 % vs 23.3 %; SmolLM2 within noise) and costs two more matmuls per layer.
"""

from __future__ import annotations

import torch

from llmd.kernels import cpu_attention, kivi, reference
from llmd.kernels.metadata import AttentionMetadata
from llmd.quant.kv import PagedKVCache, to_residual
from llmd.quant.rotation import rotate

BACKENDS = ("cpu", "torch", "triton")


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor | PagedKVCache,
             slot_mapping: torch.Tensor, backend: str = "torch", padded: bool | None = None) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[T]`` int64,
    quantizing on write for int8/fp8/int4 caches (K rotated first for a ``--kv-rotation`` cache).
    int4 (:mod:`llmd.kernels.kivi`): V is stored here; K, in 16 bits, waits in the cache's
    ``new_keys`` for :func:`paged_attention`, which has the step's block tables and residual slots.
    ``padded``: :attr:`AttentionMetadata.slots_padded` (False skips the torch path's per-call
    check for -1 slots; None checks)."""
    key = rotate(key, _rotation(kv_cache))
    if isinstance(kv_cache, PagedKVCache) and kv_cache.fmt.k_per_block:
        kivi.store_values(value, kv_cache, slot_mapping)
        kv_cache.new_keys = to_residual(key, kv_cache.residual.dtype)
        return
    if backend == "triton":
        from llmd.kernels.kv_store import store_kv as triton_store_kv

        triton_store_kv(key, value, PagedKVCache.wrap(kv_cache), slot_mapping)
    else:
        reference.store_kv(key, value, kv_cache, slot_mapping, padded)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor | PagedKVCache, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of ``query [T, num_heads, head_dim]`` over the paged cache, using
    ``meta.attn_backend`` ("cpu", "torch" or "triton"). Returns ``[T, num_heads, head_dim]`` in
    ``query.dtype``. The torch backend computes in float32, or float64 for a float64 model
    (``--dtype float64`` reference runs, where every product must stay float64)."""
    return _paged_attention(rotate(query, _rotation(kv_cache)), kv_cache, meta, scale, sliding_window)


def _rotation(kv_cache: torch.Tensor | PagedKVCache) -> str:
    return kv_cache.rotation if isinstance(kv_cache, PagedKVCache) else "none"


def _paged_attention(query: torch.Tensor, kv_cache: torch.Tensor | PagedKVCache, meta: AttentionMetadata,
                     scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """:func:`paged_attention` without the rotation, on ``meta.attn_backend``."""
    tails = None
    if isinstance(kv_cache, PagedKVCache) and kv_cache.fmt.k_per_block:
        if kv_cache.new_keys is not None:  # store-then-read: the step's K first
            kv_cache.step_tails = kivi.store_keys(kv_cache, kv_cache.new_keys, meta)
            kv_cache.new_keys = None
        tails = kv_cache.step_tails
    if meta.attn_backend == "cpu":
        return cpu_attention.paged_attention(query, kv_cache, meta, scale, sliding_window, tails)
    if meta.attn_backend != "triton":
        compute = torch.float64 if query.dtype == torch.float64 else torch.float32
        return reference.paged_attention(query, kv_cache, meta, scale, sliding_window, compute, tails)
    cache = PagedKVCache.wrap(kv_cache)
    if cache.fmt.k_per_block:
        from llmd.kernels.kivi_triton import paged_attention as kivi_triton_attention

        return kivi_triton_attention(query, cache, meta, scale, sliding_window, tails)
    if max(meta.query_lens_cpu) == 1:
        from llmd.kernels.decode_attention import paged_decode_attention

        fixed = meta.decode_max_seq_len  # a captured decode: splits from the bound, lengths on the device
        return paged_decode_attention(query, cache, meta.block_tables, meta.seq_lens,
                                      fixed or max(meta.seq_lens_cpu), scale, sliding_window,
                                      per_seq_splits=fixed is not None)
    from llmd.kernels.prefill_attention import paged_prefill_attention

    return paged_prefill_attention(query, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                   max(meta.query_lens_cpu), scale, sliding_window)
