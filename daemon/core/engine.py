"""The engine: ``add_request`` / ``abort`` / ``step`` / ``make_stats``, in-process.

One step is schedule → run → postprocess (nano-vllm ``llm_engine.py``, vLLM v1
``EngineCore.step``): the scheduler picks requests, the runner computes logits and samples,
the scheduler appends tokens and frees finished requests, and the detokenizer turns new
tokens into safe text (stop strings end a request here).

The engine owns its inputs' one path to tokens (:class:`InputProcessor`), the parent ↔ child
ids of parallel-sampling requests (:class:`ParallelRequests`) and its statistics: the
counters and per-step events of :mod:`.stats`, which :meth:`Engine.make_stats` and
:meth:`Engine.take_iteration_stats` hand out (the daemon's engine loop publishes them).

One bad request never hurts the others: a row the sampler cannot sample (non-finite logits,
its own sampling raising) and an exception in one request's postprocessing (detokenizer,
stop strings) end that request alone with ``finish_reason="error"`` (blocks freed, the
others in the step go on), as vLLM's ``FinishReason.ERROR``. A step that raises as a whole is
the caller's to handle: :meth:`Engine.fail_requests` ends the live requests, and those that
left the scheduler in that very step before their output was made. The test-only fault
hooks are :mod:`.faults`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time

import torch

from llmd.daemon.core.beam import BeamSearch, check_beam_params, check_fits, final_outputs
from llmd.daemon.core.config import DEFAULT_KV_CACHE_MEMORY_CPU, DTYPES, EngineConfig
from llmd.daemon.core.detokenizer import IncrementalDetokenizer
from llmd.daemon.core.errors import LlmdError, RequestError, ServerBusyError
from llmd.daemon.core.faults import FaultInjector
from llmd.daemon.core.gpu_memory import activation_bytes, cuda_kv_cache_bytes
from llmd.daemon.core.grammar import GrammarCompiler, GrammarState
from llmd.daemon.core.input_processor import InputProcessor, ProcessedPrompt, Prompt, model_context
from llmd.daemon.core.kv_exchange import KVExchange
from llmd.daemon.core.kv_size import (
    group_summary,
    kv_cache_block_bytes,
    kv_cache_bytes_per_token,
    kv_residual_bytes,
    residual_slots,
)
from llmd.daemon.core.model_runner import ModelRunner
from llmd.daemon.core.outputs import RequestOutput, SchedulerOutput, TokenLogprobs
from llmd.daemon.core.parallel import ParallelRequests, sampling_rows
from llmd.daemon.core.request import Request, RequestStatus, SamplingParams
from llmd.daemon.core.scheduler import Scheduler
from llmd.daemon.core.stats import (
    EngineCounters,
    EngineStats,
    FinishedRequestStats,
    IterationStats,
    KVCacheGroupStats,
    KVCacheStats,
    PrefixCacheStats,
    RateWindow,
    RequestStats,
    SchedulerStats,
)
from llmd.daemon.kv import KVCacheManager, make_kv_cache_groups
from llmd.kernels.launch import check_triton_config
from llmd.models.config import ModelConfig
from llmd.models.tokenizer import Tokenizer
from llmd.quant import fp16_linear, prepacked
from llmd.quant.kv import KVCacheFormat, get_format
from llmd.quant.rotation import check_rotation

log = logging.getLogger("llmd.engine")
#: architectures whose activations overflow float16 (vLLM's ``_FLOAT16_NOT_SUPPORTED_MODELS``)
FLOAT16_OVERFLOWS = ("gemma2", "gemma3")


def float16_warning(architecture: str, dtype: str) -> str | None:
    """The startup warning for a model known to overflow float16, or None."""
    if dtype == "float16" and architecture in FLOAT16_OVERFLOWS:
        return (f"{architecture} is known to overflow float16 (inf/NaN logits end requests with finish_reason "
                "'error'); use --dtype bfloat16 or float32")
    return None


def num_kv_blocks(memory: int, block_size: int, block_bytes: int) -> int:
    """``floor(memory / block_bytes)``; raises LlmdError below 2 blocks."""
    n = memory // block_bytes
    if n < 2:
        raise LlmdError(f"--kv-cache-memory {memory} B holds {n} blocks of {block_size} tokens; need at least 2")
    return n



def check_triton_backend(cfg: ModelConfig, model_dtype: torch.dtype, block_size: int, kv_cache_dtype: str) -> None:
    """Refuse a model/cache combination the Triton kernels cannot run, at engine configuration
    (before the first launch): one line naming the setting. Raises LlmdError."""
    try:
        check_triton_config(cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, model_dtype, block_size, kv_cache_dtype)
    except ValueError as e:
        raise LlmdError(str(e)) from None

def check_kv_layout(cfg: ModelConfig, kv_cache_dtype: "str | KVCacheFormat", kv_rotation: str) -> None:
    """Refuse a head_dim the KV format's scale groups or the rotation cannot take (int4 and
    ``--kv-scale-group-size``: a multiple of the group; hadamard: a power of two), with one line.
    Raises LlmdError."""
    try:
        get_format(kv_cache_dtype).check_head_dim(cfg.head_dim)
        check_rotation(kv_rotation, cfg.head_dim)
    except ValueError as e:
        raise LlmdError(str(e)) from None


def glue_ops(model) -> str:
    """The layer ops of ``model`` that llmd's C glue runs (kernels/cpu_glue.py) for the startup
    line: RoPE always; RMSNorm unless it is Gemma's float32 one (``GemmaRMSNorm``, torch's);
    SwiGLU when every MLP is SiLU-gated (Gemma's GeLU-tanh stays torch's)."""
    from llmd.models.layers import GatedMLP, GemmaRMSNorm, RMSNorm

    mods = list(model.modules())
    ops = ["norms"] if any(type(m) is RMSNorm for m in mods) and not any(isinstance(m, GemmaRMSNorm) for m in mods) \
        else []
    ops.append("RoPE")
    mlps = [m for m in mods if isinstance(m, GatedMLP)]
    if mlps and all(m.act is torch.nn.functional.silu for m in mlps):
        ops.append("SwiGLU")
    return ", ".join(ops)


class Engine:
    """Continuous-batching engine over a paged KV cache.

    Build with :meth:`from_config` (loads model + tokenizer) or directly from an already
    loaded model (tests vary pool and scheduler sizes without reloading).

    Args:
        model: loaded llmd model (``model.config`` is its :class:`ModelConfig`).
        tokenizer: its :class:`Tokenizer`.
        config: :class:`EngineConfig` (resolved here).

    Attributes:
        input_processor: the prompt → token ids path and its length checks.
        parallel: parent ↔ child ids of the requests added with a ``parent_id``.
        counters: :class:`EngineCounters` since the engine was built.
        log_stats: keep per-step events (:meth:`take_iteration_stats`) for a consumer such as
            the daemon's metrics (off by default: nobody would take them).
    """

    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig):
        dtype_given = config.dtype not in (None, "auto")
        self.config = config.resolve()
        self.released_dense_bytes = 0  # from_config: float32 weight pages the fp16 packs replaced, handed back
        kv_dtype = next(model.parameters()).dtype
        loaded = next((k for k, v in DTYPES.items() if v == kv_dtype), self.config.dtype)
        if not dtype_given and loaded != self.config.dtype:  # a model loaded already: "auto" is its dtype
            self.config.dtype, self.config.dtype_auto = loaded, False
        self.config.apply_threads()  # torch.set_num_threads(--threads), once per engine
        self.thread_governor = None  # fewer threads while other processes keep our cores busy
        if self.config.device == "cpu" and getattr(self.config, "threads_auto", False) and self.config.threads > 1 \
                and os.environ.get("LLMD_ADAPTIVE_THREADS", "1") != "0":
            from llmd.daemon.core.thread_governor import ThreadGovernor

            self.thread_governor = ThreadGovernor(self.config.threads)
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        cfg = self.model_config
        if self.config.attention_backend == "triton":
            check_triton_backend(cfg, kv_dtype, self.config.block_size, self.config.kv_cache_dtype)
        fmt = self.config.kv_format
        check_kv_layout(cfg, fmt, self.config.kv_rotation)
        self.max_model_len = model_context(config.max_model_len, cfg.max_position)
        self.bytes_per_token = kv_cache_bytes_per_token(cfg, fmt, kv_dtype)
        self.kv_cache_groups = make_kv_cache_groups(cfg.layer_windows,
                                                    hybrid=not self.config.disable_hybrid_kv_cache_manager)
        self.block_bytes = kv_cache_block_bytes(cfg, self.kv_cache_groups, config.block_size, fmt, kv_dtype)
        memory = config.kv_cache_memory
        if memory is None:
            if self.config.device.startswith("cuda"):  # --gpu-memory-utilization of the device's total
                free, total = torch.cuda.mem_get_info(torch.device(self.config.device))
                graphs = not self.config.enforce_eager and not fmt.k_per_block  # int4 decodes run eager
                act = activation_bytes(cfg, self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                       kv_dtype.itemsize, graphs)
                memory = cuda_kv_cache_bytes(self.config.gpu_memory_utilization, total, free, act)
            else:
                memory = DEFAULT_KV_CACHE_MEMORY_CPU
        num_residual = residual_slots(self.kv_cache_groups, self.config.max_num_seqs) if fmt.k_per_block else 0
        self.residual_bytes = kv_residual_bytes(cfg, self.kv_cache_groups, config.block_size,
                                                self.config.kv_cache_dtype, self.config.max_num_seqs)
        if memory - self.residual_bytes < 2 * self.block_bytes:
            if self.residual_bytes:
                raise LlmdError(f"--kv-cache-memory {memory} B leaves no room for blocks beside int4's open-block "
                                f"residual ({self.residual_bytes} B for --max-num-seqs {self.config.max_num_seqs}); "
                                f"raise --kv-cache-memory or lower --max-num-seqs")
            raise LlmdError(f"--kv-cache-memory {memory} B holds fewer than 2 KV blocks of {self.block_bytes} B "
                            f"({config.block_size} tokens x {cfg.num_layers} layers, {self.config.kv_cache_dtype}); "
                            f"give at least {2 * self.block_bytes} B")
        self.num_blocks = num_kv_blocks(memory - self.residual_bytes, config.block_size, self.block_bytes)
        if self.residual_bytes:  # int4: the residual's share of the pool, spread over its tokens
            self.bytes_per_token = round(self.bytes_per_token * (1 + self.residual_bytes /
                                                                 (self.num_blocks * self.block_bytes)))
        self.kv_cache_memory = memory
        self.kv_manager = KVCacheManager(
            self.num_blocks, config.block_size, self.kv_cache_groups, enable_caching=self.config.enable_prefix_caching,
            prefix_cache_seed=self.config.prefix_cache_seed,
            model_id=f"{cfg.name}|{cfg.architecture}|{self.config.dtype}",
            kv_cache_dtype=f"{fmt.scheme}|{self.config.kv_scales}|{self.config.kv_rotation}",
            num_residual_slots=num_residual,
        )
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.config.max_prefill_chunk, self.config.max_num_waiting,
                                   scheduling_policy=self.config.scheduling_policy)
        self.runner = ModelRunner(
            model, self.num_blocks, config.block_size, kv_dtype, self.config.device,
            fmt, self.config.kv_scales, self.config.attention_backend, self.kv_cache_groups,
            max_num_seqs=self.config.max_num_seqs, max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len, cuda_graphs=not self.config.enforce_eager,
            kv_rotation=self.config.kv_rotation, residual_slots=num_residual,
            cascade_attn=not self.config.disable_cascade_attn,
            native_kernels=not self.config.disable_native_kernels,
            fp16_weights=getattr(self.config, "fp16_weights", False),
        )
        self.input_processor = InputProcessor(tokenizer, cfg.vocab_size, self.max_model_len,
                                              self.config.context_overflow, self.config.keep, self.config.block_size)
        if self.config.context_overflow == "shift" and self.config.keep > self.input_processor.max_keep:
            raise LlmdError(f"--keep {self.config.keep} leaves no whole block of the {self.max_model_len}-token "
                            f"context to discard: at most {self.input_processor.max_keep} (or -1, the prompt)")
        # structured outputs (None for a tokenizer-less engine, e.g. llmd bench step's, which adds no requests)
        self.grammars = (GrammarCompiler(tokenizer.hf, cfg.vocab_size, tokenizer.eos_token_ids)
                         if tokenizer is not None else None)
        self.parallel = ParallelRequests()
        self.beams = BeamSearch()  # use_beam_search requests (beam.py)
        self.kv_exchange = KVExchange(self)  # prefill/decode disaggregation: pins, pulls, imports
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.last_scheduler_output: SchedulerOutput | None = None
        self._ids = itertools.count()
        self.counters = EngineCounters()
        self.rates = RateWindow(time.monotonic())
        self.log_stats = False
        self._iteration = IterationStats()
        self._runtime: str | None = None  # runtime_summary(), for make_stats
        self._unreported: dict[str, Request] = {}  # this step's requests whose output is not made yet
        self.faults: FaultInjector | None = None  # test hooks (faults.py); None in production
        injector = FaultInjector.from_env()
        if injector is not None:
            log.warning("fault injection is on (%s); for tests only", injector.faults)
            injector.install(self)
        warning = float16_warning(cfg.architecture, self.config.dtype)
        if warning:
            log.warning(warning)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        """Resolve the model, load weights and tokenizer, allocate the KV cache.

        Raises:
            LlmdError: unknown model, bad GGUF, bad setting.
        """
        config.resolve()
        config.apply_threads()  # the weight dequantization runs on these threads too
        if config.model.startswith("random:"):  # a random-weight preset: no GGUF, no gguf (llmd.models.presets)
            from llmd.models.presets import load_random_model

            model, _, tokenizer = load_random_model(config.model, config.torch_dtype, config.device)
            return cls(model, tokenizer, config)
        from llmd.models import weights_cache
        from llmd.models.gguf_loader import load_model
        from llmd.models.header_cache import header_info
        from llmd.models.registry import resolve_model
        from llmd.models.tokenizer import load_tokenizer

        path = resolve_model(config.model)
        fused = config.settle_weight_quant(header_info(path).config)
        model, cfg = load_model(path, config.torch_dtype, config.device, config.weight_quant, config.keep_dense,
                                weights_cache=weights_cache.enabled(),  # a warm start maps the converted weights
                                native=fused)
        tokenizer = load_tokenizer(path, cfg, header_info(path).data_offset)
        engine = cls(model, tokenizer, config)
        if engine.runner.fp16_weights:  # this engine owns the model: the packs replace its float32 weights
            engine.released_dense_bytes = fp16_linear.release_dense_pages(model)
        return engine

    def capacity_summary(self) -> str:
        """One line: bytes/token, blocks, KV cache groups, and how many full-context sequences fit."""
        from llmd.daemon.core.kv_size import blocks_per_sequence

        bs = self.config.block_size
        per_seq = blocks_per_sequence(self.kv_cache_groups, self.max_model_len, bs, 1)
        return (
            f"KV cache: {self.bytes_per_token} B/token ({self._kv_dtype_label()}), {self.num_blocks} blocks of "
            f"{bs} tokens x {max(len(g.layer_ids) for g in self.kv_cache_groups)} layers "
            f"({self.kv_cache_memory / 2**20:.0f} MiB); {group_summary(self.kv_cache_groups, bs)}; "
            f"{(self.num_blocks - 1) / per_seq:.2f} sequences of {self.max_model_len} tokens"
        )

    def runtime_summary(self) -> str:
        """The chosen dtype, attention backend and torch threads, e.g.
        ``dtype bfloat16 (auto: native bf16 on this CPU), attention cpu, 2 threads``."""
        from llmd.daemon.core.config import cpu_has_native_bf16

        c = self.config
        why = ""
        if getattr(c, "dtype_auto", False):
            on_cuda = c.device.startswith("cuda")
            why = " (auto: CUDA)" if on_cuda else (" (auto: native bf16 on this CPU)" if cpu_has_native_bf16()
                                                   else " (auto: no native bf16 on this CPU)")
        threads = f"{c.threads} thread{'' if c.threads == 1 else 's'}"
        if self.thread_governor is not None:
            threads += " (fewer while other processes keep cores busy)"
        wq = getattr(self.runner.model, "weight_quant_summary", None)
        weights = f", {wq.describe()}" if wq is not None and wq.mode != "none" else ""
        attn = c.attention_backend
        if attn == "cpu":  # who runs the decodes (kernels/cpu_native.py), and why not the C kernel
            from llmd.kernels import cpu_native
            from llmd.kernels.cpu_attention import compute_dtype_for
            from llmd.kernels.native import build

            mc = self.model_config
            limit = cpu_native.unserved_reason(c.kv_format, compute_dtype_for(c.torch_dtype), c.block_size,
                                               mc.head_dim, mc.num_heads // mc.num_kv_heads)
            reason = ("--disable-native-kernels" if c.disable_native_kernels else build.why_not or limit
                      or "not for this model dtype, KV format, block size or shape")
            attn += " (decodes: C kernel" if self.runner.native_decodes else f" (decodes: torch ops, {reason}"
            if self.runner.native_decodes and self.runner.amx_scores:
                attn += ", scores on AMX tiles"
            elif self.runner.native_decodes and self.runner.dot_scores:
                attn += ", scores by VDPBF16PS"
            if self.runner.fused_decode is not None:  # kernels/cpu_fused.py: the whole batch-1 step in C
                attn += "; batch-1 steps: fused C kernel"
            elif c.weight_quant == "gguf":
                attn += f"; batch-1 steps: torch ops, {self.runner.fused_why_not}"
            if self.runner.native_glue:  # kernels/cpu_glue.py; models/glue_forward.py fuses them across ops
                from llmd.models import glue_forward

                fused = glue_forward.why_not(self.runner.model, self.runner.layer_caches, check_active=False) is None
                if fused or c.dtype == "bfloat16":  # a float32 model's glue exists only fused (layer_glue_f32.h)
                    attn += f"; {glue_ops(self.runner.model)}: C" + (", fused across ops" if fused else "")
            attn += ")"
        packed = prepacked.packed_count(self.runner.model)
        copy = prepacked.head_copy_bytes(self.runner.model)
        head = f" (the tied LM head's as a copy, +{copy / 2**20:.0f} MiB)" if copy else ""
        amx = prepacked.amx_count(self.runner.model)
        kind = "for AMX tiles" if amx == packed else f"({amx} for AMX tiles, {packed - amx} for oneDNN)" if amx \
            else "for oneDNN"
        linears = f", linears: {packed} bf16 weights prepacked {kind}{head}" if packed else ""
        fp16, fp16_bytes = fp16_linear.packed_count(self.runner.model)
        if fp16 and self.runner.fp16_weights:
            released = self.released_dense_bytes
            gone = f"; their float32 pages, {released / 2**20:.0f} MiB, handed back (MADV_PAGEOUT)" if released else ""
            linears += f", linears: {fp16} float32 weights as fp16 for fbgemm (+{fp16_bytes / 2**20:.0f} MiB{gone})"
        return f"dtype {c.dtype}{why}, attention {attn}, {threads}{linears}{weights}"

    def _kv_dtype_label(self) -> str:
        c = self.config
        if c.kv_cache_dtype == "auto":
            return c.dtype
        fmt = c.kv_format
        if not fmt.quantized:  # float16 / bfloat16: no scales
            return f"{c.kv_cache_dtype}, {c.dtype} model"
        scales = (f"static scales k={c.kv_scales[0]:g}, v={c.kv_scales[1]:g}" if c.kv_scales
                  else f"dynamic {str(fmt.scale_dtype).removeprefix('torch.')} scales")
        if fmt.k_per_block:
            scales = (f"K per channel over each {c.block_size}-token block (float16 scale + zero point), "
                      f"V per {fmt.group_size} channels; open blocks' K in a 16-bit residual "
                      f"({self.residual_bytes / 2**20:.1f} MiB, {self.kv_manager.num_residual_slots} slots)")
        elif fmt.group_size:
            scales += f" per {fmt.group_size} channels"
        rotation = "" if c.kv_rotation == "none" else f", {c.kv_rotation} rotation"
        full = kv_cache_block_bytes(self.model_config, self.kv_cache_groups, c.block_size, "auto", torch.bfloat16)
        multiple = (self.num_blocks / max(1, self.kv_cache_memory // full) if fmt.k_per_block
                    else full / self.block_bytes)
        return (f"{c.kv_cache_dtype} + {scales}{rotation}, {multiple:.2f}x the blocks of "
                f"16-bit; attention {c.attention_backend}")

    # ---- requests -----------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    cache_salt: str | None = None, priority: int = 0) -> str:
        """Tokenize (text or chat messages, see :class:`InputProcessor`), validate and queue a
        request; returns its id.

        Raises:
            RequestError: empty prompt, prompt longer than ``max_model_len``, prompt +
                max_tokens beyond ``max_model_len``, a request that can never fit in the KV
                pool, or a bad sampling parameter (``param`` names the field);
                :class:`ServerBusyError` when the waiting queue is full.
            LlmdError: chat messages for a model without a chat template.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        return self.add_parallel_request(prompt, params, [request_id], cache_salt, priority)[0]

    def add_parallel_request(self, prompt: Prompt, params: SamplingParams | None, request_ids: list[str],
                             cache_salt: str | None = None, priority: int = 0,
                             parent_id: str | None = None, grammar=None, kv_export: tuple[str, float] | None = None,
                             kv_import=None, kv_fallback: tuple[str, str] | None = None) -> list[str]:
        """Queue ``len(request_ids)`` sequences of one prompt (parallel sampling, OpenAI ``n``).

        ``params.structured`` constrains each sequence with its own grammar matcher; ``grammar``
        is its compiled grammar when the caller compiled it already (the daemon, on its
        tokenizer pool), else it is compiled here (:attr:`grammars`, cached per spec).

        The prompt is prefilled once; the siblings then share its blocks by reference count
        and sample with generators derived from (seed, sibling index, output position) (the
        policy of :mod:`llmd.daemon.core.parallel`). With ``parent_id``, :attr:`parallel`
        records the children under it (:meth:`abort` takes it; it must not be live already).
        ``kv_export``, ``kv_import``, ``kv_fallback``: prefill/decode disaggregation
        (:meth:`KVExchange.attach <llmd.daemon.core.kv_exchange.KVExchange.attach>`).
        Raises as :meth:`add_request`; every refusal counts in ``counters.requests_rejected``.
        """
        try:
            return self._add(prompt, params or SamplingParams(), list(request_ids), cache_salt, priority, parent_id,
                             grammar, (kv_export, kv_import, kv_fallback))
        except LlmdError:
            self.counters.requests_rejected += 1
            raise

    def _add(self, prompt: Prompt, params: SamplingParams, request_ids: list[str], cache_salt: str | None,
             priority: int, parent_id: str | None, grammar=None, kv=(None, None, None)) -> list[str]:
        if parent_id is not None:
            self.parallel.check_new(parent_id)
        params.validate()
        if params.use_beam_search:
            check_beam_params(params, len(request_ids))
        if params.structured is not None and grammar is None:
            grammar = self.grammars.compile(params.structured)
        # a ProcessedPrompt comes from the engine loop's tokenizer thread (process() already ran there)
        processed = prompt if isinstance(prompt, ProcessedPrompt) else self.input_processor.process(prompt, params)
        ids = processed.token_ids
        eos = frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        reqs = [Request(rid, list(ids), dataclasses.replace(params), eos_token_ids=eos, cache_salt=cache_salt,
                        sibling_index=i, priority=priority, grammar=None if grammar is None else GrammarState(grammar))
                for i, rid in enumerate(request_ids)]  # each sibling its own matcher
        if kv != (None, None, None):
            self.kv_exchange.attach(reqs, *kv)
        try:
            if params.use_beam_search:
                check_fits(self.scheduler, reqs[0], len(reqs))
            self.scheduler.add_request(reqs[0], reqs[1:])
        except RequestError as e:
            if processed.max_tokens_defaulted and not isinstance(e, ServerBusyError):
                raise e.with_hint(" (max_tokens was not given, so it defaulted to the remaining context, "
                                  f"{params.max_tokens})") from None
            raise
        if params.use_beam_search:
            self.beams.add(reqs, self.max_model_len)
        if parent_id is not None:
            self.parallel.add(parent_id, request_ids)
        for rid in request_ids:
            self.detokenizers[rid] = IncrementalDetokenizer(self.tokenizer.hf, ids, params.stop,
                                                            min_tokens=params.min_tokens)
        return request_ids

    def reset_prefix_cache(self) -> int:
        """Drop cached blocks that are free (blocks in use stay); returns how many."""
        return self.kv_manager.reset_prefix_cache()

    def abort(self, request_id: str) -> bool:
        """Abort a request (a parent id: all its live sequences) and free its blocks; returns
        False if nothing was live."""
        return bool(self.abort_requests(self.parallel.members(request_id)))

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort these sequences; returns the final ``finish_reason="abort"`` output of each one
        that was live."""
        outputs = []
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            self.detokenizers.pop(rid, None)
            self._finished(req, "abort")
            outputs.append(RequestOutput(request_id=rid, finished=True, finish_reason="abort", index=req.sibling_index,
                                         num_prompt_tokens=req.total_prompt_tokens,
                                         num_output_tokens=req.num_output_tokens))
        return outputs

    def fail_requests(self, request_ids: list[str], message: str) -> list[RequestOutput]:
        """End these sequences with ``finish_reason="error"`` and free their blocks: the live
        ones, and those that left the scheduler in a step that raised before their output was
        made (they are not live, yet their callers still wait for a last output). Returns the
        final output of each one found (``error`` = ``message``)."""
        outputs = []
        for rid in request_ids:
            unreported = self._unreported.pop(rid, None)
            req = self.scheduler.requests.get(rid) or unreported
            if req is not None:
                outputs.append(self._fail(req, message))
        return outputs

    def _fail(self, req: Request, message: str) -> RequestOutput:
        self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)  # ignored if gone already
        self.detokenizers.pop(req.request_id, None)
        self._finished(req, "error")
        log.warning("request %s failed: %s", req.request_id, message)
        return RequestOutput(request_id=req.request_id, finished=True, finish_reason="error", error=message,
                             num_prompt_tokens=req.total_prompt_tokens, num_output_tokens=req.num_output_tokens,
                             num_cached_tokens=req.num_cached_tokens, index=req.sibling_index)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def requests(self) -> dict[str, Request]:
        """The live sequences by id (read only)."""
        return self.scheduler.requests

    # ---- one iteration ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; returns an output for every request that produced a
        token (or finished, ``finish_reason="error"`` included) in it.

        Raises whatever the forward or the scheduler raises (the step as a whole failed: see
        :meth:`fail_requests`); one request's own failure is its ``error`` output instead."""
        sched = self.scheduler.schedule()
        self.last_scheduler_output = sched
        if not sched:
            return []
        if self.thread_governor is not None:
            self.thread_governor.tick()  # every 0.5 s: a /proc/stat read, maybe torch.set_num_threads
        reqs = {s.request_id: self.scheduler.requests[s.request_id] for s in sched.scheduled}
        self.kv_exchange.apply_scheduled(reqs)  # pulled KV into the blocks admitted with it, before the forward
        sampling, rows = sampling_rows(sched.scheduled, reqs)  # followers fork now: their leader's row
        previous_token_times = [r.last_token_time for r in sampling]
        result = self.runner.execute(sched, sampling, rows)
        sampled, logprobs, outputs = {}, {}, []
        if result is not None:
            for b, (req, tok, lp) in enumerate(zip(sampling, result.sampled_token_ids, result.logprobs)):
                if b in result.failed:  # fails before its token is appended: the scheduler skips it
                    outputs.append(self._fail(req, result.failed[b]))
                else:
                    sampled[req.request_id], logprobs[req.request_id] = tok, lp
        beam_groups = self.beams.take_reports(sampling, sampled, logprobs)  # beams get no token from the scheduler
        if outputs or beam_groups:
            kept = [(r, t) for r, t in zip(sampling, previous_token_times) if r.request_id in sampled]
            sampling, previous_token_times = [r for r, _ in kept], [t for _, t in kept]
        self._unreported = {req.request_id: req for req in sampling}
        self.scheduler.update_from_output(sched, sampled)
        if beam_groups:
            outputs += self._advance_beams(beam_groups)
        if self.faults is not None:
            self.faults.check_step(sampling)
        self._record_step(sched.num_prefill_tokens, sampling, previous_token_times)
        for req in sampling:
            try:
                outputs.append(self._postprocess(req, sampled[req.request_id], logprobs[req.request_id]))
            except Exception as e:  # this request fails alone; the rest of the step goes on
                log.exception("postprocessing %s failed", req.request_id)
                outputs.append(self._fail(req, f"postprocessing failed: {type(e).__name__}: {e}"))
            self._unreported.pop(req.request_id, None)
        return outputs

    def _advance_beams(self, groups: list) -> list[RequestOutput]:
        """Step the beam-search groups whose beams all reported (:mod:`.beam`); the final
        outputs of those that ended: slot ``i`` carries the ``i``-th best beam, all its tokens
        and text in one output."""
        outputs = []
        for g, live in self.beams.advance(groups, self.scheduler):
            for req, hyp in final_outputs(g, live):
                status = RequestStatus.FINISHED_STOPPED if hyp.stopped else RequestStatus.FINISHED_LENGTH
                req.token_ids[req.num_prompt_tokens:] = hyp.output_token_ids
                req.stop_reason = hyp.output_token_ids[-1] if hyp.stopped else None
                self.scheduler.finish_request(req.request_id, status)
                detok = self.detokenizers.pop(req.request_id)
                text = detok.update(hyp.output_token_ids[:-1] if hyp.stopped else hyp.output_token_ids) + detok.finish()
                self._finished(req, status.finish_reason)
                outputs.append(RequestOutput(
                    request_id=req.request_id, new_token_ids=list(hyp.output_token_ids), new_text=text,
                    logprobs=[None] * len(hyp.output_token_ids), finished=True, finish_reason=status.finish_reason,
                    num_prompt_tokens=req.total_prompt_tokens, num_output_tokens=req.num_output_tokens,
                    num_cached_tokens=req.num_cached_tokens, index=req.sibling_index))
        return outputs

    def _postprocess(self, req: Request, token: int, lp: TokenLogprobs | None) -> RequestOutput:
        if self.faults is not None:
            self.faults.check_postprocess(req)
        detok = self.detokenizers[req.request_id]
        # a stop token (stop_token_ids, EOS) ends the text without its own, as vLLM's detokenizer
        # leaves it out; its id and logprob stay in the output
        text = "" if req.is_finished and req.stop_reason == token else detok.update([token])
        if detok.stop_matched is not None and not req.is_finished:
            req.stop_reason = detok.stop_matched
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        if req.is_finished:
            if detok.stop_matched is None:
                text += detok.finish()
            if detok.stop_matched is not None and req.status == RequestStatus.FINISHED_LENGTH:
                # the last token completed a stop string (or finish() found one): the text is cut
                # there, so "stop", as vLLM reports it
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, detok.stop_matched
            del self.detokenizers[req.request_id]
            self._finished(req, req.status.finish_reason)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_text=text,
            logprobs=[lp],
            finished=req.is_finished,
            finish_reason=req.status.finish_reason,
            num_prompt_tokens=req.total_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            index=req.sibling_index,
            kv_transfer_params=self.kv_exchange.on_finished(req) if req.is_finished else None,
        )

    # ---- statistics (engine thread) -------------------------------------------------
    def _record_step(self, num_prompt_tokens: int, sampling: list[Request], previous_token_times: list) -> None:
        """Count one step: prefill tokens computed, one token per sampling request, and (with
        :attr:`log_stats`) each one's first-token or inter-token latency."""
        self.counters.prompt_tokens += num_prompt_tokens
        self.counters.generation_tokens += len(sampling)
        self.rates.add(time.monotonic(), num_prompt_tokens, len(sampling))
        if not self.log_stats:
            return
        it = self._iteration
        it.num_prompt_tokens += num_prompt_tokens
        it.num_generation_tokens += len(sampling)
        for req, previous in zip(sampling, previous_token_times):
            if previous is None:
                it.time_to_first_tokens_s.append(req.first_token_time - req.arrival_time)
            else:
                it.inter_token_latencies_s.append(req.last_token_time - previous)

    def _finished(self, req: Request, reason: str | None) -> None:
        reason = reason or "abort"
        self.counters.requests_finished[reason] += 1
        self.parallel.finished(req.request_id)
        self.beams.finished(req.request_id)
        if self.log_stats:
            self._iteration.finished.append(
                FinishedRequestStats(req.request_id, reason, time.monotonic() - req.arrival_time))

    def take_iteration_stats(self) -> IterationStats:
        """The events since the last call (empty unless :attr:`log_stats`)."""
        it, self._iteration = self._iteration, IterationStats()
        return it

    def make_stats(self) -> EngineStats:
        """A snapshot of the KV cache, prefix cache, scheduler, live requests and counters
        (O(blocks + live requests))."""
        now = time.monotonic()
        kv, sched = self.kv_manager, self.scheduler
        cached_free = kv.block_pool.num_cached_free_blocks
        total, used, free = kv.num_usable_blocks, kv.num_used_blocks, kv.num_free_blocks - cached_free
        groups = [KVCacheGroupStats(g.name, g.sliding_window, list(g.layer_ids), total, n, free, n / max(1, total))
                  for g, n in zip(kv.groups, kv.num_used_blocks_per_group())]
        requests = [RequestStats(
            id=req.request_id, state="running" if req.status == RequestStatus.RUNNING else "waiting",
            prompt_tokens=req.total_prompt_tokens, cached_tokens=req.num_cached_tokens,
            generated_tokens=req.num_output_tokens, blocks=kv.num_blocks_held(req.request_id),
            block_table=kv.get_block_table(req.request_id), block_tables=kv.get_block_tables(req.request_id),
            ttft_s=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            age_s=now - req.arrival_time, preemptions=req.num_preemptions, priority=req.priority,
        ) for req in [*sched.running, *sched.waiting]]
        counters = self.counters.copy()
        counters.num_preemptions = sched.num_preemptions
        c = self.config
        prompt_rate, generation_rate = self.rates.rates(now)
        if self._runtime is None:  # fixed once the engine is built; walks the model's weights once
            self._runtime = self.runtime_summary()
        runtime, g = self._runtime, self.thread_governor
        if g is not None and g.threads < g.max_threads:  # llmd status's engine: line says so
            runtime += (f"; now {g.threads} thread{'' if g.threads == 1 else 's'}: other processes kept "
                        f"~{g.others:.1f} of {g.max_threads} cores busy")
        return EngineStats(
            runtime=runtime,
            kv_cache_dtype=c.dtype if c.kv_cache_dtype == "auto" else c.kv_cache_dtype,
            kv_cache=KVCacheStats(kv.block_size, kv.num_blocks, total, used, cached_free, free, self.bytes_per_token,
                                  self.num_blocks * self.block_bytes, kv.usage, groups, kv.block_pool.block_states()),
            prefix_cache=PrefixCacheStats(kv.prefix_cache_queries, kv.prefix_cache_hits, kv.enable_caching,
                                          kv.block_pool.num_evictions),
            scheduler=SchedulerStats(len(sched.running), len(sched.waiting),
                                     sum(1 for r in sched.waiting if r.num_preemptions), sched.num_context_shifts),
            prompt_tokens_per_s=prompt_rate, generation_tokens_per_s=generation_rate,
            counters=counters, requests=requests, kv_transfer=self.kv_exchange.stats(),
        )

    # ---- teacher forcing (``llmd bench kv-quality``) ----------------------------------
    def teacher_forced_logits(self, ids: list[int], chunk: int = 64, cached_prefix: int = 0) -> torch.Tensor:
        """Logits of every position of ``ids``, prefilled ``chunk`` tokens per step through the
        paged cache (store-then-read), outside the scheduler (nothing else may be running).

        ``cached_prefix`` > 0 serves the prefix from the prefix cache: a first sequence computes
        ``ids[:cached_prefix]`` and leaves its full blocks cached; the sequence of all of ``ids``
        then looks its prefix up as the scheduler does at admission, shares those blocks
        (prefix cache hit) and computes only the rest, in the same chunk boundaries when
        ``cached_prefix`` is a multiple of ``chunk``. The logits are the first sequence's
        followed by the second's.

        Returns:
            ``[len(ids), vocab]`` float32 (CPU).
        Raises:
            RuntimeError: the pool cannot hold ``ids``, or (``cached_prefix``) prefix caching is
                off or the lookup hit fewer than the prefix's full blocks.
        """
        mgr = self.kv_manager
        if not cached_prefix:
            return self._teacher_forced_chunks("kv-quality", ids, 0, [], chunk)
        if not mgr.enable_caching:
            raise RuntimeError("cached_prefix needs prefix caching (enable_prefix_caching)")
        head = self._teacher_forced_chunks("kv-quality-prefix", ids[:cached_prefix], 0, [], chunk, cache=True)
        hit, blocks = mgr.get_computed_blocks("kv-quality", ids, len(ids))
        want = cached_prefix // mgr.block_size * mgr.block_size
        if hit != want:
            raise RuntimeError(f"prefix cache hit {hit} tokens, expected {want}")
        return torch.cat([head[:hit], self._teacher_forced_chunks("kv-quality", ids, hit, blocks, chunk)])

    def _teacher_forced_chunks(self, rid: str, ids: list[int], start: int, hit_blocks: list, chunk: int,
                               cache: bool = False) -> torch.Tensor:
        """Logits ``[len(ids) - start, vocab]`` of positions ``start..``: ``start`` tokens are
        prefix cache hits (``hit_blocks`` from ``get_computed_blocks``), the rest computed in
        ``chunk``s. ``cache``: register the full blocks in the prefix cache before freeing them."""
        mgr = self.kv_manager
        if mgr.allocate_slots(rid, len(ids), start or None, hit_blocks if start else None) is None:
            raise RuntimeError(f"KV pool too small for {len(ids)} tokens")
        try:
            tables = mgr.get_block_tables(rid)
            res = mgr.residual_slots(rid)
            out = [self.runner.prefill_logits(rid, ids[pos : pos + chunk], pos, tables, res)
                   for pos in range(start, len(ids), chunk)]
            if cache:
                mgr.cache_blocks(rid, ids, len(ids))
            return torch.cat(out)
        finally:
            mgr.free(rid)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]) -> list[dict]:
        """Run prompts to completion (tests, benchmarks). Returns per prompt a dict with
        ``token_ids``, ``text``, ``finish_reason``, in prompt order."""
        plist = params if isinstance(params, list) else [SamplingParams(**vars(params)) for _ in prompts]
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        results = {i: {"token_ids": [], "text": "", "finish_reason": None} for i in ids}
        while self.has_unfinished_requests():
            for o in self.step():
                r = results[o.request_id]
                r["token_ids"] += o.new_token_ids
                r["text"] += o.new_text
                r["finish_reason"] = o.finish_reason
        return [results[i] for i in ids]
