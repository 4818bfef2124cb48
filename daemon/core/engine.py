"""The engine: ``add_request`` / ``abort`` / ``step`` / ``make_stats``, in-process.

One step is schedule → run → postprocess (nano-vllm ``llm_engine.py``, vLLM v1
``EngineCore.step``), in :mod:`.engine_step`.

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

Here: the construction and the requests (adding, aborting, failing). Beside it:
:mod:`.engine_setup` (the checks, KV pool sizing and model loading it is built with,
re-exported here), :mod:`.engine_step` (one iteration: ``step``, beam advances,
postprocessing), :mod:`.engine_summary` (startup lines), :mod:`.engine_stats` (statistics),
:mod:`.engine_offline` (teacher forcing, ``generate``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

from llmd.daemon.core import engine_setup
from llmd.daemon.core.beam import BeamSearch, check_beam_params, check_fits
from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.detokenizer import IncrementalDetokenizer
from llmd.daemon.core.engine_offline import OfflineMixin
from llmd.daemon.core.engine_setup import check_kv_layout, check_triton_backend, float16_warning
from llmd.daemon.core.engine_stats import StatsMixin
from llmd.daemon.core.engine_step import StepMixin
from llmd.daemon.core.engine_summary import SummaryMixin, glue_ops
from llmd.daemon.core.errors import LlmdError, RequestError, ServerBusyError
from llmd.daemon.core.faults import FaultInjector
from llmd.daemon.core.grammar import GrammarCompiler, GrammarState
from llmd.daemon.core.input_processor import InputProcessor, ProcessedPrompt, Prompt, check_keep_option, model_context
from llmd.daemon.core.kv_exchange import KVExchange
from llmd.daemon.core.outputs import RequestOutput, SchedulerOutput
from llmd.daemon.core.parallel import ParallelRequests
from llmd.daemon.core.request import Request, RequestStatus, SamplingParams
from llmd.daemon.core.scheduler import Scheduler
from llmd.daemon.kv import make_kv_cache_groups
from llmd.models.config import ModelConfig
from llmd.models.tokenizer import Tokenizer

__all__ = ["Engine", "check_kv_layout", "check_triton_backend", "float16_warning", "glue_ops"]  # as before the split

log = logging.getLogger("llmd.engine")


class Engine(StepMixin, SummaryMixin, StatsMixin, OfflineMixin):
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
        counters: :class:`~.stats.EngineCounters` since the engine was built (:mod:`.engine_stats`).
        log_stats: keep per-step events (:meth:`take_iteration_stats`) for a consumer such as
            the daemon's metrics (off by default: nobody would take them).
    """

    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig):
        self.config = engine_setup.resolve_for_model(config, model)  # auto: the model's dtype; --threads
        self.released_dense_bytes = 0  # from_config: float32 weight pages the fp16 packs replaced, handed back
        kv_dtype = next(model.parameters()).dtype
        self.thread_governor = engine_setup.make_thread_governor(self.config)  # fewer threads while cores are busy
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        cfg, c = self.model_config, self.config
        engine_setup.check_backends(c, cfg, kv_dtype)
        self.max_model_len = model_context(c.max_model_len, cfg.max_position)
        self.kv_cache_groups = make_kv_cache_groups(cfg.layer_windows, hybrid=not c.disable_hybrid_kv_cache_manager)
        size = engine_setup.size_kv_cache(c, cfg, kv_dtype, self.kv_cache_groups)
        self.kv_cache_memory, self.num_blocks, self.block_bytes = size.memory, size.num_blocks, size.block_bytes
        self.bytes_per_token, self.residual_bytes = size.bytes_per_token, size.residual_bytes
        self.kv_manager = engine_setup.make_kv_manager(c, cfg, size, self.kv_cache_groups)
        self.scheduler = Scheduler(self.kv_manager, c.max_num_seqs, c.max_num_batched_tokens, self.max_model_len,
                                   c.max_prefill_chunk, c.max_num_waiting, scheduling_policy=c.scheduling_policy)
        self.runner = engine_setup.make_runner(model, c, kv_dtype, size, self.kv_cache_groups, self.max_model_len)
        self.input_processor = InputProcessor(tokenizer, cfg.vocab_size, self.max_model_len, c.context_overflow,
                                              c.keep, c.block_size)
        check_keep_option(c.keep, self.max_model_len, c.block_size)  # --keep: a shift must free a block
        # structured outputs (None for a tokenizer-less engine, e.g. llmd bench step's, which adds no requests)
        self.grammars = (GrammarCompiler(tokenizer.hf, cfg.vocab_size, tokenizer.eos_token_ids)
                         if tokenizer is not None else None)
        self.parallel = ParallelRequests()
        self.beams = BeamSearch()  # use_beam_search requests (beam.py)
        self.kv_exchange = KVExchange(self)  # prefill/decode disaggregation: pins, pulls, imports
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.last_scheduler_output: SchedulerOutput | None = None
        self._ids = itertools.count()
        self._init_stats()  # counters, rates, log_stats (engine_stats.py)
        self._unreported: dict[str, Request] = {}  # this step's requests whose output is not made yet
        self.faults: FaultInjector | None = None  # test hooks (faults.py); None in production
        injector = FaultInjector.from_env()
        if injector is not None:
            log.warning("fault injection is on (%s); for tests only", injector.faults)
            injector.install(self)
        warning = float16_warning(cfg.architecture, c.dtype)
        if warning:
            log.warning(warning)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        """Resolve the model, load weights and tokenizer, allocate the KV cache.

        Raises:
            LlmdError: unknown model, bad GGUF, bad setting.
        """
        return engine_setup.from_config(cls, config)

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
        """Abort a request (:meth:`abort_members`) and free its blocks; returns False if
        nothing was live."""
        return bool(self.abort_requests(self.abort_members(request_id)))

    def abort_members(self, request_id: str) -> list[str]:
        """The sequences an abort of ``request_id`` ends: a parent id's live children; one
        beam's sequence id its whole beam search (:meth:`BeamSearch.members`); a parallel-
        sampling child or any other id just itself."""
        if request_id in self.beams:
            return self.beams.members(request_id)
        return self.parallel.members(request_id)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort these sequences; returns the final ``finish_reason="abort"`` output of each one
        that was live. A beam-search slot's output carries the search's answer so far
        (:meth:`BeamSearch.partial_answer`: all its tokens and text, as a finished search's
        does), since its beams stream nothing while they run."""
        outputs, beam_answers = [], {}
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            if rid in self.beams and rid not in beam_answers:  # before any slot of the group leaves
                beam_answers.update(self.beams.partial_answer(rid, self.scheduler.requests))
            tokens, text = [], ""
            if rid in beam_answers:
                tokens, stopped = beam_answers[rid]
                text = self._beam_answer(req, tokens, stopped)
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            self.detokenizers.pop(rid, None)
            self._finished(req, "abort")
            outputs.append(RequestOutput(request_id=rid, finished=True, finish_reason="abort", index=req.sibling_index,
                                         num_prompt_tokens=req.total_prompt_tokens,
                                         num_output_tokens=req.num_output_tokens, new_token_ids=tokens,
                                         new_text=text, logprobs=[None] * len(tokens)))
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

    def _finished(self, req: Request, reason: str | None) -> None:
        """A request ended (``reason`` None: aborted): count it, forget its parallel-sampling
        and beam-search membership."""
        reason = reason or "abort"
        self._count_finished(req, reason)
        self.parallel.finished(req.request_id)
        self.beams.finished(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def requests(self) -> dict[str, Request]:
        """The live sequences by id (read only)."""
        return self.scheduler.requests
