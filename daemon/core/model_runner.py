"""Model runner: scheduler output → tensors → model → logits → sampled tokens.

Owns the paged KV cache tensors (one per layer, allocated once; int8/fp8 caches carry float32
scales beside the data, see :mod:`llmd.quant.kv`) and turns each step's
:class:`SchedulerOutput` into input ids, positions, the slot mapping and padded block tables
(:mod:`llmd.daemon.core.input_batch`: vector ops into persistent buffers, vLLM v1
``gpu_model_runner.py`` ``_prepare_inputs``; nano-vllm ``model_runner.py``). Decode-only steps
replay CUDA graphs on CUDA with the triton backend unless ``--enforce-eager``
(:mod:`llmd.daemon.core.cuda_graphs`).
The CUDA set-up (graphs, Triton warm-up) is :class:`~llmd.daemon.core.model_runner_cuda.CudaMixin`;
the block copies and context-shift re-rotations :class:`~llmd.daemon.core.model_runner_kv.KVOpsMixin`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from llmd.daemon.core.cuda_graphs import DecodeGraphs
from llmd.daemon.core.input_batch import InputBatch
from llmd.daemon.core.model_runner_cuda import CudaMixin
from llmd.daemon.core.model_runner_kv import KVOpsMixin
from llmd.daemon.core.outputs import ScheduledRequest, SchedulerOutput
from llmd.daemon.core.request import Request
from llmd.daemon.core.sampler import Sampler, SamplerOutput
from llmd.daemon.kv import KVCacheGroupSpec, layer_placement, make_kv_cache_groups
from llmd.kernels import AttentionMetadata, amx_linear, cpu_glue, cpu_native, dp_linear
from llmd.kernels.cpu_attention import compute_dtype_for
from llmd.kernels.native import build
from llmd.models.config import ModelConfig
from llmd.quant import fp16_linear, prepacked
from llmd.quant.kv import PagedKVCache, get_format


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of one cache tensor: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
    return (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


class ModelRunner(CudaMixin, KVOpsMixin):
    """Runs the model on a scheduled batch.

    Args:
        model: an llmd model (``forward(ids, positions, kv_caches, meta)``, ``compute_logits``).
        num_blocks: KV blocks per layer (block 0 is the null block).
        block_size: tokens per block.
        kv_dtype: the model dtype (the cache dtype for ``kv_cache_dtype="auto"``).
        device: where tensors live.
        kv_cache_dtype: "auto", "int8", "fp8_e4m3", "fp8_e5m2" or "int4", or a
            :class:`~llmd.quant.kv_format.KVCacheFormat` (e.g. with grouped scales).
        kv_scales: static (k_scale, v_scale) per-tensor scales, or None for dynamic scales.
        attention_backend: "cpu", "torch" or "triton" (set on every step's AttentionMetadata).
        kv_cache_groups: the KV cache groups (default: every layer in one full-attention group).
        max_num_seqs, max_num_batched_tokens, max_model_len: size the persistent input buffers
            (:class:`~llmd.daemon.core.input_batch.InputBatch`; they grow if a step needs more).
        cuda_graphs: capture decode steps as CUDA graphs after the kernel warm-up (CUDA and the
            triton backend only; elsewhere ignored). ``--enforce-eager`` turns it off. int4 caches
            decode eagerly: their K store (:mod:`llmd.kernels.kivi`) plans each step on the host.
        fp16_weights: give the model's float32 layer weights (and LM head) fbgemm fp16 packs
            (:func:`llmd.quant.fp16_linear.pack_model`; CPU only, where ``--dtype auto`` chose float32).
        kv_rotation: ``--kv-rotation`` of every layer's cache ("none" / "hadamard";
            :mod:`llmd.quant.rotation`, applied by the attention ops).
        residual_slots: int4: slots of each cache tensor's open-block K residual (the KV
            manager's ``num_residual_slots``).

    Attributes:
        caches: the ``group_size`` physical caches; layer ``k`` of every group uses ``caches[k]``
            (:func:`llmd.daemon.kv.layer_placement`).
        layer_caches: per layer, the :class:`PagedKVCache` (data + scales + format) the model reads.
        kv_caches: per layer, the data tensor ``[2, num_blocks, block_size, kv_heads, head_dim]``
            (``head_dim // 2`` uint8 for int4).
        kv_scales: per layer, float32 ``[2, num_blocks, block_size, kv_heads]`` (int4: ``[...,
            head_dim // 16]`` float16) or None (auto).
        decode_graphs: the :class:`DecodeGraphs` padded decode path, or None (eager steps).
        measure_device_wait: when set (benchmarks), each graph step synchronizes once after the
            forward and the logits and adds the seconds it waited to ``device_wait_s``, so a
            step's host time is its wall time minus that wait.
    """

    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: torch.dtype, device: str | torch.device,
                 kv_cache_dtype: str = "auto", kv_scales: tuple[float, float] | None = None,
                 attention_backend: str = "torch", kv_cache_groups: list[KVCacheGroupSpec] | None = None,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 256, max_model_len: int = 2048,
                 cuda_graphs: bool = False, kv_rotation: str = "none", residual_slots: int = 0,
                 cascade_attn: bool = True, native_kernels: bool = True, fp16_weights: bool = False):
        self.model = model
        self.config: ModelConfig = model.config
        self.block_size = block_size
        self.device = torch.device(device)
        # bfloat16 layer weights packed once: in AMX tile order where the tile unit is there
        # (kernels/amx_linear.py), for VDPBF16PS where that pays (kernels/dp_linear.py: dense weights
        # at small steps), else in oneDNN's blocked layout (quant/prepacked.py; same bits). The install
        # is process-wide: this model's own choice decides its packs (another engine's may differ)
        emb = getattr(getattr(model, "embed_tokens", None), "weight", None)
        tiles = self.device.type == "cpu" and emb is not None and emb.dtype == torch.bfloat16 and \
            (amx_linear.install() or (dp_linear.wanted(model) and dp_linear.install()))
        self.prepacked_linears = prepacked.prepack_model(model, tiles) if self.device.type == "cpu" else 0
        # float32 layer weights as fp16 for fbgemm where --dtype auto chose float32 (quant/fp16_linear.py)
        self.fp16_weights = fp16_weights and self.device.type == "cpu" and fp16_linear.enabled()
        if self.fp16_weights:
            fp16_linear.pack_model(model)  # idempotent: a second engine on the model finds them
        self.groups = kv_cache_groups or make_kv_cache_groups((None,) * self.config.num_layers)  # all global
        group_size, placement = layer_placement(self.groups)
        self.layer_group = [placement[i][0] for i in range(self.config.num_layers)]
        shape = kv_cache_shape(self.config, num_blocks, block_size)
        fmt = get_format(kv_cache_dtype)
        self.caches = [PagedKVCache.allocate(shape, fmt, kv_dtype, self.device, kv_scales, kv_rotation,
                                             residual_slots) for _ in range(group_size)]
        self.layer_caches = [self.caches[placement[i][1]] for i in range(self.config.num_layers)]
        self.kv_caches = [c.data for c in self.layer_caches]
        self.kv_scales = [c.scales for c in self.layer_caches]
        self.sampler = Sampler()
        self.inputs = InputBatch(len(self.groups), block_size, self.device, attention_backend, max_num_seqs,
                                 max_num_batched_tokens, -(-max_model_len // block_size))
        self.inputs.cascade_attn = cascade_attn  # the cpu backend's shared-prefix decodes (kernels/cpu_cascade.py)
        self.inputs.native_kernels = native_kernels  # the cpu backend's C decode kernel (kernels/cpu_native.py)
        self.num_warmed_up = 0  # Triton variants compiled at start-up (CUDA + triton backend only)
        self.decode_graphs: DecodeGraphs | None = None
        self.measure_device_wait, self.device_wait_s = False, 0.0
        self._graph_limits = (max_num_seqs, max_model_len)
        self.native_decodes = attention_backend == "cpu" and native_kernels \
            and cpu_native.serves(fmt, compute_dtype_for(kv_dtype), block_size) \
            and cpu_native.prepare(self.config.head_dim, self.config.num_heads // self.config.num_kv_heads)
        # the C kernel's scores on the tile unit (kernels/native/amx_decode.h), for the startup line
        self.amx_scores = self.native_decodes and fmt.name == "auto" and cpu_native.tile_scores(
            kv_dtype, compute_dtype_for(kv_dtype), block_size, self.config.head_dim)
        # or by VDPBF16PS where the CPU has AVX512-BF16 and no AMX (kernels/native/bf16dp_decode.h)
        self.dot_scores = self.native_decodes and fmt.name == "auto" and cpu_native.dot_scores(
            kv_dtype, compute_dtype_for(kv_dtype), block_size, self.config.head_dim)
        # a bfloat16 layer's norms / RoPE / SwiGLU in C (kernels/cpu_glue.py), set per forward; a float32
        # model's only beside the fp16 packs (models/glue_forward.py), which already leave float32's exact tokens
        self.native_glue = attention_backend == "cpu" and native_kernels and self.device.type == "cpu" \
            and (kv_dtype == torch.bfloat16 or kv_dtype == torch.float32 and self.fp16_weights) \
            and build.load_glue() is not None
        # batch-1 decode steps in one C call (kernels/cpu_fused.py), or why not (the startup line says)
        self.fused_decode, self.fused_why_not = None, "off (--disable-native-kernels or not the cpu backend)"
        if attention_backend == "cpu" and native_kernels and self.device.type == "cpu":
            builder = getattr(model, "fused_decoder", None)
            fused = builder(self.layer_caches, block_size) if builder else "not in this architecture's model file"
            if isinstance(fused, str):
                self.fused_why_not = fused
            else:
                self.fused_decode, self.fused_why_not = fused, None
        if attention_backend == "triton" and self.device.type == "cuda":
            self.num_warmed_up = self.warm_up_kernels(kv_dtype, fmt.name, kv_scales is not None, max_model_len)
            if cuda_graphs and not fmt.k_per_block:  # int4: its store plans each step on the host
                self.enable_decode_graphs(capture=True)

    @property
    def attention_backend(self) -> str:
        """The backend name every step's AttentionMetadata carries (settable)."""
        return self.inputs.attention_backend

    @attention_backend.setter
    def attention_backend(self, name: str) -> None:
        self.inputs.attention_backend = name

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor,
                                                            AttentionMetadata | list[AttentionMetadata], list[int]]:
        """Flatten a step into model inputs.

        Returns:
            ``input_ids [T] int64``, ``positions [T] int64``, the attention metadata (one
            :class:`AttentionMetadata` with a single KV cache group, else a list with one per
            layer: its group's block tables and slot mapping), and ``logits_indices``: the flat
            index of the last token of each sequence that samples. The CPU tensors are views of
            persistent buffers, valid until the next call.
        """
        step = self.inputs.prepare(out)
        metas = step.metas
        meta = metas[0] if len(metas) == 1 else [metas[g] for g in self.layer_group]
        return step.input_ids, step.positions, meta, step.logits_indices

    @torch.inference_mode()
    def compute_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the model (after the step's context-shift re-rotations and copy-on-write block
        copies, in that order: a shift's source may be a copy's destination); return
        ``[num_sampling_seqs, vocab]`` float32 logits of the last position of every sequence
        with ``sample=True`` (batch order), on the model's device (a GPU samples them there)."""
        self.shift_blocks(out.blocks_to_shift, out.residuals_to_shift)
        self.copy_blocks(out.blocks_to_copy)
        self.copy_residuals(out.residual_copies)
        graphs = self.decode_graphs
        if graphs is not None and graphs.accepts(out):
            step = self.host_inputs.prepare(out)  # host tensors: the padded copies go to the static buffers
            hidden = graphs.replay(step) if graphs.graphs else graphs.run_eager(step)
            logits_indices = step.logits_indices
        else:
            input_ids, positions, meta, logits_indices = self.prepare_inputs(out)
            if logits_indices == [0] and self._fused_serves(meta) and meta.query_lens_cpu == [1]:
                return self._fused_step(input_ids, positions, meta)  # one decode token: the whole step in C
            hidden = self.forward(input_ids, positions, meta)
        if not logits_indices:
            return torch.empty(0, self.config.vocab_size)
        first, last = logits_indices[0], logits_indices[-1]
        if last - first == len(logits_indices) - 1:  # increasing indices, so a run of rows: a view, no gather
            hidden = hidden[first : last + 1]
        else:
            hidden = hidden[torch.tensor(logits_indices, device=hidden.device)]
        fp16_linear.active = self.fp16_weights
        logits = self.model.compute_logits(hidden).float()
        if self.measure_device_wait and graphs is not None and graphs.graphs and self.device.type == "cuda":
            t0 = time.perf_counter()
            torch.cuda.synchronize(self.device)
            self.device_wait_s += time.perf_counter() - t0
        return logits

    @torch.inference_mode()
    def prefill_logits(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                       block_tables: list[list[int]], residual_slots: list[int] | None = None) -> torch.Tensor:
        """Teacher forcing: run one sequence's chunk at positions ``num_computed_tokens..`` (its
        K/V stored first, then read back: store-then-read) and return the logits of *every*
        position, ``[len(token_ids), vocab]`` float32 on CPU. A one-token chunk runs as a batch-1
        decode step would (the fused kernel when on), so ``chunk=1`` measures that path.
        ``block_tables`` (one per KV cache group) must cover the chunk; ``residual_slots`` the
        request's int4 residual slots; nothing is sampled."""
        step = SchedulerOutput([ScheduledRequest(request_id, list(token_ids), num_computed_tokens, block_tables,
                                                 sample=True, is_prefill=True, residual_slots=residual_slots)])
        input_ids, positions, meta, _ = self.prepare_inputs(step)
        if len(token_ids) == 1 and self._fused_serves(meta):  # as a decode step would run
            return self._fused_step(input_ids, positions, meta)
        hidden = self.forward(input_ids, positions, meta)
        fp16_linear.active = self.fp16_weights
        return self.model.compute_logits(hidden).float().cpu()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The model over this runner's caches, ``[T, hidden]``, with this runner's choice of the C
        layer glue (:data:`llmd.kernels.cpu_glue.active`; engines sharing a model may differ)."""
        cpu_glue.active = self.native_glue
        fp16_linear.active = self.fp16_weights  # this engine's choice of the fp16 packs (quant/fp16_linear.py)
        return self.model(input_ids, positions, self.layer_caches, meta)

    def _fused_serves(self, meta) -> bool:
        """The fused decoder is on and the one-token step has a single KV cache group's metadata."""
        return self.fused_decode is not None and not isinstance(meta, list)

    def _fused_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``[1, vocab]`` float32 logits of a one-token step through :attr:`fused_decode`."""
        return self.fused_decode(int(input_ids[0]), int(positions[0]), int(meta.slot_mapping[0]),
                                 meta.block_tables[0], meta.seq_lens_cpu[0])

    def execute(self, out: SchedulerOutput, requests: Sequence[Request],
                rows: Sequence[int] | None = None) -> SamplerOutput | None:
        """Run one step and sample. ``requests`` are the sampling requests in batch order;
        ``rows`` (default ``0..len-1``) picks each one's logits row, so parallel-sampling
        siblings forking this step can draw from their leader's row.

        Returns:
            The sampler's output (one token per request) or None if none samples.
        """
        logits = self.compute_logits(out)
        if not requests:
            return None
        if rows is not None and (len(rows) != logits.shape[0] or any(r != i for i, r in enumerate(rows))):
            logits = logits[torch.tensor(list(rows), dtype=torch.long, device=logits.device)]
        return self.sampler(logits, requests)
