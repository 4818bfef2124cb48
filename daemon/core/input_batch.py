"""One step's model inputs, built with vector ops into persistent host buffers.

vLLM v1 ``gpu_model_runner.py`` ``_prepare_inputs`` (numpy buffers, ``np.repeat`` / index
math) in small: per step the only Python work is one pass over the ``B`` scheduled sequences
(their lengths and list references); every per-token array (input ids, positions, slot
mapping) and the padded block tables come from numpy ops on buffers allocated once, sized by
``max_num_batched_tokens`` / ``max_num_seqs`` / blocks per sequence, and grown (doubled) if a
step ever needs more (tests may schedule past the token budget).

The returned CPU tensors are views of these buffers (``torch.from_numpy``): valid until the
next :meth:`InputBatch.prepare`, which overwrites them. Non-CPU devices get copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np
import torch

from llmd.daemon.core.outputs import SchedulerOutput
from llmd.kernels import AttentionMetadata


@dataclass
class StepInputs:
    """What :meth:`InputBatch.prepare` returns.

    Attributes:
        input_ids: ``[T]`` int64.
        positions: ``[T]`` int64, each token's position in its sequence.
        metas: one :class:`AttentionMetadata` per KV cache group.
        logits_indices: flat index of the last token of each sequence that samples (batch order).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: list[AttentionMetadata]
    logits_indices: list[int]


class _Buf:
    """A growable 1-D numpy buffer."""

    def __init__(self, dtype, size: int):
        self.dtype = dtype
        self.a = np.zeros(max(1, size), dtype=dtype)

    def get(self, n: int) -> np.ndarray:
        if n > self.a.shape[0]:
            self.a = np.zeros(max(n, 2 * self.a.shape[0]), dtype=self.dtype)
        return self.a[:n]


