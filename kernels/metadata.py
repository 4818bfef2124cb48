"""Attention metadata: what one forward step needs to find every token's K/V in the paged cache.

Built by the runner from the scheduler's output; read by the attention ops. Names follow
vLLM v1 (``FlashAttentionMetadata``): slot mapping, block tables, query_start_loc, seq_lens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of a flattened batch of ``T`` tokens from ``B`` sequences.

    Sequence ``b`` owns query tokens ``query_start_loc[b] : query_start_loc[b+1]``; these are
    its positions ``seq_lens[b] - query_len_b ... seq_lens[b] - 1`` (its context after this step
    is ``seq_lens[b]`` tokens, of which ``seq_lens[b] - query_len_b`` were already cached).

    Attributes:
        slot_mapping: ``[T]`` int64, cache slot of each new token = ``block_id * block_size + offset``.
        block_tables: ``[B, max_blocks]`` int32, block ids per sequence, padded with 0 (the null block).
        query_start_loc: ``[B + 1]`` int32, cumulative query lengths (tokens).
        seq_lens: ``[B]`` int32, context length of each sequence after this step (tokens).
        query_lens_cpu, seq_lens_cpu: the same lengths as Python lists (no device sync on CPU paths).
        block_size: tokens per KV block.
        attn_backend: "cpu" (``kernels/cpu_attention.py``, batched), "torch" (``kernels/reference.py``,
            the per-sequence oracle) or "triton" (the Triton kernels).
        plans: per-step derived data a backend builds once for all layers of the group (e.g. the
            cpu backend's gather indices and masks), keyed by the backend; empty when built.
        decode_max_seq_len: None, or a fixed bound on ``seq_lens`` (tokens) for a decode step
            captured as a CUDA graph (``llmd.daemon.core.cuda_graphs``): the triton decode then
            takes its split count from this bound (``--max-model-len``) and each sequence's split
            length from ``seq_lens`` on the device, so no launch argument depends on the step.
        residual_slots: int4 caches: per sequence its residual slot in this group (the exact
            16-bit K of its open block, :mod:`llmd.quant.kv`), -1 for none; None otherwise.
        cascade_attn: the cpu backend may attend decodes that share leading blocks to them once
            (:mod:`llmd.kernels.cpu_cascade`); False = ``--disable-cascade-attn``.
        slots_padded: whether ``slot_mapping`` may hold padding slots (-1, skipped by ``store_kv``):
            False when the builder knows every slot is real (the runner's steps), True when it pads
            (CUDA-graph buckets), None when unknown (``store_kv`` then checks, one host sync per
            layer). Computed once per step, so 30 layers do not each test ``slot_mapping >= 0``.
        native_kernels: the cpu backend may run its decodes in the C kernel
            (:mod:`llmd.kernels.cpu_native`) when it is available; False = the torch path only.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    attn_backend: str = "torch"
    plans: dict = field(default_factory=dict, repr=False, compare=False)
    decode_max_seq_len: int | None = None
    residual_slots: list[int] | None = None
    cascade_attn: bool = True
    slots_padded: bool | None = None
    native_kernels: bool = True

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def workspace_buffer(workspace: dict, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor of ``shape``/``dtype`` for ``role`` kept in ``workspace`` (a step
    plan's dict), so every layer of a KV cache group reuses the same buffer within the step."""
    key = (role, shape, dtype)
    buf = workspace.get(key)
    if buf is None:
        buf = workspace[key] = torch.empty(shape, dtype=dtype)
    return buf
