"""Decode steps replayed as CUDA graphs, and the padded static inputs every graph reads.

vLLM's CUDA-graph decode and nano-vllm ``model_runner.py`` (``capture_cudagraph``, ``run_model``)
in small:

* **Buckets** (:func:`graph_batch_sizes`): batch sizes 1, 2, 4, 8, then every 16 up to
  ``--max-num-seqs`` (and ``--max-num-seqs`` itself when it is not on that grid). A decode-only
  step of ``n`` sequences replays the graph of the smallest bucket ``>= n``; prefill and mixed
  steps, and decodes of more sequences than the largest bucket, run eagerly.
* **Static inputs** (:class:`StaticDecodeInputs`): device buffers sized for the largest bucket
  (input ids, positions, slot mapping and block tables per KV cache group, seq lens), whose
  addresses the captured kernels keep. Each step refreshes them with non-blocking copies from
  pinned host mirrors. The host mirror is rewritten only at the next step, after the sampler's
  copy of this step's token ids back to the host has synchronized with the stream, so a copy
  never reads a half-rewritten mirror.
* **Padding**: rows ``n .. bucket - 1`` get token 0 at position 0, slot -1 (``store_kv`` skips
  negative slots in the Triton kernel and the torch reference: nothing is written) and seq_len 0
  (the decode kernel reads no key and writes 0). Their hidden states are dropped.
* **Fixed split configuration**: the triton decode kernel's grid and its split count are
  launch arguments, fixed at capture. The metadata carries ``decode_max_seq_len =
  --max-model-len``: the split count is :func:`llmd.kernels.decode_attention.num_decode_splits`
  of that bound (64 for Qwen3-0.6B's 40,960 tokens), and each sequence's split length is computed
  on the device from its seq_len (``per_seq_splits``). The partial buffers (acc, max, sum of
  ``bucket x heads x splits``) are allocated during capture from the graphs' shared memory pool,
  so every replay reuses the same ones.
* **Capture** (:meth:`DecodeGraphs.capture`, CUDA only) after the start-up kernel warm-up:
  every bucket, largest first, runs once eagerly on its padded inputs (all rows padding: the
  KV cache is not touched), then is captured into one shared graph memory pool.

The eager path over the same padded inputs (:meth:`DecodeGraphs.run_eager`) is what runs on
CPU, so tests check there that the real rows of a padded step equal the unpadded step.
"""

from __future__ import annotations

import torch

