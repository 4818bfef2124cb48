"""The GPU correctness check's int4 (KIVI) cases (``python -m llmd.kernels.bench check``,
:func:`llmd.kernels.bench.run_kernel_check`): the store of :mod:`llmd.kernels.kivi` and the
Triton kernels on ``dev`` against the torch reference on CPU tensors.

Two steps per case, as the engine runs them: the cached prefixes first (each sequence's context
as one chunk, or a decode for a context of 1), then the case's queries (decodes, or prefill
chunks with decodes). Both steps store on ``dev`` and on a CPU copy; the check compares the two
caches byte for byte (codes, scales and zero points, the residual: the torch store on CUDA
tensors gives the CPU's bytes) and the second step's attention with the float64 reference of
the read rule on the CPU bytes (:func:`llmd.kernels.reference.paged_attention` with ``tails``).
"""

from __future__ import annotations

import itertools

import torch

from llmd.kernels import kivi
from llmd.kernels.metadata import AttentionMetadata
from llmd.quant.kv import PagedKVCache, get_format, to_residual


def _meta(rows: list[int], qlens: list[int], ends: list[int], tables: torch.Tensor, slots: list[torch.Tensor],
          bs: int, dev: str) -> AttentionMetadata:
    """Metadata of one step: sequences ``rows`` with ``qlens`` new tokens ending at ``ends``
    (residual slot ``row + 1``), tensors on ``dev``."""
    slot = torch.cat([slots[b][e - n : e] for b, n, e in zip(rows, qlens, ends)])
    qsl = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    return AttentionMetadata(slot.to(dev), tables[rows].to(dev), qsl.to(dev),
                             torch.tensor(ends, dtype=torch.int32).to(dev), qlens, ends, bs, "triton",
                             residual_slots=[b + 1 for b in rows])


def _store(cache: PagedKVCache, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> list:
    kivi.store_values(v, cache, meta.slot_mapping)
    return kivi.store_keys(cache, to_residual(k, cache.residual.dtype), meta)


def check_int4_case(case: dict, ctx_q: list[tuple[int, int]], tables: torch.Tensor, slots: list[torch.Tensor],
                    num_blocks: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                    dev: str) -> tuple[float, bool]:
    """(relative error vs float64, stored bytes equal to the CPU's) of one int4 case.

    Args:
        case: the check row (``dtype``, ``head_dim``, ``block_size``, ``window``, ``path``:
            "decode" = one split, "split" = 4 splits, "prefill").
        ctx_q: per sequence (cached context, new tokens); tables, slots, num_blocks: the layout
            (:func:`llmd.kernels.bench.random_paged_layout`); k, v: ``[sum(ctx + new), kv_heads,
            head_dim]`` per sequence in position order; q: ``[sum(new), heads, head_dim]``.
    """
    from llmd.kernels import reference
    from llmd.kernels.kivi_decode import kivi_paged_decode_attention
    from llmd.kernels.kivi_triton import paged_attention

    dt, bs = q.dtype, case["block_size"]
    shape = (2, num_blocks, bs, k.shape[1], k.shape[2])
    fmt = get_format("int4")
    caches = {d: PagedKVCache.allocate(shape, fmt, dt, d, residual_slots=len(ctx_q) + 1) for d in (dev, "cpu")}
    starts = [0, *itertools.accumulate(c + n for c, n in ctx_q)]
    pre = [b for b, (c, _) in enumerate(ctx_q) if c]
    now = list(range(len(ctx_q)))
    tails = {}
    for rows, first in ((pre, True), (now, False)):
        qlens = [ctx_q[b][0] if first else ctx_q[b][1] for b in rows]
        ends = [ctx_q[b][0] + (0 if first else ctx_q[b][1]) for b in rows]
        idx = torch.cat([torch.arange(starts[b] + e - n, starts[b] + e) for b, n, e in zip(rows, qlens, ends)])
        for d, cache in caches.items():
            meta = _meta(rows, qlens, ends, tables, slots, bs, d)
            tails[d] = (_store(cache, meta, k[idx].to(d), v[idx].to(d)), meta)
    got, ref = caches[dev], caches["cpu"]
    exact = all(torch.equal(a.cpu(), b) for a, b in ((got.data, ref.data), (got.scales, ref.scales),
                                                         (got.residual, ref.residual)))
    scale, window = case["head_dim"] ** -0.5, case["window"]
    dev_tails, dmeta = tails[dev]
    if case["path"] == "prefill":
        out = paged_attention(q.to(dev), got, dmeta, scale, window, dev_tails)
    else:
        own = got.residual.view(-1, *got.residual.shape[2:])
        rows = torch.tensor([s * bs for s in dmeta.residual_slots], dtype=torch.int64).to(dev)
        out = kivi_paged_decode_attention(q.to(dev), got, dmeta.block_tables, dmeta.seq_lens, own, rows,
                                          max(dmeta.seq_lens_cpu), scale, window,
                                          num_splits=1 if case["path"] == "decode" else 4)
    cpu_tails, meta = tails["cpu"]
    want = reference.paged_attention(q.double(), ref, meta, scale, window, torch.float64, cpu_tails)
    out = out.cpu().double()
    err = ((out - want).norm() / want.norm()).item() if torch.isfinite(out).all() else float("inf")
    return err, exact
