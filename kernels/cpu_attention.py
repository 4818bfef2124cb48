"""The fast CPU attention backend (``--attention-backend cpu``, the CPU default).

Same semantics as :mod:`llmd.kernels.reference` (the oracle), batched over the step instead of
looped per sequence:

* **One plan per step per KV cache group** (:mod:`llmd.kernels.cpu_plan`: the gather rows of
  every key a query may see, the masks, which rows are decodes; head-major gathers), shared by
  the group's layers.
* **Decodes in the C kernel** (:mod:`llmd.kernels.cpu_native`) when it is built and serves the
  cache's format and shape (``meta.native_kernels``, default on; ``--disable-native-kernels``):
  it reads each decode's K/V in place through the block table, so the plan only lists the
  decodes (no gather rows, no masks, no buckets). Otherwise, and for what it does not serve:
* **Decodes batched together** (in up to 4 length buckets, so short contexts are not padded to
  the step's longest): the query ``[B, heads, head_dim]`` viewed as ``[B * kv_heads,
  group, head_dim]`` (GQA without copies of K/V), scores ``[B * kv_heads, group, L]``, keys past
  each sequence's length masked with -inf (exact zeros after softmax). Padding every sequence to
  the step's longest context is the one difference from the reference: the reduction order of
  the softmax sum and of ``probs @ V`` can change with what else is batched (case S4; measured
  and documented in the README).
* **Prefill chunks** attend to their cached prefix plus causally to themselves (store-then-read:
  the layer stored the chunk's K/V before calling this), one sequence at a time (a step holds a
  few chunks at most under the token budget), with the same gather and a ``[Q, L]`` mask. In
  float32 over unscaled K/V (``auto``, ``float16``, ``bfloat16`` caches) a chunk of at least
  ``FLASH_MIN_ROWS`` query rows per KV head runs torch's CPU flash attention (:func:`_attend`):
  blocked, online softmax, no ``[heads, Q, L]`` scores written out and read back three times.
  Measured on the 2-core Zen 3 (2026-12-06, 9 query / 3 KV heads, head_dim 64, one layer): a
  512-token chunk over 1,024 keys 12.1 ms vs 39.7 for baddbmm + softmax + bmm, 512 over 512 6.1 vs
  9.1, 216 over 1,100 5.7 vs 9.5, 64 over 300 0.54 vs 0.70; outputs within 5e-7 of them.
  float32 chunks over unscaled caches without a sliding window go to the flash kernel without
  any mask (:func:`llmd.kernels.cpu_flash.chunk_attention`): the chunk's own keys with its
  ``is_causal``, the cached prefix unmasked, merged by log-sum-exp; no ``[heads, Q, L]`` mask is
  built or read. bfloat16 chunks keep the scores kernel: through torch's bfloat16 flash kernel a
  512-token prompt took 147–154 ms instead of 188–194 (2-core AMX Xeon, 2026-12-07), but the
  bfloat16 quality gate (``tests/core/test_bf16_quality.py``: ΔNLL vs float32 ≤ 0.1 %) moved from
  +0.007 % to +0.114 % (+0.080 % with only first chunks on it, +0.072 % with the same flash in
  float32), though on random caches its error against float64 was the smaller one (2.0–2.1e-3 vs
  2.2–2.3e-3 relative): the gate's ΔNLL moves by that much with where the bfloat16 roundings fall.

Compute dtype: float32 for float32 (and float16) models, float64 for float64 models, bfloat16
for bfloat16 models except the scores, which are float32: by VDPBF16PS on the bfloat16 q and K
where the CPU has AVX512-BF16 (:mod:`llmd.kernels.cpu_scores`), else K is gathered into float32
and ``q·K`` runs in float32
(a bfloat16 score, rounded to 8 bits before the softmax, cost the kv-quality text's teacher-forced
ΔNLL vs float32 +0.128 % instead of +0.060 %: measured 2026-12-02, SmolLM2, chunks of 64), the
softmax in float32, probabilities cast to bfloat16 for ``probs @ V`` (oneDNN's bfloat16 matmul),
except decode-only steps of at most ``SMALL_DECODE`` sequences, which compute in float32.
A step of exactly one decode over an unquantized cache (batch-1 chat) takes
:mod:`llmd.kernels.cpu_decode_one` instead (a by-block gather, no mask; same numerics).
The gather of K/V through a plan's rows, the compute dtype and the scores are in
:mod:`llmd.kernels.cpu_gather` (re-exported here).
"""

from __future__ import annotations

import os

import torch

