"""Cascade attention for sequences that share a prefix (the CPU fast path; vLLM's "cascade
attention", FlashInfer's cascade / Hydragen, arXiv:2402.05099).

Sequences whose block tables start with the same physical blocks (a prefix-cache hit on a common
system prompt, the siblings of ``n > 1``, beams) read the same keys for those positions. The
plain batched path gathers and multiplies them once *per sequence*; here each group of such
sequences — decodes and prefill chunks alike, as long as the shared prefix ends at or before the
member's first query, so every query sees all of it — attends to the shared prefix **once**: every
member's query tokens stacked into one matrix per KV head, ``[kv_heads, tokens · group, head_dim]
@ [kv_heads, head_dim, P]``; each member attends to the rest of its own context as usual (decode
length buckets and prefill chunk gathers then start at ``P``). The two partial results merge
exactly through their log-sum-exps:

``lse = logaddexp(lse_p, lse_s)``, ``out = o_p · exp(lse_p - lse) + o_s · exp(lse_s - lse)``,

where ``o_p``, ``o_s`` are each part's softmax-normalised output. In exact arithmetic this equals
one softmax over all keys; in floating point only the reduction order differs (so a request's
logits can move in the last bits with which other requests share its prefix in a step, the same
class of batch dependence as the length buckets' padding; README, "Batch invariance").

Prefill chunks joining a cascade matter most for many chats arriving at once on one cached system
prompt: each chunk is a few dozen tokens over a ~1,000-token prefix, which the plain path would
gather and multiply once per chunk.

Only for groups without a sliding window (a window would cut into the prefix) and caches read
through :func:`llmd.kernels.cpu_attention._gather_kv` (auto, int8, fp8, grouped scales; int4
takes its own branch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: a group needs at least this many decodes and shared full blocks to pay for its extra matmuls
CASCADE_MIN_SEQS, CASCADE_MIN_BLOCKS = 2, 4


@dataclass
class Cascade:
    """Decodes sharing their first ``prefix_len`` keys (whole blocks).

    Attributes:
        members: ``[n]`` int64 positions among the step's sequences (decodes and prefill chunks).
        prefix_len: shared tokens ``P`` (a multiple of the block size, at most every member's first
            query position).
        rows: ``[kv_heads * P]`` int64 gather rows of the prefix (ordered KV head, position).
        tokens: ``[sum of the members' query lengths]`` int64 flat indices of their query tokens
            (set by the plan: :func:`query_tokens`).
    """

    members: torch.Tensor
    prefix_len: int
    rows: torch.Tensor
    tokens: torch.Tensor | None = None


def query_tokens(starts: torch.Tensor, qlens: torch.Tensor) -> torch.Tensor:
    """Flat token indices ``[sum(qlens)]`` int64 of the query ranges ``[starts[i], starts[i] + qlens[i])``."""
    offsets = torch.cumsum(qlens, 0) - qlens
    return torch.repeat_interleave(starts - offsets, qlens) + torch.arange(int(qlens.sum()))


def find_cascades(tables: torch.Tensor, lens: torch.Tensor, block_size: int, kv_heads: int,
                  key_rows) -> list[Cascade]:
    """Groups of sequences whose tables start with the same blocks.

    Args:
        tables: ``[N, max_blocks]`` int32 block tables of the step's sequences (host).
        lens: ``[N]`` int64 each one's first query position + 1 (a decode's sequence length,
            its new key included; a prefill chunk's cached context + 1).
        key_rows: :func:`llmd.kernels.cpu_plan.key_rows` (passed in: this module sits below it).
    Returns:
        One :class:`Cascade` per first block shared by at least :data:`CASCADE_MIN_SEQS` sequences
        whose common leading blocks (full in every member, ending at or before its first query)
        number at least :data:`CASCADE_MIN_BLOCKS` (a sequence whose first query comes earlier is
        left out rather than shortening the others' prefix). Block 0 (the null block) never counts.
        Sequences without a partner cost one ``unique`` and nothing else.
    """
    first = tables[:, 0].long()
    ids, counts = torch.unique(first, return_counts=True)
    out = []
    for bid in ids[counts >= CASCADE_MIN_SEQS].tolist():
        if bid == 0:
            continue
        # a member whose own first query comes within CASCADE_MIN_BLOCKS blocks (a chat's first
        # chunk, or a short sibling) attends on its own instead of capping everyone's prefix
        members = torch.nonzero((first == bid) & ((lens - 1) // block_size >= CASCADE_MIN_BLOCKS)).flatten()
        if len(members) < CASCADE_MIN_SEQS:
            continue
        sub = tables[members]
        lcp = int((sub == sub[:1]).all(0).long().cumprod(0).sum())
        shared = min(lcp, int(((lens[members] - 1) // block_size).min()))
        if shared >= CASCADE_MIN_BLOCKS:
            p = shared * block_size
            rows = key_rows(sub[:1], torch.zeros(1, dtype=torch.int64), p, block_size, kv_heads)
            out.append(Cascade(members, p, rows))
    return out


def merge_prefixes(plan, q: torch.Tensor, cache, out: torch.Tensor, lse: torch.Tensor, scale: float,
                   gather_kv, attend) -> None:
    """Attend each cascade's members to their shared prefix and merge into ``out`` in place.

    Args:
        plan: the step's ``StepPlan`` (``cascades``, ``buffer``).
        q: ``[T, num_heads, head_dim]`` queries in the compute dtype.
        cache: the layer's :class:`~llmd.quant.kv.PagedKVCache`.
        out: ``[T, num_heads, head_dim]`` compute dtype; the members' token rows hold each one's
            attention over its own keys after the prefix (normalised), replaced by the merge.
        lse: ``[T, num_heads]`` float32/float64 log-sum-exp of those suffix scores (members' rows).
        gather_kv, attend: :func:`llmd.kernels.cpu_attention._gather_kv` and ``_attend`` (passed
            in: this module sits below that one), so the prefix is read and scored exactly as any
            other keys (one fused softmax; the log-sum-exp from it).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = cache.data.shape[3]
    group = num_heads // kv_heads
    sdt = lse.dtype
    for j, c in enumerate(plan.cascades):
        idx = c.tokens
        n = idx.shape[0]
        qc = q.index_select(0, idx).view(n, kv_heads, group, head_dim).transpose(0, 1).reshape(
            kv_heads, n * group, head_dim)
        k, v, ks, vs = gather_kv(plan, f"c{j}", cache, c.rows, c.prefix_len, q.dtype)
        o_p, lse_p = attend(plan, f"c{j}", qc, k, v, None, scale, ks, vs, with_lse=True)
        o_p = o_p.to(sdt).view(kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, num_heads, head_dim)
        lse_p = lse_p.view(kv_heads, n, group).transpose(0, 1).reshape(n, num_heads)
        lse_s = lse[idx]
        total = torch.logaddexp(lse_p, lse_s)
        merged = (o_p * torch.exp(lse_p - total)[..., None]
                  + out.index_select(0, idx).to(sdt) * torch.exp(lse_s - total)[..., None])
        out.index_copy_(0, idx, merged.to(out.dtype))
