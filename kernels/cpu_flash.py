"""Attention on the CPU through torch's flash kernel with no mask tensor: float32 prefill chunks
(:func:`chunk_attention`) and a bfloat16 cascade's shared prefix (:func:`prefix_attention`), for
the cpu backend (:mod:`llmd.kernels.cpu_attention`, which says why bfloat16 chunks stay off it).

torch's CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``: blocked, online
softmax, its log-sum-exp returned; GQA when the key heads divide the query heads) aligns
``is_causal`` top-left, while a chunk after a cached prefix needs it bottom-right. An explicit
``[heads, Q, L]`` mask makes the kernel read it and score every block; split at the prefix
instead, each half runs on a fast path and the halves merge exactly as two cascade levels do
(:mod:`llmd.kernels.cpu_cascade`; FlashAttention's split-KV merge, Dao et al. 2023, "Flash-Decoding").
"""

from __future__ import annotations

import torch


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One prefill chunk's attention by torch's CPU flash kernel, without a mask tensor (the cpu
    backend sends float32 chunks over unscaled K/V, no sliding window, at least ``FLASH_MIN_ROWS``
    query rows; the gather's keys are positions ``0 .. L - 1`` in order).

    ``q [Q, heads, D]`` (the chunk's queries, positions ``L - Q .. L - 1``), ``k``/``v``
    ``[kv_heads, L, D]`` (positions ``0 .. L - 1``), same dtype (bfloat16 or float32; GQA by the
    kernel itself). The flash kernel's ``is_causal`` aligns the mask top-left (query ``i`` sees
    keys ``<= i``), so the chunk's own keys ``[L - Q, L)`` run causally in one call and the cached
    prefix ``[0, L - Q)``, which every query sees whole, in another without a mask; the two are
    merged by their log-sum-exps (``o = Σ o_i e^{lse_i - m} / Σ e^{lse_i - m}``, float32), the
    cascade merge of :mod:`llmd.kernels.cpu_cascade`. Returns ``[Q, heads, D]`` in q's dtype.
    """
    ql, length = q.shape[0], k.shape[1]
    c = length - ql
    qh = q.transpose(0, 1)[None]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o2, lse2 = flash(qh, k[None, :, c:], v[None, :, c:], 0.0, True, scale=scale)[:2]
    if c == 0:
        return o2[0].transpose(0, 1)
    o1, lse1 = flash(qh, k[None, :, :c], v[None, :, :c], 0.0, False, scale=scale)[:2]
    m = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - m).exp_(), (lse2 - m).exp_()
    total = w1 + w2
    o = o1.float().mul_((w1 / total)[..., None]).add_(o2.float().mul_((w2 / total)[..., None]))
    return o[0].transpose(0, 1).to(q.dtype)


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """Stacked queries over keys every one of them sees whole (a cascade's shared prefix,
    :mod:`llmd.kernels.cpu_cascade`) by the flash kernel, no mask: ``q [rows, gq, D]``, ``k``/``v``
    ``[rows, L, D]`` alike (bfloat16 or float32). Returns ``(out [rows, gq, D]`` in q's dtype,
    ``lse [rows, gq]`` float32). Measured on the 2-core AMX Xeon (2026-12-07, SmolLM2 bfloat16,
    the peers' shared-prefix workload, fresh daemons alternated with ``LLMD_FLASH_CHUNKS=0``):
    323 / 302 output tok/s and TTFT p50 983 / 1,143 ms, against 291 / 279 and 1,091 / 1,208 ms
    with the scores kernel + softmax + ``bmm``."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], k[None], v[None], 0.0, False,
                                                                          scale=scale)[:2]
    return o[0], lse[0]
