"""KV cache block operations of :class:`~llmd.daemon.core.model_runner.ModelRunner`, run before
each step's forward: copy-on-write block copies, int4 residual-slot copies and context-shift
re-rotations.

A mixin: the caches it writes (``caches``, ``layer_caches``, ``layer_group``, ``config``,
``device``) are the runner's. Every operation acts on all of the runner's cache tensors
(``[2, num_blocks, block_size, kv_heads, head_dim]`` data, their scales, int4 residuals);
block ids and residual slots are plain ints from the scheduler's
:class:`~llmd.daemon.core.outputs.SchedulerOutput` (``blocks_to_copy``, ``residual_copies``,
``blocks_to_shift`` / ``residuals_to_shift`` as :class:`~llmd.daemon.core.outputs.BlockShift` /
:class:`~llmd.daemon.core.outputs.ResidualShift`, ``delta`` in token positions). The keys'
re-rotation is :func:`llmd.kernels.kv_shift.shift_keys` / ``shift_residual`` with each layer's RoPE
base. Nothing here raises on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmd.daemon.core.outputs import BlockShift, ResidualShift
from llmd.kernels import shift_keys
from llmd.kernels.kv_shift import shift_residual


class KVOpsMixin:
    """:class:`~llmd.daemon.core.model_runner.ModelRunner`'s block copies and context-shift
    re-rotations over its caches; reads that class's attributes."""

    @torch.inference_mode()
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block ``src``'s K/V (and scales) into block ``dst`` in every cache tensor."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for c in self.caches:
            c.data[:, dst] = c.data[:, src]
            if c.scales is not None:
                c.scales[:, dst] = c.scales[:, src]

    @torch.inference_mode()
    def copy_residuals(self, pairs: Sequence[tuple[int, int]]) -> None:
        """int4 forks: residual slot ``src``'s 16-bit K into slot ``dst`` in every cache tensor."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for c in self.caches:
            c.residual[dst] = c.residual[src]

    @torch.inference_mode()
    def shift_blocks(self, shifts: Sequence[BlockShift], residuals: Sequence[ResidualShift] = ()) -> None:
        """Context shift: re-rotate each op's block keys by ``-delta`` positions in every layer of
        its KV cache group, with that layer's RoPE base (:func:`llmd.kernels.kv_shift.shift_keys`).
        One call per cache tensor with every op that touches it (the layers of several groups share
        a tensor): all sources are read before any destination is written, so a block released by
        one shift and taken as another's fresh block in the same step is never read overwritten.
        int4: ``residuals`` re-rotate the shifting sequences' open-block K in their residual slots
        (:func:`llmd.kernels.kv_shift.shift_residual`; a slot belongs to one sequence and group)."""
        if not shifts and not residuals:
            return
        per_cache: dict[int, tuple] = {}  # id(cache tensor) -> (cache, [(src, dst, delta, theta)], [(slot, ...)])
        for layer, g in enumerate(self.layer_group):
            cache, theta = self.layer_caches[layer], self.config.layer_rope_theta(layer)
            _, ops, res = per_cache.setdefault(id(cache), (cache, [], []))
            ops.extend((op.src, op.dst, op.delta, theta) for op in shifts if op.group == g)
            res.extend((op.slot, op.delta, theta) for op in residuals if op.group == g)
        for cache, ops, res in per_cache.values():
            if ops:
                src, dst, delta, theta = (list(c) for c in zip(*ops))
                shift_keys(cache, src, dst, delta, theta)
            if res:
                slots, delta, theta = (list(c) for c in zip(*res))
                shift_residual(cache, slots, delta, theta)