from llmd.kernels import cpu_cascade, cpu_decode_one, cpu_native, cpu_scores
from llmd.kernels.cpu_flash import chunk_attention as _flash_chunk
from llmd.kernels.cpu_flash import prefix_attention as _flash_prefix
from llmd.kernels.cpu_gather import (  # noqa: F401 (re-exported: bf16_keys, the gather and the scores)
    _gather_kv,
    _kernel_mask,
    _scores,
    bf16_keys,
    compute_dtype_for,
)
from llmd.kernels.cpu_plan import Gather, StepPlan, get_plan
from llmd.kernels.metadata import AttentionMetadata
from llmd.quant.kv import PagedKVCache, planes_contiguous

# LLMD_FLASH_CHUNKS=0: float32 prefill chunks and bfloat16 cascade prefixes keep the gathered-scores path
# (_attend): the A/B switch of kernels/cpu_flash.py
_FLASH_CHUNKS = os.environ.get("LLMD_FLASH_CHUNKS", "1") != "0"
FLASH_MIN_ROWS = 16  # query rows per KV head from which float32 attention takes torch's flash kernel (_attend)


# Decode-only steps of at most this many sequences compute in float32 even in a bfloat16 model:
# at these sizes the batched matmuls are call overhead, and oneDNN's bfloat16 path costs more per
# call (measured: scores of 3 KV heads x 3 queries over 512 keys 38.6 µs in bfloat16 vs 21.0 in
# float32; probs @ V 24.4 vs 19.0), while the K/V conversion is a few µs.
SMALL_DECODE = 4


def decode_call(meta: AttentionMetadata, cache: torch.Tensor | PagedKVCache, num_heads: int, dtype: torch.dtype,
                scale: float, sliding_window: int | None = None) -> cpu_native.DecodeCall | None:
    """For a step :func:`paged_attention` would send whole to the C decode kernel in one call per
    layer (decodes only, no cascade, the kernel serving ``cache``): that call bound to the step
    once (:class:`~llmd.kernels.cpu_native.DecodeCall`, cached on ``meta.plans`` for every layer
    of the group), else None. ``dtype``: the query's."""
    key = ("cpu-call", num_heads, dtype, scale, sliding_window)
    if key in meta.plans:
        return meta.plans[key]
    cache = PagedKVCache.wrap(cache)
    kv_heads, cdt = cache.data.shape[3], compute_dtype_for(dtype)
    group, call = num_heads // kv_heads, None
    if meta.native_kernels and not cache.fmt.k_per_block and cpu_native.supports(cache, cdt, group) \
            and (cache.scales is None or planes_contiguous(cache.scales)):
        plan = get_plan(meta, kv_heads, sliding_window, group, cascade_ok=meta.cascade_attn, native=True)
        if plan.native is not None and plan.decode_only and not plan.cascades:
            call = cpu_native.DecodeCall(cache, plan.native, num_heads, scale, cdt)
    meta.plans[key] = call
    return call



