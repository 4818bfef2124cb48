"""int4 KV cache (KIVI, arXiv:2402.02750): storing K per block through the open-block residual.

The layout is :mod:`llmd.quant.kv`'s (K codes per (block, KV head, channel) with a float16
scale and zero point over the block's tokens; V per token; the 16-bit residual holding each
sequence's open block). The read rule, which every attention path follows, makes what a query
at position ``p`` reads for key ``j`` depend on ``(p, j)`` only, never on how the prompt was
chunked or when a block filled (cases S1, store-then-read):

* keys in blocks *before* the query's own block are read dequantized from the int4 block;
* keys in the query's *own* block are read in 16 bits (the residual's values).

A block's K is quantized in the step that fills it (no later query can be in it), from the
16-bit values: the residual's rows before the step plus the step's new keys, so a block costs
the same bytes whether it filled one token at a time or inside one long chunk.

Per step and KV cache group the index math is done once (:class:`KiviPlan`, cached on the
step's :class:`AttentionMetadata`); each layer then runs :func:`store_keys`: decodes write their
key into their residual row in one vectorized copy, and the blocks that fill are quantized in one
batch; prefill chunks (a few per step) build their exact tail ``[t0, seq_len)`` one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmd.kernels.metadata import AttentionMetadata
from llmd.quant.kv import PagedKVCache, dequantize, dequantize_k_blocks, quantize_k_blocks


@dataclass
class _Chunk:
    """One prefill chunk: its tokens ``[tok, tok + q)`` at positions ``[s, e)``; ``t0`` the first
    position of its first block; ``full`` the block ids of the blocks it fills (from ``t0``)."""

    seq: int
    tok: int
    q: int
    s: int
    e: int
    t0: int
    slot: int
    full: torch.Tensor


@dataclass
class KiviPlan:
    """Where one step's keys go (the same for every layer of a KV cache group).

    Attributes:
        dec_tok: ``[Nd]`` int64 token index of each decode; ``dec_rows`` ``[Nd]`` its residual
            row (``slot · block_size + offset``); ``dec_len`` its own-block length
            (``offset + 1``), a list.
        fill_slots, fill_blocks: ``[Nf]`` int64: decodes that fill their block: the residual
            slot to quantize and the block id to write.
        chunks: the prefill chunks (query length > 1).
    """

    dec_seq: torch.Tensor
    dec_tok: torch.Tensor
    dec_rows: torch.Tensor
    fill_slots: torch.Tensor
    fill_blocks: torch.Tensor
    chunks: list[_Chunk]


def get_plan(meta: AttentionMetadata) -> KiviPlan:
    """The step's :class:`KiviPlan`, built once per metadata. Raises ValueError when a sequence
    has no residual slot."""
    plan = meta.plans.get("kivi")
    if plan is not None:
        return plan
    bs = meta.block_size
    slots = meta.residual_slots
    if slots is None or len(slots) != meta.num_seqs or min(slots, default=0) < 0:
        raise ValueError("an int4 KV cache step needs a residual slot per sequence (AttentionMetadata.residual_slots)")
    tables = meta.block_tables.cpu().long()
    dec_seq, dec_tok, dec_rows, fill_slots, fill_blocks, chunks = [], [], [], [], [], []
    tok = 0
    for b, (q, e) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        s = e - q
        if q == 1:
            dec_seq.append(b)
            dec_tok.append(tok)
            dec_rows.append(slots[b] * bs + s % bs)
            if s % bs == bs - 1:
                fill_slots.append(slots[b])
                fill_blocks.append(int(tables[b, s // bs]))
        elif q > 1:
            t0 = s - s % bs
            n_full = (e - t0) // bs
            chunks.append(_Chunk(b, tok, q, s, e, t0, slots[b], tables[b, t0 // bs : t0 // bs + n_full]))
        tok += q
    i64 = torch.int64
    plan = KiviPlan(torch.tensor(dec_seq, dtype=i64), torch.tensor(dec_tok, dtype=i64),
                    torch.tensor(dec_rows, dtype=i64), torch.tensor(fill_slots, dtype=i64),
                    torch.tensor(fill_blocks, dtype=i64), chunks)
    meta.plans["kivi"] = plan
    return plan


def _write_blocks(cache: PagedKVCache, blocks: torch.Tensor, k: torch.Tensor) -> None:
    """Quantize full blocks ``k [n, block_size, kv_heads, head_dim]`` into block ids ``blocks``."""
    codes, scale, zero = quantize_k_blocks(k)
    dev = cache.data.device
    ids = blocks.to(dev)
    cache.data[0, ids] = codes
    cache.k_scale()[ids] = scale
    cache.k_zero()[ids] = zero


def store_keys(cache: PagedKVCache, keys: torch.Tensor, meta: AttentionMetadata) -> list[torch.Tensor | None]:
    """Store one layer's new K (already rotated and in the residual dtype) for the step.

    Args:
        cache: an int4 :class:`PagedKVCache` (its ``residual`` pool).
        keys: ``[T, kv_heads, head_dim]`` in ``cache.residual.dtype``.
        meta: the step's metadata (block tables, lengths, residual slots).
    Returns:
        Per sequence, a prefill chunk's exact K ``[e - t0, kv_heads, head_dim]`` (positions
        ``t0 = s - s % block_size`` .. ``e - 1``; the residual is overwritten by later blocks of a
        long chunk, so the chunk reads its own blocks from here), None for a decode (its own
        block is ``residual[slot, : offset + 1]`` after this call).
    """
    plan = get_plan(meta)
    res = cache.residual
    bs, heads, d = res.shape[1:]
    dev = res.device
    tails: list[torch.Tensor | None] = [None] * meta.num_seqs
    for c in plan.chunks:  # every read of the residual before any write
        new = keys[c.tok : c.tok + c.q]
        tails[c.seq] = torch.cat((res[c.slot, : c.s - c.t0], new)) if c.s > c.t0 else new
    if plan.dec_tok.numel():
        res.view(-1, heads, d).index_copy_(0, plan.dec_rows.to(dev), keys.index_select(0, plan.dec_tok.to(dev)))
        if plan.fill_slots.numel():
            _write_blocks(cache, plan.fill_blocks, res.index_select(0, plan.fill_slots.to(dev)))
    for c in plan.chunks:
        tail = tails[c.seq]
        n_full = len(c.full)
        if n_full:
            _write_blocks(cache, c.full, tail[: n_full * bs].view(n_full, bs, heads, d))
        rem = tail.shape[0] - n_full * bs
        if rem:
            res[c.slot, :rem] = tail[n_full * bs :]
    return tails


def store_values(value: torch.Tensor, cache: PagedKVCache, slot_mapping: torch.Tensor) -> None:
    """V per token (symmetric, a float16 scale per 16 channels) at ``slot_mapping`` ``[T]``
    (negative slots skipped): codes into ``data[1]``, scales into :meth:`PagedKVCache.v_scale`."""
    from llmd.quant.kv import compute_scales, quantize

    valid = slot_mapping >= 0
    if not bool(valid.all()):
        value, slot_mapping = value[valid], slot_mapping[valid]
    bs = cache.block_size
    s = compute_scales(value, cache.fmt)
    cache.data[1, slot_mapping // bs, slot_mapping % bs] = quantize(value, s, cache.fmt)
    cache.v_scale()[slot_mapping // bs, slot_mapping % bs] = s.to(cache.scales.dtype)


def own_keys(cache: PagedKVCache, meta: AttentionMetadata, tails: list, b: int) -> torch.Tensor:
    """Sequence ``b``'s exact K of positions ``t0 .. seq_len - 1`` (its last block, or a chunk's
    blocks), after :func:`store_keys`."""
    if tails[b] is not None:
        return tails[b]
    e = meta.seq_lens_cpu[b]
    s = e - meta.query_lens_cpu[b]
    return cache.residual[meta.residual_slots[b], : s % meta.block_size + 1]


def gather_blocks(cache: PagedKVCache, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype):
    """A sequence's first ``seq_len`` K (dequantized per block and channel) and V (per token)
    ``[seq_len, kv_heads, head_dim]`` in ``dtype``. K of an open block reads stale codes there:
    the read rule replaces those keys with :func:`own_keys`."""
    bs = cache.block_size
    ids = block_table[: -(-seq_len // bs)].long()
    k = dequantize_k_blocks(cache.data[0, ids], cache.k_scale()[ids], cache.k_zero()[ids], dtype)
    v = dequantize(cache.data[1, ids], cache.v_scale()[ids], dtype)
    return k.reshape(-1, *k.shape[2:])[:seq_len], v.reshape(-1, *v.shape[2:])[:seq_len]


def own_block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[Q, L]`` bool: key position ``k_pos[l]`` is in the block of query position ``q_pos[q]``."""
    return (k_pos[None, :] // block_size) == (q_pos[:, None] // block_size)
