"""The CPU fast path's int4 (KIVI) branch: :func:`llmd.kernels.cpu_attention.paged_attention`
calls :func:`paged_attention` here for an int4 cache.

Same plans as the other formats (:class:`llmd.kernels.cpu_plan.StepPlan`: one gather of
rows ``(sequence, KV head, key position)`` per decode bucket and per prefill chunk), with the
read rule of :mod:`llmd.kernels.kivi`:

* the gathered rows are dequantized: K as ``code × scale + zero`` with the scale and zero point
  of the row's (block, KV head) channel by channel, V per 16 channels;
* **decodes**: the rows of the query's own block are then overwritten, in the gathered buffer,
  with the residual's 16-bit values (one ``index_copy_`` per bucket; a decode has one query,
  so its own block is one run of rows);
* **prefill chunks**: queries of a chunk sit in several blocks, so each reads its own block from
  the chunk's exact tail: scores over the tail (``q · tailᵀ``) replace the dequantized scores
  where key and query share a block (an ``[Q, n]`` mask), then one softmax and ``probs @ V``.
"""

from __future__ import annotations

import torch

from llmd.kernels import kivi
from llmd.kernels.metadata import AttentionMetadata
from llmd.quant.kv import PagedKVCache, dequantize, dequantize_k_blocks


def _gather(plan, role: str, cache: PagedKVCache, rows: torch.Tensor, length: int, dtype: torch.dtype):
    """K and V ``[N * kv_heads, length, head_dim]`` in ``dtype``, dequantized, for gather rows
    ``rows`` (``slot · kv_heads + head``). Never-written slots read as finite stale values or 0
    (they are masked)."""
    data = cache.data
    heads, bs, packed = data.shape[3], data.shape[2], data.shape[-1]
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    blk, h = rows // (heads * bs), rows % heads
    off = (rows // heads) % bs
    codes = []
    for i in (0, 1):
        raw = plan.buffer(f"{role}{i}", (rows.shape[0], packed), data.dtype)
        torch.index_select(data[i].view(-1, packed), 0, rows, out=raw)
        codes.append(raw)
    k = dequantize_k_blocks(codes[0][:, None, None], cache.k_scale()[blk, h][:, None],
                            cache.k_zero()[blk, h][:, None], sdt)[:, 0, 0]
    v = dequantize(codes[1], cache.v_scale()[blk, off, h], sdt)
    n = rows.shape[0] // length
    return k.to(dtype).view(n, length, -1), v.to(dtype).view(n, length, -1)


def _own_rows(meta: AttentionMetadata, seqs: list[int], first: torch.Tensor, length: int, heads: int):
    """For decodes ``seqs`` (gathered from positions ``first[n]``, ``length`` each): ``(dst, src)``
    int64 rows: the own block's keys in the gathered ``[N * heads * length]`` buffer and in the
    residual viewed as ``[R * block_size * heads]`` rows."""
    bs = meta.block_size
    dst, src = [], []
    for n, b in enumerate(seqs):
        p = meta.seq_lens_cpu[b] - 1
        t0 = p - p % bs
        lo = max(t0, int(first[n]))
        pos = torch.arange(lo, p + 1)
        hh = torch.arange(heads)
        dst.append(((n * heads + hh[:, None]) * length + (pos - int(first[n]))[None, :]).reshape(-1))
        src.append(((meta.residual_slots[b] * bs + (pos - t0))[None, :] * heads + hh[:, None]).reshape(-1))
    return torch.cat(dst), torch.cat(src)


def _softmax_v(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    sdt = torch.float64 if scores.dtype == torch.float64 else torch.float32
    probs = torch.softmax(scores, dim=-1, dtype=sdt)
    return torch.bmm(probs.to(v.dtype), v)


def paged_attention(query: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None, tails: list, plan, cdt: torch.dtype) -> torch.Tensor:
    """int4 attention for the step (``query [T, num_heads, head_dim]``; ``plan`` the group's
    :class:`~llmd.kernels.cpu_plan.StepPlan`; ``tails`` from :func:`llmd.kernels.kivi.store_keys`).
    Returns ``[T, num_heads, head_dim]`` in ``cdt``."""
    t, num_heads, head_dim = query.shape
    heads = cache.data.shape[3]
    group = num_heads // heads
    q = query.to(cdt)
    out = torch.empty(t, num_heads, head_dim, dtype=cdt)
    kp = kivi.get_plan(meta)
    dec_seqs = kp.dec_seq.tolist()
    res = cache.residual.view(-1, head_dim)
    for i, (members, g) in enumerate(plan.decodes):
        idx = plan.decode_idx if members is None else plan.decode_idx[members]
        nd, length = idx.shape[0], g.bias.shape[-1]
        seqs = dec_seqs if members is None else [dec_seqs[m] for m in members.tolist()]
        key = ("kivi-own", i)
        own = plan.workspace.get(key)
        if own is None:
            lens = torch.tensor([meta.seq_lens_cpu[b] for b in seqs])
            first = torch.zeros_like(lens) if sliding_window is None else torch.clamp(lens - sliding_window, min=0)
            own = plan.workspace[key] = _own_rows(meta, seqs, first, length, heads)
        k, v = _gather(plan, f"d{i}", cache, g.rows, length, cdt)
        k.view(-1, head_dim).index_copy_(0, own[0], res.index_select(0, own[1]).to(cdt))
        qd = q.index_select(0, idx).view(nd * heads, group, head_dim)
        scores = torch.baddbmm(g.scores_bias(cdt), qd, k.transpose(1, 2), alpha=scale)
        out.index_copy_(0, idx, _softmax_v(scores, v).view(nd, num_heads, head_dim))
    chunks = {c.tok: c for c in kp.chunks}
    for start, q_len, g in plan.prefills:
        c = chunks[start]
        length = g.bias.shape[-1]
        first = c.e - length
        k, v = _gather(plan, "p", cache, g.rows, length, cdt)
        qp = q[start : start + q_len].reshape(q_len, heads, group, head_dim).permute(1, 2, 0, 3)
        qp = qp.reshape(heads, group * q_len, head_dim)
        scores = torch.baddbmm(g.scores_bias(cdt), qp, k.transpose(1, 2), alpha=scale)
        lo = max(c.t0, first)
        tail = tails[c.seq][lo - c.t0 :].to(cdt).permute(1, 0, 2)  # [heads, n, head_dim]
        region = scores[:, :, lo - first :]
        exact = torch.baddbmm(g.scores_bias(cdt)[:, :, lo - first :], qp, tail.transpose(1, 2), alpha=scale)
        same = kivi.own_block_mask(torch.arange(c.s, c.e), torch.arange(lo, c.e), meta.block_size)
        same = same.repeat(group, 1)[None]  # rows of qp are (group, query)
        scores[:, :, lo - first :] = torch.where(same, exact, region)
        o = _softmax_v(scores, v)
        out[start : start + q_len] = o.view(heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(
            q_len, num_heads, head_dim)
    return out
