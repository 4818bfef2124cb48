"""The cpu backend's path for a step of one decode over an unquantized cache (batch-1 chat).

:mod:`llmd.kernels.cpu_attention` gathers K/V head-major row by row (one 128-byte row per
(slot, KV head) at head_dim 64) into a workspace, converts it to the compute dtype in a second
pass, and masks with an additive bias. One sequence needs none of that: its keys are the blocks
of one block table, all visible. This path gathers them **by block** (``index_select`` on the
blocks dim: K and V of every block in one call, ``block_size · kv_heads · head_dim`` contiguous
elements per block), then one copy that slices the sequence's span, permutes to head-major
``[2, kv_heads, L, head_dim]`` and converts to the compute dtype, then ``baddbmm`` with
``beta=0`` (the scale and no mask), softmax, ``bmm``.

Same numerics as the general path (the same K/V values in the same layout, the same matmuls
and softmax in the same compute dtype; the general path's bias is 0 here): tested equal to
it and to the float64 reference (``tests/kernels/test_cpu_decode_one.py``).
Measured (SmolLM2 shapes, 30 layers' caches in rotation, context 600, one thread, thread CPU
time): 164 µs per layer vs 191 µs for the general path; 7 kernels instead of 9.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmd.kernels.metadata import AttentionMetadata, workspace_buffer


@dataclass
class OneDecodePlan:
    """Where one decode's keys are, for every layer of its KV cache group in this step.

    Attributes:
        block_ids: ``[nb]`` int64 ids of the blocks holding keys ``first .. seq_len - 1``.
        offset: position of key ``first`` inside the first of them (tokens).
        span: keys attended (``seq_len - first``; ``first`` > 0 only under a sliding window).
        workspace: the gathers' and matmuls' output buffers, shared by the group's layers.
    """

    block_ids: torch.Tensor
    offset: int
    span: int
    workspace: dict = field(default_factory=dict, repr=False)

    def buffer(self, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape``/``dtype`` for ``role``, the same one every layer."""
        return workspace_buffer(self.workspace, role, shape, dtype)


def get_plan(meta: AttentionMetadata, sliding_window: int | None) -> OneDecodePlan:
    """The plan cached on ``meta`` (a step of exactly one sequence with one query token whose
    ``seq_lens_cpu[0] > 0``); built by the group's first layer."""
    key = ("cpu-one", sliding_window)
    plan = meta.plans.get(key)
    if plan is None:
        seq_len, bs = meta.seq_lens_cpu[0], meta.block_size
        first = 0 if sliding_window is None else max(0, seq_len - sliding_window)
        b0, b1 = first // bs, (seq_len - 1) // bs
        ids = meta.block_tables[0, b0 : b1 + 1].to(device="cpu", dtype=torch.int64)
        plan = meta.plans[key] = OneDecodePlan(ids, first - b0 * bs, seq_len - first)
    return plan


def applies(meta: AttentionMetadata, quantized: bool) -> bool:
    """This path serves the step: one sequence, one query token, a non-empty context, an
    unquantized (``auto``) cache."""
    return not quantized and len(meta.query_lens_cpu) == 1 and meta.query_lens_cpu[0] == 1 \
        and meta.seq_lens_cpu[0] > 0


def paged_attention(query: torch.Tensor, data: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None, cdt: torch.dtype) -> torch.Tensor:
    """Attention of one decode query over its sequence's cached keys (see the module docstring).

    Args:
        query: ``[1, num_heads, head_dim]``; head ``j`` reads KV head ``j // (num_heads // kv_heads)``.
        data: the layer's cache data ``[2, num_blocks, block_size, kv_heads, head_dim]`` (``auto``).
        meta: the step's metadata (:func:`applies` holds).
        scale: softmax scale; ``sliding_window``: ``W`` or None (keys ``[p - W + 1, p]``).
        cdt: compute dtype (float32 for float32 / float16 models and small bfloat16 decodes,
            bfloat16 or float64 for those models).
    Returns:
        ``[1, num_heads, head_dim]`` in ``query.dtype``.
    """
    plan = get_plan(meta, sliding_window)
    _, _, bs, kv_heads, head_dim = data.shape
    num_heads = query.shape[1]
    nb, span = plan.block_ids.shape[0], plan.span
    blocks = torch.index_select(data, 1, plan.block_ids, out=plan.buffer("blk", (2, nb, bs, kv_heads, head_dim),
                                                                         data.dtype))
    keys = blocks.view(2, nb * bs, kv_heads, head_dim)[:, plan.offset : plan.offset + span].permute(0, 2, 1, 3)
    kv = plan.buffer("kv", (2, kv_heads, span, head_dim), cdt).copy_(keys)
    q = query.to(cdt).view(kv_heads, num_heads // kv_heads, head_dim)
    scores = plan.buffer("s", (kv_heads, q.shape[1], span), cdt)
    torch.baddbmm(scores, q, kv[0].transpose(1, 2), beta=0, alpha=scale, out=scores)
    sdt = torch.float64 if cdt == torch.float64 else torch.float32
    probs = torch.softmax(scores, dim=-1, dtype=sdt, out=plan.buffer("p", scores.shape, sdt))
    if probs.dtype != cdt:
        probs = plan.buffer("p16", scores.shape, cdt).copy_(probs)
    return torch.bmm(probs, kv[1]).view(1, num_heads, head_dim).to(query.dtype)
