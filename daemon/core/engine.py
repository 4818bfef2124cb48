"""The engine: ``add_request`` / ``abort`` / ``step``, in-process.

One step is schedule → run → postprocess (nano-vllm ``llm_engine.py``, vLLM v1
``EngineCore.step``): the scheduler picks requests, the runner computes logits and samples,
the scheduler appends tokens and frees finished requests, and the detokenizer turns new
tokens into safe text (stop strings end a request here).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field

import torch

from llmd.daemon.core.config import CUDA_KV_CACHE_FRACTION, DEFAULT_KV_CACHE_MEMORY_CPU, DTYPES, EngineConfig
from llmd.daemon.core.detokenizer import IncrementalDetokenizer
from llmd.daemon.kv import KVCacheManager, make_kv_cache_groups
from llmd.daemon.core.kv_size import group_summary, kv_block_bytes, kv_cache_bytes_per_token
from llmd.daemon.core.request import Request, RequestStatus, SamplingParams
from llmd.daemon.core.model_runner import ModelRunner
from llmd.daemon.core.sampler import TokenLogprobs
from llmd.daemon.core.scheduler import QueueFullError, Scheduler, SchedulerOutput
from llmd.models.config import ModelConfig
from llmd.models.errors import LlmdError, ServerBusyError
from llmd.models.tokenizer import Tokenizer

log = logging.getLogger("llmd.engine")


@dataclass
class RequestOutput:
    """What one step produced for one request (a streaming delta).

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated this step.
        new_text: text released this step (UTF-8 safe, stop strings withheld).
        logprobs: per new token, :class:`TokenLogprobs` or None.
        finished: True on the request's last output.
        finish_reason: "stop", "length", "abort" or None.
        num_prompt_tokens, num_output_tokens: token counts so far.
        num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


def num_kv_blocks(memory: int, block_size: int, block_bytes: int) -> int:
    """``floor(memory / block_bytes)``; raises LlmdError below 2 blocks."""
    n = memory // block_bytes
    if n < 2:
        raise LlmdError(f"--kv-cache-memory {memory} B holds {n} blocks of {block_size} tokens; need at least 2")
    return n