class InputBatch:
    """Persistent buffers and the vectorized build of one step's inputs.

    Args:
        num_groups: KV cache groups (one block table and slot mapping each).
        block_size: tokens per block.
        device: where the returned tensors live (CPU: views of the buffers).
        attention_backend: set on every :class:`AttentionMetadata`.
        max_num_seqs, max_num_batched_tokens, max_blocks_per_seq: initial buffer sizes.

    ``cascade_attn`` and ``native_kernels`` (attributes, default True) are set on every metadata too
    (``--disable-cascade-attn``, ``--disable-native-kernels``).
    """

    cascade_attn = True
    native_kernels = True

    def __init__(self, num_groups: int, block_size: int, device: torch.device, attention_backend: str,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 256, max_blocks_per_seq: int = 64):
        self.num_groups = num_groups
        self.block_size = block_size
        self.device = torch.device(device)
        self.attention_backend = attention_backend
        t, b = max_num_batched_tokens, max_num_seqs
        self.input_ids = _Buf(np.int64, t)
        self.positions = _Buf(np.int64, t)
        self.arange = np.arange(max(t, b + 1), dtype=np.int64)
        self.query_start_loc = _Buf(np.int32, b + 1)
        self.seq_lens = _Buf(np.int32, b)
        self.block_tables = [_Buf(np.int32, b * max_blocks_per_seq) for _ in range(num_groups)]
        self.slot_mapping = [_Buf(np.int64, t) for _ in range(num_groups)]

    def _arange(self, n: int) -> np.ndarray:
        if n > self.arange.shape[0]:
            self.arange = np.arange(max(n, 2 * self.arange.shape[0]), dtype=np.int64)
        return self.arange[:n]

    def _out(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Flatten ``out`` into model inputs (see :class:`StepInputs`); the per-group metadata
        follows :class:`AttentionMetadata` exactly: slot mapping ``[T]`` int64
        (``block_id * block_size + offset``), block tables ``[B, max_blocks]`` int32 padded with
        0 (the null block), query_start_loc ``[B + 1]`` int32, seq_lens ``[B]`` int32."""
        sched = out.scheduled
        nb = len(sched)
        starts = [s.num_computed_tokens for s in sched]
        qlens = [len(s.token_ids) for s in sched]
        seq_lens = [a + n for a, n in zip(starts, qlens)]
        qsl_py = list(accumulate(qlens, initial=0))
        num_tokens = qsl_py[-1]
        logits_indices = [qsl_py[b + 1] - 1 for b, s in enumerate(sched) if s.sample]
        qsl = self.query_start_loc.get(nb + 1)
        qsl[:] = qsl_py
        sl = self.seq_lens.get(nb)
        sl[:] = seq_lens

        ids = self.input_ids.get(num_tokens)
        ids[:] = sched[0].token_ids if nb == 1 else list(chain.from_iterable(s.token_ids for s in sched))
        pos = self.positions.get(num_tokens)
        if num_tokens == 1:  # one decode (batch-1 chat): scalar stores, no array ops to pay for
            return self._single_token(sched[0], qsl, sl, ids, pos, qlens, seq_lens, logits_indices)
        if num_tokens == nb:  # decodes only: one token per sequence, at its start position
            seq_of_token = self._arange(nb)
            pos[:] = starts
        else:  # token t of sequence b sits at position starts[b] + (t - qsl[b])
            seq_of_token = np.repeat(self._arange(nb), qlens)
            offset = np.asarray([q - a for q, a in zip(qsl_py, starts)], dtype=np.int64)
            np.subtract(self._arange(num_tokens), offset[seq_of_token], out=pos)
        blk, off = np.divmod(pos, self.block_size)

        qsl_t, sl_t = self._out(qsl), self._out(sl)
        bs = self.block_size
        metas = []
        for g in range(self.num_groups):
            tables = [s.block_tables[g] for s in sched]
            lens = [len(t) for t in tables]
            width = max(lens, default=0)
            bt = self.block_tables[g].get(nb * width).reshape(nb, width)
            if nb == 1:
                bt[0] = tables[0]
            else:
                bt.fill(0)
                bt[self._arange(width)[None, :] < np.asarray(lens)[:, None]] = list(chain.from_iterable(tables))
            slots = self.slot_mapping[g].get(num_tokens)
            np.multiply(bt[seq_of_token, blk], bs, out=slots, dtype=np.int64)  # int64 before the multiply
            slots += off
            metas.append(AttentionMetadata(
                slot_mapping=self._out(slots), block_tables=self._out(bt), query_start_loc=qsl_t, seq_lens=sl_t,
                query_lens_cpu=qlens, seq_lens_cpu=seq_lens, block_size=bs, attn_backend=self.attention_backend,
                residual_slots=_residual_slots(sched, g), cascade_attn=self.cascade_attn,
                native_kernels=self.native_kernels, slots_padded=False,
            ))
        return StepInputs(self._out(ids), self._out(pos), metas, logits_indices)

    def _single_token(self, s, qsl, sl, ids, pos, qlens, seq_lens, logits_indices) -> StepInputs:
        """:meth:`prepare` for a step of one token (one sequence decoding): same outputs."""
        bs = self.block_size
        p = s.num_computed_tokens
        pos[0] = p
        qsl_t, sl_t = self._out(qsl), self._out(sl)
        metas = []
        for g in range(self.num_groups):
            table = s.block_tables[g]
            bt = self.block_tables[g].get(len(table)).reshape(1, len(table))
            bt[0] = table
            slots = self.slot_mapping[g].get(1)
            slots[0] = table[p // bs] * bs + p % bs
            metas.append(AttentionMetadata(
                slot_mapping=self._out(slots), block_tables=self._out(bt), query_start_loc=qsl_t, seq_lens=sl_t,
                query_lens_cpu=qlens, seq_lens_cpu=seq_lens, block_size=bs, attn_backend=self.attention_backend,
                residual_slots=_residual_slots([s], g), cascade_attn=self.cascade_attn,
                native_kernels=self.native_kernels, slots_padded=False,
            ))
        return StepInputs(self._out(ids), self._out(pos), metas, logits_indices)


def _residual_slots(sched, g: int) -> list[int] | None:
    """Group ``g``'s int4 residual slot of each scheduled request (None without a residual)."""
    if sched[0].residual_slots is None:
        return None
    return [s.residual_slots[g] for s in sched]