from llmd.daemon.core.input_batch import StepInputs
from llmd.daemon.core.outputs import SchedulerOutput
from llmd.kernels import AttentionMetadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, 16, 32, ... (every 16) up to ``max_num_seqs``, plus
    ``max_num_seqs`` itself. Raises ValueError for ``max_num_seqs < 1``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)) if s <= max_num_seqs]
    return sizes if sizes[-1] == max_num_seqs else [*sizes, max_num_seqs]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest size ``>= n`` (None when ``n`` exceeds the largest: that step runs eagerly)."""
    return next((s for s in sizes if s >= n), None)


class StaticDecodeInputs:
    """The decode graphs' input buffers and their host mirrors (pinned on CUDA).

    Args:
        max_batch: the largest bucket (rows of every buffer).
        num_groups: KV cache groups (a slot mapping and block tables each).
        max_blocks: block table columns (``ceil(max_model_len / block_size)``).
        block_size: tokens per block; device: where the buffers live.
        attention_backend: set on the metadata.
        decode_max_seq_len: the fixed split bound (tokens) for the triton decode, or None
            (eager backends size from the step's own lengths).

    Device buffers: ``ids``, ``positions`` ``[max_batch]`` int64; ``seq_lens`` ``[max_batch]``
    int32; ``query_start_loc`` ``[max_batch + 1]`` int32 (``0..max_batch``: one token per row);
    per group ``slots`` ``[max_batch]`` int64 and ``tables`` ``[max_batch, max_blocks]`` int32.
    Table entries past a row's seq_len may hold an earlier step's block ids: every backend reads
    a table only below the row's seq_len (the others are masked), and all ids are valid blocks.
    """

    def __init__(self, max_batch: int, num_groups: int, max_blocks: int, block_size: int, device: torch.device,
                 attention_backend: str, decode_max_seq_len: int | None = None):
        self.max_batch, self.block_size = max_batch, block_size
        self.device = torch.device(device)
        self.attention_backend = attention_backend
        self.decode_max_seq_len = decode_max_seq_len
        pin = self.device.type == "cuda"
        i32, i64 = torch.int32, torch.int64

        def host(n, dtype):
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        def dev(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        g = range(num_groups)
        self.h_ids, self.h_pos, self.h_seq = host(max_batch, i64), host(max_batch, i64), host(max_batch, i32)
        self.h_slots = [host(max_batch, i64) for _ in g]
        self.h_tables = [host(max_batch * max_blocks, i32) for _ in g]  # compact [n, width] of one step
        self.ids, self.positions, self.seq_lens = dev(max_batch, dtype=i64), dev(max_batch, dtype=i64), dev(
            max_batch, dtype=i32)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=i32, device=self.device)
        self.slots = [dev(max_batch, dtype=i64) for _ in g]
        self.tables = [dev(max_batch, max_blocks, dtype=i32) for _ in g]
        self.staged = [dev(max_batch * max_blocks, dtype=i32) for _ in g]

    def load(self, step: StepInputs | None, bucket: int) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """Write one decode step (host tensors from :meth:`InputBatch.prepare` on CPU; None = every
        row padding, as at capture) into the buffers, padded to ``bucket`` rows.

        Returns:
            ``input_ids [bucket]`` int64, ``positions [bucket]`` int64 and one
            :class:`AttentionMetadata` per group (views of the device buffers; slot -1 and
            seq_len 0 in the padded rows, query length 1 everywhere).
        Raises:
            ValueError: more rows than ``bucket``, or ``bucket`` over ``max_batch``.
        """
        n = 0 if step is None else int(step.input_ids.shape[0])
        if not n <= bucket <= self.max_batch:
            raise ValueError(f"cannot pad {n} rows to {bucket} (largest bucket {self.max_batch})")
        blocking = self.device.type == "cpu"
        for h, d, src, pad in ((self.h_ids, self.ids, None if step is None else step.input_ids, 0),
                               (self.h_pos, self.positions, None if step is None else step.positions, 0),
                               (self.h_seq, self.seq_lens, None if step is None else step.metas[0].seq_lens, 0)):
            if n:
                h[:n] = src
            h[n:bucket] = pad
            d[:bucket].copy_(h[:bucket], non_blocking=not blocking)
        for g in range(len(self.slots)):
            self.h_slots[g][n:bucket] = -1
            if n:
                meta = step.metas[g]
                self.h_slots[g][:n] = meta.slot_mapping
                width = int(meta.block_tables.shape[1])
                self.h_tables[g][: n * width] = meta.block_tables.reshape(-1)
                staged = self.staged[g][: n * width]
                staged.copy_(self.h_tables[g][: n * width], non_blocking=not blocking)
                self.tables[g][:n, :width] = staged.view(n, width)  # on the device: a strided copy
            self.slots[g][:bucket].copy_(self.h_slots[g][:bucket], non_blocking=not blocking)
        seq_lens_cpu = ([] if step is None else list(step.metas[0].seq_lens_cpu)) + [0] * (bucket - n)
        metas = [AttentionMetadata(
            slot_mapping=self.slots[g][:bucket], block_tables=self.tables[g][:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1], seq_lens=self.seq_lens[:bucket],
            query_lens_cpu=[1] * bucket, seq_lens_cpu=seq_lens_cpu, block_size=self.block_size,
            attn_backend=self.attention_backend, decode_max_seq_len=self.decode_max_seq_len, slots_padded=True,
        ) for g in range(len(self.slots))]
        return self.ids[:bucket], self.positions[:bucket], metas


class DecodeGraphs:
    """Padded decode steps: eager (any device) or replayed CUDA graphs (after :meth:`capture`).

    Args:
        model: the llmd model (``forward(ids, positions, layer_caches, meta) -> [T, hidden]``).
        layer_caches: per layer, its :class:`~llmd.quant.kv.PagedKVCache`.
        layer_group: per layer, its KV cache group index.
        num_groups, block_size, max_num_seqs, max_model_len, device, attention_backend: the
            runner's settings (``max_model_len`` in tokens bounds block tables and the splits).
    """

    def __init__(self, model, layer_caches: list, layer_group: list[int], num_groups: int, block_size: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device, attention_backend: str):
        self.model, self.layer_caches, self.layer_group = model, layer_caches, layer_group
        self.sizes = graph_batch_sizes(max_num_seqs)
        bound = max_model_len if attention_backend == "triton" else None
        self.static = StaticDecodeInputs(self.sizes[-1], num_groups, -(-max_model_len // block_size), block_size,
                                         device, attention_backend, bound)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0

    def accepts(self, out: SchedulerOutput) -> bool:
        """Whether ``out`` is a decode-only step (one token per sequence) within the largest bucket."""
        sched = out.scheduled
        return 0 < len(sched) <= self.sizes[-1] and all(len(s.token_ids) == 1 for s in sched)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, metas: list[AttentionMetadata]) -> torch.Tensor:
        meta = metas[0] if len(metas) == 1 else [metas[g] for g in self.layer_group]
        return self.model(ids, positions, self.layer_caches, meta)

    def run_eager(self, step: StepInputs, bucket: int | None = None) -> torch.Tensor:
        """The step padded to ``bucket`` (default its own bucket), run eagerly; hidden states of
        the real rows ``[n, hidden]``."""
        n = int(step.input_ids.shape[0])
        ids, pos, metas = self.static.load(step, bucket or bucket_for(n, self.sizes))
        return self._forward(ids, pos, metas)[:n]

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture one graph per bucket (largest first, one shared memory pool); returns how many.

        Raises:
            RuntimeError: not on CUDA (nothing to capture), or a failed capture (CUDA's error).
        """
        if self.static.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        pool = None
        for bs in reversed(self.sizes):
            ids, pos, metas = self.static.load(None, bs)
            self._forward(ids, pos, metas)  # warm-up outside the capture (cuBLAS handles, lazy inits)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(ids, pos, metas)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = (graph, hidden)
        torch.cuda.synchronize()
        return len(self.graphs)

    def replay(self, step: StepInputs) -> torch.Tensor:
        """Refresh the static inputs and replay the step's bucket; hidden states ``[n, hidden]``
        (a view of the graph's output, valid until the next replay)."""
        n = int(step.input_ids.shape[0])
        bucket = bucket_for(n, self.sizes)
        self.static.load(step, bucket)
        graph, hidden = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return hidden[:n]
