"""The gathered path of the fast CPU attention backend (:mod:`llmd.kernels.cpu_attention`): the
compute dtype, K/V gathered through a step plan's rows, and the scores.

* :func:`compute_dtype_for`: a query dtype → the dtype the path computes in (bfloat16 and
  float64 stay, float32 and float16 compute in float32).
* :func:`_gather_kv`: K and V gathered by ``index_select`` over the plan's rows (``slot ·
  kv_heads + head``, :mod:`llmd.kernels.cpu_plan`) into the plan's workspace, ``[N * kv_heads,
  L, head_dim]`` in the compute dtype (K float32 for a bfloat16 step unless :func:`bf16_keys`);
  int8/fp8 codes converted exactly, their scales gathered as ``[N * kv_heads, 1, L]`` float32
  (float64 for float64 compute) and clamped to ``SCALE_FLOOR``, or grouped scales
  (``--kv-scale-group-size``) multiplied into the codes in place.
* :func:`bf16_keys`: whether a bfloat16 step's K may stay bfloat16 (:mod:`llmd.kernels.cpu_scores`
  available, an even head_dim ≤ 256, no grouped scales).
* :func:`_scores`: ``scale · q kᵀ + mask`` ``[rows, group · Q, L]`` into the workspace: float32 by
  :func:`llmd.kernels.cpu_scores.scores` for bfloat16 ``q`` and K, else ``baddbmm`` in K's dtype;
  :func:`_kernel_mask` lays the gather's mask out as that kernel takes it.

Nothing here raises on its own (torch's errors pass through). Called per layer by
:func:`llmd.kernels.cpu_attention._attend` / ``paged_attention`` and, through them,
:mod:`llmd.kernels.cpu_cascade`; every name is re-exported by :mod:`llmd.kernels.cpu_attention`.
"""

from __future__ import annotations

import torch

from llmd.kernels import cpu_scores
from llmd.kernels.cpu_plan import Gather, StepPlan
from llmd.quant.kv import SCALE_FLOOR, PagedKVCache


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """bfloat16 and float64 models compute in their own dtype; float32 and float16 in float32."""
    return dtype if dtype in (torch.bfloat16, torch.float64) else torch.float32


def _gather_kv(plan: StepPlan, role: str, cache: PagedKVCache, rows: torch.Tensor, length: int,
               dtype: torch.dtype):
    """Gather K and V through the plan's rows into the plan's workspace.

    Returns:
        ``(k, v, k_scales, v_scales)``: K and V ``[N * kv_heads, length, head_dim]`` in ``dtype``
        (K in float32 when ``dtype`` is bfloat16, so that the scores are float32, unless
        :func:`bf16_keys` holds: then K stays bfloat16 for :mod:`llmd.kernels.cpu_scores`, whose
        scores are float32 too; int8/fp8 codes converted
        exactly: every code is representable in bfloat16 and float32), and for int8/fp8 their
        scales ``[N * kv_heads, 1, length]`` float32 (float64 for float64 compute), else None.
        With grouped scales (``--kv-scale-group-size``) the gathered codes are dequantized in
        place instead (``code × scale`` in ``dtype``, a ``[rows, G]`` scale gather) and both
        scales are None. The caller multiplies scores by ``k_scales`` and probabilities by
        ``v_scales``: ``q·(code × s) = (q·code) × s``, the dequantization folded into
        ``[N, group, L]``-sized products instead of a pass over K and V.
    """
    data = cache.data
    head_dim = data.shape[-1]
    shape = (rows.shape[0] // length, length, head_dim)
    kv = []
    f32_keys = dtype == torch.bfloat16 and not bf16_keys(cache, head_dim)
    for i in (0, 1):
        want = torch.float32 if i == 0 and f32_keys else dtype
        raw = plan.buffer(f"{role}{i}", (rows.shape[0], head_dim), data.dtype)
        torch.index_select(data[i].view(-1, head_dim), 0, rows, out=raw)
        if data.dtype != want:
            conv = plan.buffer(f"{role}{i}c", (rows.shape[0], head_dim), want)
            raw = conv.copy_(raw)
        kv.append(raw.view(shape))
    if not cache.fmt.quantized:
        return kv[0], kv[1], None, None
    if cache.fmt.group_size:  # --kv-scale-group-size: code × its group's scale, in the gather's buffer
        groups = cache.scales.shape[-1]
        for i in (0, 1):
            s = cache.scales[i].view(-1, groups).index_select(0, rows).to(kv[i].dtype)  # [rows, G]
            kv[i].view(-1, groups, head_dim // groups).mul_(s[:, :, None])
        return kv[0], kv[1], None, None
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    ks, vs = (cache.scales[i].view(-1).index_select(0, rows).view(-1, 1, length).to(sdt) for i in (0, 1))
    # masked keys may read never-written slots (scale 0): -inf · 0 would be NaN in the scores
    return kv[0], kv[1], ks.clamp_min_(SCALE_FLOOR), vs


def bf16_keys(cache: PagedKVCache, head_dim: int) -> bool:
    """A bfloat16 step's K may stay bfloat16: :mod:`llmd.kernels.cpu_scores` is available and
    takes this head_dim, and the codes need no in-place dequantization (grouped scales would
    round ``code × scale`` to bfloat16)."""
    return head_dim % 2 == 0 and head_dim <= 256 and not cache.fmt.group_size and cpu_scores.available()


def _kernel_mask(g: Gather | None) -> tuple[torch.Tensor | None, int]:
    """The mask as :mod:`llmd.kernels.cpu_scores` takes it: ``[N, Q, L]`` unexpanded (row ``m`` of
    entry ``n · kv_heads + h`` is ``m % Q``) and its batch divisor ``kv_heads``; None and 1 without one."""
    return (None, 1) if g is None else (g.bias[:, 0], g.kv_heads)


def _scores(plan: StepPlan, role: str, q: torch.Tensor, k: torch.Tensor, g: Gather | None, scale: float,
            rows: int, gq: int, length: int) -> torch.Tensor:
    """``scale · q kᵀ + mask`` into the plan's workspace: float32 from bfloat16 ``q`` and ``k``
    by :func:`llmd.kernels.cpu_scores.scores`, else in K's dtype by ``baddbmm`` (``q`` converted)."""
    if k.dtype == torch.bfloat16:
        out = plan.buffer(role + "s", (rows, gq, length), torch.float32)
        bias, div = _kernel_mask(g)
        if cpu_scores.scores(q.to(torch.bfloat16), k, scale, bias, out, div):
            return out
        k = k.float()  # the kernel was switched off since the gather
    if q.dtype != k.dtype:  # a bfloat16 model's query, for float32 scores
        q = q.to(k.dtype)
    scores = plan.buffer(role + "s", (rows, gq, length), k.dtype)
    if g is None:  # beta = 0: the buffer's old contents are ignored (no NaN carried over)
        scores.baddbmm_(q, k.transpose(1, 2), beta=0.0, alpha=scale)
    else:
        torch.baddbmm(g.scores_bias(k.dtype), q, k.transpose(1, 2), alpha=scale, out=scores)
    return scores