class Engine:
    """Continuous-batching engine over a paged KV cache.

    Build with :meth:`from_config` (loads model + tokenizer) or directly from an already
    loaded model (tests vary pool and scheduler sizes without reloading).

    Args:
        model: loaded llmd model (``model.config`` is its :class:`ModelConfig`).
        tokenizer: its :class:`Tokenizer`.
        config: :class:`EngineConfig` (resolved here).
    """

    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig):
        dtype_given = config.dtype not in (None, "auto")
        self.config = config.resolve()
        kv_dtype = next(model.parameters()).dtype
        loaded = next((k for k, v in DTYPES.items() if v == kv_dtype), self.config.dtype)
        if not dtype_given and loaded != self.config.dtype:  # a model loaded already: "auto" is its dtype
            self.config.dtype, self.config.dtype_auto = loaded, False
        self.config.apply_threads()  # torch.set_num_threads(--threads), once per engine
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        cfg = self.model_config
        self.max_model_len = min(config.max_model_len or cfg.max_position, cfg.max_position)
        self.bytes_per_token = kv_cache_bytes_per_token(cfg, self.config.kv_cache_dtype, kv_dtype)
        self.kv_cache_groups = make_kv_cache_groups(cfg.sliding_window or (None,) * cfg.num_layers,
                                                    hybrid=not self.config.disable_hybrid_kv_cache_manager)
        from llmd.quant.kv import get_format

        fmt = get_format(self.config.kv_cache_dtype)
        self.block_bytes = kv_block_bytes(cfg, self.kv_cache_groups, config.block_size,
                                          fmt.bytes_per_element(kv_dtype), fmt.scale_bytes)
        memory = config.kv_cache_memory
        if memory is None:
            if self.config.device.startswith("cuda"):
                memory = int(torch.cuda.mem_get_info()[0] * CUDA_KV_CACHE_FRACTION)
            else:
                memory = DEFAULT_KV_CACHE_MEMORY_CPU
        self.num_blocks = num_kv_blocks(memory, config.block_size, self.block_bytes)
        self.kv_cache_memory = memory
        self.kv_manager = KVCacheManager(
            self.num_blocks, config.block_size, self.kv_cache_groups, enable_caching=self.config.enable_prefix_caching,
            prefix_cache_seed=self.config.prefix_cache_seed, model_id=f"{cfg.name}|{cfg.architecture}|{self.config.dtype}",
            kv_cache_dtype=f"{self.config.kv_cache_dtype}|{self.config.kv_scales}",
        )
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   self.config.max_prefill_chunk, self.config.max_num_waiting)
        self.runner = ModelRunner(
            model, self.num_blocks, config.block_size, kv_dtype, self.config.device,
            self.config.kv_cache_dtype, self.config.kv_scales, self.config.attention_backend, self.kv_cache_groups,
            max_num_seqs=self.config.max_num_seqs, max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.last_scheduler_output: SchedulerOutput | None = None
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        """Resolve the model, load weights and tokenizer, allocate the KV cache.

        Raises:
            LlmdError: unknown model, bad GGUF, bad setting.
        """
        from llmd.models.gguf_loader import load_model, open_gguf
        from llmd.models.registry import resolve_model
        from llmd.models.tokenizer import load_tokenizer

        config.resolve()
        config.apply_threads()  # the weight dequantization runs on these threads too
        path = resolve_model(config.model)
        model, cfg = load_model(path, config.torch_dtype, config.device)
        tokenizer = load_tokenizer(path, cfg, open_gguf(path).data_offset)
        return cls(model, tokenizer, config)

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
        return f"dtype {c.dtype}{why}, attention {c.attention_backend}, {c.threads} thread{'' if c.threads == 1 else 's'}"

    def _kv_dtype_label(self) -> str:
        c = self.config
        if c.kv_cache_dtype == "auto":
            return c.dtype
        scales = f"static scales k={c.kv_scales[0]:g}, v={c.kv_scales[1]:g}" if c.kv_scales else "dynamic float32 scales"
        return f"{c.kv_cache_dtype} + {scales}; attention {c.attention_backend}"

    # ---- requests -----------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    cache_salt: str | None = None, priority: int = 0) -> str:
        """Tokenize (if text), validate and queue a request; returns its id.

        Raises:
            LlmdError: empty prompt, prompt longer than ``max_model_len``, prompt + max_tokens
                beyond ``max_model_len``, a request that can never fit in the KV pool, or a
                bad sampling parameter; :class:`ServerBusyError` when the waiting queue is full.
        """
        return self.add_parallel_request(prompt, params, [request_id or f"req-{next(self._ids)}"], cache_salt, priority)[0]

    def add_parallel_request(self, prompt: str | list[int], params: SamplingParams | None, request_ids: list[str],
                             cache_salt: str | None = None, priority: int = 0) -> list[str]:
        """Queue ``len(request_ids)`` sequences of one prompt (parallel sampling, OpenAI ``n``).

        The prompt is prefilled once; the siblings then share its blocks by reference count
        and sample with generators derived from (seed, sibling index, output position).
        Raises LlmdError as :meth:`add_request`.
        """
        params = params or SamplingParams()
        try:
            params.validate()
        except ValueError as e:
            raise LlmdError(str(e)) from None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise LlmdError("the prompt is empty (0 tokens)")
        if any(not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size for t in ids):
            raise LlmdError(f"prompt token ids must be integers in [0, {self.model_config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise LlmdError(f"prompt has {len(ids)} tokens but the context is {self.max_model_len} tokens (max-model-len), leaving no room to generate")
        defaulted = params.max_tokens is None
        if defaulted:
            params.max_tokens = self.max_model_len - len(ids)
        elif len(ids) + params.max_tokens > self.max_model_len:
            raise LlmdError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {len(ids) + params.max_tokens} "
                f"exceeds the context of {self.max_model_len} tokens"
            )
        eos = frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        reqs = [Request(rid, list(ids), dataclasses.replace(params), eos_token_ids=eos, cache_salt=cache_salt,
                        sibling_index=i, priority=priority) for i, rid in enumerate(request_ids)]
        try:
            self.scheduler.add_request(reqs[0], reqs[1:])
        except QueueFullError as e:
            raise ServerBusyError(str(e)) from None
        except ValueError as e:
            hint = f" (max_tokens was not given, so it defaulted to the remaining context, {params.max_tokens})" if defaulted else ""
            raise LlmdError(str(e) + hint) from None
        for rid in request_ids:
            self.detokenizers[rid] = IncrementalDetokenizer(self.tokenizer.hf, ids, params.stop)
        return list(request_ids)

    def reset_prefix_cache(self) -> int:
        """Drop cached blocks that are free (blocks in use stay); returns how many."""
        return self.kv_manager.reset_prefix_cache()

    def abort(self, request_id: str) -> bool:
        """Abort a request and free its blocks; returns False if it was not live."""
        live = request_id in self.scheduler.requests
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.detokenizers.pop(request_id, None)
        return live

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one iteration ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; returns an output for every request that produced a
        token (or finished) in it."""
        sched = self.scheduler.schedule()
        self.last_scheduler_output = sched
        if not sched:
            return []
        reqs = {s.request_id: self.scheduler.requests[s.request_id] for s in sched.scheduled}
        sampling, rows = [], []
        for row, s in enumerate([s for s in sched.scheduled if s.sample]):
            leader = reqs[s.request_id]
            for r in (leader, *leader.followers):  # followers fork now: same logits row
                sampling.append(r)
                rows.append(row)
        result = self.runner.execute(sched, sampling, rows)
        sampled, logprobs = {}, {}
        if result is not None:
            for req, tok, lp in zip(sampling, result.sampled_token_ids, result.logprobs):
                sampled[req.request_id], logprobs[req.request_id] = tok, lp
        self.scheduler.update_from_output(sched, sampled)
        outputs = []
        for req in sampling:
            outputs.append(self._postprocess(req, sampled[req.request_id], logprobs[req.request_id]))
        return outputs

    def _postprocess(self, req: Request, token: int, lp: TokenLogprobs | None) -> RequestOutput:
        detok = self.detokenizers[req.request_id]
        text = detok.update([token])
        if detok.stop_matched is not None and not req.is_finished:
            req.stop_reason = detok.stop_matched
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        if req.is_finished:
            if detok.stop_matched is None:
                text += detok.finish()
            del self.detokenizers[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_text=text,
            logprobs=[lp],
            finished=req.is_finished,
            finish_reason=req.status.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )

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
