"""Step plans of the fast CPU attention backend (:mod:`llmd.kernels.cpu_attention`): what each
query of a step reads, worked out once per step and KV cache group.

* **One plan per step per KV cache group** (:class:`StepPlan`, cached on the group's
  :class:`AttentionMetadata`, so the 30 layers of a group share it): the gather indices of every
  key a query may see, the additive mask (0 / -inf) and which query rows are decodes. A
  sliding-window group's plan reads only the window ``[p - W + 1, p]`` of each query.
* **Head-major gather.** One layer's cache data ``[2, num_blocks, block_size, kv_heads,
  head_dim]`` viewed as rows ``[num_blocks * block_size * kv_heads, head_dim]``: the row of
  (slot ``s``, KV head ``h``) is ``s * kv_heads + h``. ``index_select`` on dim 0 with indices
  laid out ``[B, kv_heads, L]`` gives K (and V) already shaped ``[B * kv_heads, L, head_dim]``
  for a batched matmul, in one contiguous copy (no ``repeat_interleave``, no permute copies).
  int8/fp8 caches gather codes (1 byte each) and their float32 scales ``[B * kv_heads, L]`` with
  the same indices; ``code × scale`` is applied as scores × k_scale and probabilities × v_scale
  (the Triton kernels' order), so no pass over dequantized K/V is needed. Grouped scales
  (``--kv-scale-group-size``: one per 32 or 64 channels) cannot fold into a score, so those
  gathers dequantize their codes in place (``code × scale`` in the compute dtype). int4 caches (KIVI K
  per block and channel, a 16-bit residual for the open block) take the branch in
  :mod:`llmd.kernels.cpu_int4` with the same plans.
* **Decode length buckets** (:func:`length_buckets`) for the decodes the C kernel does not
  serve, and one batched gather for the prefill chunks of cascades (:func:`_chunk_tails`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmd.kernels import cpu_cascade, cpu_native
from llmd.kernels.metadata import AttentionMetadata, workspace_buffer


@dataclass
class Gather:
    """Rows to gather for ``N`` sequences over ``L`` key positions each.

    Attributes:
        rows: ``[N * kv_heads * L]`` int64 row ids into the ``[slots * kv_heads, head_dim]`` view,
            ordered (sequence, KV head, key position).
        bias: ``[N, 1, Q, L]`` float32 additive mask: 0 where the query at row ``q`` sees key
            ``l``, -inf elsewhere (keys past the sequence, before the window, after the query).
        group: query heads per KV head; ``kv_heads``: KV heads.
    """

    rows: torch.Tensor
    bias: torch.Tensor
    group: int
    kv_heads: int
    _scores_bias: dict = field(default_factory=dict, repr=False)

    def scores_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask laid out like the scores, ``[N * kv_heads, group * Q, L]`` in ``dtype``
        (built once per step, so ``baddbmm`` adds it inside the matmul)."""
        b = self._scores_bias.get(dtype)
        if b is None:
            n, _, q, length = self.bias.shape
            b = self.bias[:, :, None].expand(n, self.kv_heads, self.group, q, length)
            b = b.reshape(n * self.kv_heads, self.group * q, length)
            b = self._scores_bias[dtype] = b.to(dtype)
        return b