def _attend(plan: StepPlan, role: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Gather | None,
            scale: float, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None, with_lse: bool = False):
    """``softmax(scale · q (k·ks)^T + bias) (v·vs)`` per (sequence, KV head).

    With bfloat16 K and V and no scales (an ``auto`` cache of a bfloat16 model, where
    :mod:`llmd.kernels.cpu_scores` is available) scores, mask and softmax are one C call
    (:func:`llmd.kernels.cpu_scores.probs`: the float32 scores stay in a few rows of scratch,
    the bfloat16 probabilities come out), then ``probs @ V``. Otherwise the scale and the mask
    ride in one ``baddbmm`` (or the :func:`llmd.kernels.cpu_scores.scores` call: :func:`_scores`);
    ``× ks`` after it leaves the mask as it is
    (0 · s = 0, -inf · s = -inf for s > 0; gathered K scales are clamped to ``SCALE_FLOOR`` so
    masked, never-written slots cannot give -inf · 0). The softmax upcasts bfloat16 scores to float32.
    The log-sum-exp, when asked for, comes from the softmax itself: ``lse = max(s) - log(max(p))``
    (the largest probability is ``exp(max(s) - lse)``), two small reductions instead of a second
    pass of exponentials over the scores. The scores are float32 for a bfloat16 model (K
    bfloat16 through :mod:`llmd.kernels.cpu_scores`, or K float32 and ``q`` converted:
    :func:`_gather_kv`), else in the compute dtype.

    bfloat16 ``q``, K and V without scales or a mask (a cascade's shared prefix) and at least
    ``FLASH_MIN_ROWS`` query rows per KV head take the flash kernel too
    (:func:`llmd.kernels.cpu_flash.prefix_attention`).
    float32 ``q``, K and V without scales and at least ``FLASH_MIN_ROWS`` query rows per KV head
    (prefill chunks, a cascade's stacked queries over its shared prefix) take torch's CPU flash
    attention instead (``aten._scaled_dot_product_flash_attention_for_cpu``: blocked, online
    softmax, its log-sum-exp returned): no ``[rows, group · Q, L]`` scores written and read back.
    Measured on the Zen 3 (2026-12-06): a cascade prefix of 3 KV heads × 1,536 stacked query rows
    over 1,008 keys 10.7–11.3 ms vs 19.3 for baddbmm + amax + softmax + bmm; within 7e-7 of float64.

    Args:
        q: ``[N * kv_heads, group * Q, head_dim]`` unscaled queries, compute dtype.
        k, v: ``[N * kv_heads, L, head_dim]`` compute dtype (K float32 for bfloat16 unless
            :func:`bf16_keys`; codes for int8/fp8).
        g: the gather (its mask, laid out like the scores), or None when every query sees every
            key (a cascade's shared prefix).
        k_scales, v_scales: ``[N * kv_heads, 1, L]`` float32/float64 or None.
        with_lse: also return the scores' log-sum-exp (for :mod:`llmd.kernels.cpu_cascade`).
    Returns:
        ``[N * kv_heads, group * Q, head_dim]`` in the compute dtype (a new tensor); with
        ``with_lse`` the pair ``(out, lse [N * kv_heads, group * Q] float32/float64)``.
    """
    rows, gq, length = q.shape[0], q.shape[1], k.shape[1]
    if k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16 and k_scales is None and v_scales is None:
        if _FLASH_CHUNKS and g is None and gq >= FLASH_MIN_ROWS and q.dtype == torch.bfloat16:  # a cascade's prefix
            o, lse = _flash_prefix(q, k, v, scale)
            return (o, lse) if with_lse else o
        probs = plan.buffer(role + "p16", (rows, gq, length), torch.bfloat16)
        lse = torch.empty(rows, gq) if with_lse else None
        bias, div = _kernel_mask(g)
        if cpu_scores.probs(q.to(torch.bfloat16), k, scale, bias, probs, div, lse):
            return (torch.bmm(probs, v), lse) if with_lse else torch.bmm(probs, v)
    flash = q.dtype == k.dtype == v.dtype == torch.float32 and gq >= FLASH_MIN_ROWS
    if flash and k_scales is None and v_scales is None:
        mask = None if g is None else g.scores_bias(torch.float32)[None]  # torch's flash attention, with its lse
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, False, attn_mask=mask, scale=scale)[:2]
        return (o[0], lse[0]) if with_lse else o[0]
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = _scores(plan, role, q, k, g, scale, rows, gq, length)
    if k_scales is not None:
        scores.mul_(k_scales)
    top = scores.amax(-1) if with_lse else None
    probs = torch.softmax(scores, dim=-1, dtype=sdt, out=plan.buffer(role + "p", (rows, gq, length), sdt))
    lse = top.to(sdt) - torch.log(probs.amax(-1)) if with_lse else None
    if v_scales is not None:
        probs.mul_(v_scales)
    if probs.dtype != v.dtype:
        probs = plan.buffer(role + "p16", (rows, gq, length), v.dtype).copy_(probs)
    return (torch.bmm(probs, v), lse) if with_lse else torch.bmm(probs, v)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor | PagedKVCache, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, tails: list | None = None) -> torch.Tensor:
    """Attention for a mixed batch of prefill chunks and decodes over the paged cache.

    Args:
        query: ``[T, num_heads, head_dim]`` (T = total query tokens of the step).
        kv_cache: :class:`PagedKVCache` or an ``auto`` data tensor ``[2, blocks, block_size,
            kv_heads, head_dim]``; the step's own K/V already stored.
        meta: the group's :class:`AttentionMetadata` (its ``plans`` cache the step plan).
        scale: softmax scale.
        sliding_window: ``W`` or None; query ``p`` sees keys ``[p - W + 1, p]``.
        tails: int4 only, the chunks' exact K (:func:`llmd.kernels.kivi.store_keys`).
    Returns:
        ``[T, num_heads, head_dim]`` in ``query.dtype``.
    """
    if not (isinstance(kv_cache, PagedKVCache) and kv_cache.fmt.k_per_block):
        call = decode_call(meta, kv_cache, query.shape[1], query.dtype, scale, sliding_window)
        if call is not None:  # decodes only, every one in the C kernel: the call bound by the group's first layer
            return call(query.to(call.cdt), kv_cache).to(query.dtype)
    cache = PagedKVCache.wrap(kv_cache)
    t, num_heads, head_dim = query.shape
    kv_heads = cache.data.shape[3]
    group = num_heads // kv_heads
    cdt = compute_dtype_for(query.dtype)
    native = meta.native_kernels and cpu_native.supports(cache, cdt, group)
    # one decode of an auto cache: by-block gather, no mask
    if not native and cpu_decode_one.applies(meta, cache.fmt.dtype is not None):
        return cpu_decode_one.paged_attention(query, cache.data, meta, scale, sliding_window,
                                              torch.float32 if cdt == torch.bfloat16 else cdt)
    plan = get_plan(meta, kv_heads, sliding_window, group, cascade_ok=meta.cascade_attn and not cache.fmt.k_per_block,
                    native=native)
    if plan.decode_only and t <= SMALL_DECODE and cdt == torch.bfloat16:
        cdt = torch.float32  # tiny matmuls: float32's ~15 µs beats bfloat16's ~35 µs per call here
    if cache.fmt.k_per_block:  # int4 (KIVI): kernels/cpu_int4.py
        from llmd.kernels import cpu_int4

        return cpu_int4.paged_attention(query, cache, meta, scale, sliding_window, tails, plan, cdt).to(query.dtype)
    q = query.to(cdt)
    if plan.decode_only and len(plan.decodes) == 1 and not plan.cascades:  # the common CPU step: no index maps
        g = plan.decodes[0][1]
        k, v, ks, vs = _gather_kv(plan, "d", cache, g.rows, g.bias.shape[-1], cdt)
        o = _attend(plan, "d", q.reshape(t * kv_heads, group, head_dim), k, v, g, scale, ks, vs)
        return o.view(t, num_heads, head_dim).to(query.dtype)
    out = torch.empty(t, num_heads, head_dim, dtype=cdt)
    lse = None
    if plan.cascades:  # per query token in a cascade, the log-sum-exp of its own keys after the shared prefix
        lse = torch.empty(t, num_heads, dtype=torch.float64 if cdt == torch.float64 else torch.float32)
    if plan.native is not None:
        cpu_native.decode(q, cache, plan.native, scale, out, lse)
    for i, (members, g) in enumerate(plan.decodes):
        idx = plan.decode_idx if members is None else plan.decode_idx[members]
        nd = idx.shape[0]
        if g.bias.shape[-1] == 0:  # a bucket of padded rows only (seq_len 0, a padded CUDA-graph step): no key
            out.index_fill_(0, idx, 0.0)
            continue
        k, v, ks, vs = _gather_kv(plan, f"d{i}", cache, g.rows, g.bias.shape[-1], cdt)
        qd = q.index_select(0, idx).view(nd * kv_heads, group, head_dim)
        o = _attend(plan, f"d{i}", qd, k, v, g, scale, ks, vs, with_lse=lse is not None)
        if lse is not None:
            o, part = o
            lse[idx] = part.view(nd, num_heads)
        out.index_copy_(0, idx, o.view(nd, num_heads, head_dim))
    if plan.chunk_tails is not None:  # cascades' prefill chunks, over their own keys after the prefix
        tok, valid, g = plan.chunk_tails
        n, qm = tok.shape
        k, v, ks, vs = _gather_kv(plan, "t", cache, g.rows, g.bias.shape[-1], cdt)
        qt = q.index_select(0, tok.view(-1)).view(n, qm, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        o, part = _attend(plan, "t", qt.reshape(n * kv_heads, group * qm, head_dim), k, v, g, scale, ks, vs,
                          with_lse=True)
        idx = tok[valid]
        out.index_copy_(0, idx, o.view(n, kv_heads, group, qm, head_dim).permute(0, 3, 1, 2, 4)[valid].reshape(
            -1, num_heads, head_dim))
        lse[idx] = part.view(n, kv_heads, group, qm).permute(0, 3, 1, 2)[valid].reshape(-1, num_heads)
    for start, q_len, g in plan.prefills:
        k, v, ks, vs = _gather_kv(plan, "p", cache, g.rows, g.bias.shape[-1], cdt)
        if _FLASH_CHUNKS and sliding_window is None and ks is None and vs is None and q_len >= FLASH_MIN_ROWS \
                and q.dtype == k.dtype == v.dtype == torch.float32:
            out[start : start + q_len] = _flash_chunk(q[start : start + q_len], k, v, scale)
            continue
        qp = q[start : start + q_len].reshape(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        o = _attend(plan, "p", qp.reshape(kv_heads, group * q_len, head_dim), k, v, g, scale, ks, vs)
        out[start : start + q_len] = o.view(kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(
            q_len, num_heads, head_dim)
    if lse is not None:
        cpu_cascade.merge_prefixes(plan, q, cache, out, lse, scale, _gather_kv, _attend)
    return out.to(query.dtype)