@dataclass
class StepPlan:
    """Gather/mask plan of one step for one KV cache group and sliding window.

    Attributes:
        decode_idx: ``[Bd]`` int64 flat token indices of the decode queries (query length 1),
            or None when the step has none.
        decode_only: every query of the step is a decode (then ``decode_idx`` is ``0..T-1``).
        decodes: the decodes' length buckets (:func:`length_buckets`), ``(members, gather)``
            each: ``members`` ``[n]`` int64 positions in ``decode_idx`` (None for a single bucket
            of all decodes in order), ``gather`` with ``Q = 1`` padded to the bucket's longest.
        prefills: ``(token_start, query_len, gather)`` per prefill chunk, ``gather`` with ``N = 1``.
        cascades: decodes and prefill chunks sharing leading blocks (:mod:`llmd.kernels.cpu_cascade`):
            their buckets and chunk gathers start after the shared prefix, which each group attends
            to once; ``chunk_tails`` the prefill chunks among them, their own keys in one
            batched gather (:func:`_chunk_tails`), else None (they are then not in ``prefills``).
        native: the decodes for the C kernel (:mod:`llmd.kernels.cpu_native`), which then serves
            them all (``decodes`` is empty), or None.
        workspace: output buffers of the gathers, matmuls and softmax, keyed by (role, shape,
            dtype), reused by every layer of the group in this step. Fresh multi-MB tensors per
            layer cost more in first-touch page faults than the gathers themselves (measured
            here: 1.0-1.5 ms vs 0.3 ms for a 6 MiB bfloat16 K gather).
    """

    decode_idx: torch.Tensor | None
    decodes: list[tuple[torch.Tensor | None, Gather]]
    prefills: list[tuple[int, int, Gather]]
    decode_only: bool = False
    cascades: list = field(default_factory=list)
    chunk_tails: tuple | None = None
    native: cpu_native.Decodes | None = None
    workspace: dict = field(default_factory=dict, repr=False)

    def buffer(self, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape``/``dtype`` for ``role``, the same one every layer."""
        return workspace_buffer(self.workspace, role, shape, dtype)


def key_rows(block_tables: torch.Tensor, first_pos: torch.Tensor, length: int, block_size: int,
              kv_heads: int) -> torch.Tensor:
    """Row ids ``[N * kv_heads * length]`` of keys at positions ``first_pos[n] + j``
    (``j < length``), through ``block_tables [N, max_blocks]`` int32. Positions past a table's
    end read the null block (they are masked)."""
    pos = first_pos[:, None] + torch.arange(length, dtype=torch.int64)[None, :]
    blk = torch.clamp(pos // block_size, max=block_tables.shape[1] - 1)
    slots = block_tables.long().gather(1, blk) * block_size + pos % block_size  # [N, L]
    heads = torch.arange(kv_heads, dtype=torch.int64)
    return (slots[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)


def build_plan(meta: AttentionMetadata, kv_heads: int, sliding_window: int | None, group: int = 1,
               cascade_ok: bool = True, native: bool = False) -> StepPlan:
    """The step's :class:`StepPlan` (index math on the host, vector ops only per group of
    sequences; one Python iteration per prefill chunk). ``cascade_ok``: look for sequences
    (decodes and prefill chunks) sharing a prefix (not for int4 caches, whose branch has no cascade).
    ``native``: the decodes go to the C kernel (no buckets, no gathers, no masks)."""
    qlens = torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
    seq_lens = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64)
    starts = torch.cumsum(qlens, 0) - qlens
    tables = meta.block_tables.cpu()
    bs = meta.block_size
    is_dec = qlens == 1
    decode_idx, decodes, cascades, native_decodes = None, [], [], None
    skip = torch.zeros_like(qlens)  # keys a sequence's own gather skips: its cascade's shared prefix
    if sliding_window is None and cascade_ok and len(qlens) >= cpu_cascade.CASCADE_MIN_SEQS:
        # the shared prefix must end at or before each member's first query (all of it visible)
        cascades = cpu_cascade.find_cascades(tables, seq_lens - qlens + 1, bs, kv_heads, key_rows)
        for c in cascades:
            skip[c.members] = c.prefix_len
            c.tokens = cpu_cascade.query_tokens(starts[c.members], qlens[c.members])
    if bool(is_dec.any()):
        sel = torch.nonzero(is_dec).flatten()
        lens = seq_lens[sel]
        first = skip[sel] if sliding_window is None else torch.clamp(lens - sliding_window, min=0)
        span = lens - first
        decode_idx = starts[sel]
    if decode_idx is not None and native:
        native_decodes = cpu_native.Decodes(decode_idx, sel, first, lens, tables.contiguous())
    elif decode_idx is not None:
        order = torch.argsort(span, descending=True, stable=True)
        buckets = length_buckets(span[order].tolist())
        for lo, hi in buckets:
            b = order[lo:hi] if len(buckets) > 1 else torch.arange(len(sel))
            length = int(span[b].max())
            pos = first[b, None] + torch.arange(length)[None, :]
            bias = torch.zeros(len(b), 1, 1, length).masked_fill_((pos >= lens[b, None])[:, None, None, :],
                                                                  float("-inf"))
            g = Gather(key_rows(tables[sel[b]], first[b], length, bs, kv_heads), bias, group, kv_heads)
            decodes.append((b if len(buckets) > 1 else None, g))
    prefills = []
    chunks = torch.nonzero(~is_dec).flatten()
    members = chunks[skip[chunks] > 0]  # prefill chunks in a cascade: their tails batched together
    chunk_tails = _chunk_tails(members, starts, qlens, seq_lens, skip, tables, bs, kv_heads, group) \
        if len(members) else None
    for b in chunks[skip[chunks] == 0].tolist():
        q_len, seq_len = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
        first = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)
        kpos = torch.arange(first, seq_len)[None, :]
        qpos = torch.arange(seq_len - q_len, seq_len)[:, None]
        visible = kpos <= qpos
        if sliding_window is not None:
            visible &= kpos > qpos - sliding_window
        bias = torch.zeros(q_len, seq_len - first).masked_fill_(~visible, float("-inf"))[None, None]
        rows = key_rows(tables[b : b + 1], torch.tensor([first]), seq_len - first, bs, kv_heads)
        prefills.append((int(starts[b]), q_len, Gather(rows, bias, group, kv_heads)))
    return StepPlan(decode_idx, decodes, prefills, decode_only=not prefills and chunk_tails is None,
                    cascades=cascades, chunk_tails=chunk_tails, native=native_decodes)


def _chunk_tails(members: torch.Tensor, starts: torch.Tensor, qlens: torch.Tensor, seq_lens: torch.Tensor,
                 skip: torch.Tensor, tables: torch.Tensor, bs: int, kv_heads: int, group: int):
    """One batched gather for the prefill chunks of cascades: each member's keys after its shared
    prefix, ``[skip, seq_len)``, padded to the longest such tail ``Lt``, and its queries padded to
    the longest chunk ``Qm`` (a padded row repeats the chunk's last query; its output is dropped).

    Returns:
        ``(tokens [N, Qm] int64 flat query indices, valid [N, Qm] bool, gather)`` with the gather's
        bias ``[N, 1, Qm, Lt]``: key ``l`` visible to query row ``i`` iff its position is at most
        the query's (causal; the prefix before ``skip`` is the cascade's, all visible).
    """
    ql, first = qlens[members], skip[members]
    ctx = seq_lens[members] - ql
    qm, lt = int(ql.max()), int((seq_lens[members] - first).max())
    qi = torch.minimum(torch.arange(qm)[None, :], ql[:, None] - 1)  # [N, Qm]
    kpos = first[:, None, None] + torch.arange(lt)[None, None, :]
    visible = kpos <= (ctx[:, None] + qi)[:, :, None]  # [N, Qm, Lt]; also keeps keys below seq_len
    bias = torch.zeros(len(members), 1, qm, lt).masked_fill_(~visible[:, None], float("-inf"))
    rows = key_rows(tables[members], first, lt, bs, kv_heads)
    return starts[members][:, None] + qi, torch.arange(qm)[None, :] < ql[:, None], Gather(rows, bias, group, kv_heads)


# Decode length buckets (length_buckets): a new bucket below 0.7 x its first span, >= 8 sequences each, 4 at most
BUCKET_RATIO, BUCKET_MIN, BUCKET_MAX = 0.7, 8, 4

def length_buckets(spans: list[int], ratio: float = BUCKET_RATIO, min_size: int = BUCKET_MIN,
                   max_buckets: int = BUCKET_MAX) -> list[tuple[int, int]]:
    """Split decode key spans sorted longest first into ``[lo, hi)`` buckets, each padded to its
    own first (longest) span instead of the step's.

    A bucket closes before the first span shorter than ``ratio`` × its longest, once it holds
    ``min_size`` sequences (fewer would not repay a gather and two matmuls per layer); the
    last of ``max_buckets`` takes the rest. Cost model: gathered and multiplied key rows
    ``sum(size × longest)``; on the mixed workload (contexts 32..512) one bucket pads about
    half of them. Returns ``[(0, len(spans))]`` when one bucket is all there is.
    """
    out, lo = [], 0
    for i in range(1, len(spans)):
        if len(out) == max_buckets - 1:
            break
        if spans[i] < ratio * spans[lo] and i - lo >= min_size and len(spans) - i >= min_size:
            out.append((lo, i))
            lo = i
    return out + [(lo, len(spans))]


def get_plan(meta: AttentionMetadata, kv_heads: int, sliding_window: int | None, group: int = 1,
             cascade_ok: bool = True, native: bool = False) -> StepPlan:
    """The plan cached on ``meta`` (built by the group's first layer, reused by the others)."""
    key = ("cpu", kv_heads, sliding_window, group, cascade_ok, native)
    plan = meta.plans.get(key)
    if plan is None:
        plan = meta.plans[key] = build_plan(meta, kv_heads, sliding_window, group, cascade_ok, native)
    return plan
