"""The engine loop: one background thread owns the :class:`Engine`; everyone else talks to it
through a thread-safe command queue.

Why a thread: a CPU step takes up to a few hundred milliseconds (token budget 512), and
the HTTP event loop must keep answering ``/health`` and ``/v1/stats`` meanwhile. torch
releases the GIL inside its kernels, so the event loop stays responsive.

Why the engine is *built* on that thread too (give :class:`EngineLoop` a factory): torch's
CPU ops run on an OpenMP team owned by the thread that calls them. When the weights load on
the main thread and the steps run on another, the process keeps two teams, more OpenMP
threads than cores, and GNU libgomp then stops spinning between parallel regions (its
"throttled" wait), so every one of a step's thousands of small regions pays a futex wake-up.
Measured on 2 cores (SmolLM2, 32 mixed requests, bfloat16): loaded on the main thread and
stepped on a thread, 189 out tok/s at 1.44 cores busy; loaded and stepped on one thread,
260 tok/s at 1.99 cores. So every torch call of a daemon happens on this one thread.

Rules:

* Only the engine thread touches the engine's state: commands (submit, abort, cache reset)
  run between steps, in FIFO order, so an abort queued after its submit always finds the
  request, and an abort takes effect within one step.
* Prompts are tokenized (and chat templates rendered) on a small worker pool
  (``llmd-tokenize``, :data:`TOKENIZE_WORKERS` threads) through the engine's
  :class:`~llmd.daemon.core.input_processor.InputProcessor`; a submit reaches the command
  queue only as a :class:`ProcessedPrompt`, so the engine thread never tokenizes: a 500k-
  character prompt (241 ms in HF ``tokenizers``, which releases the GIL) delays only itself.
  A chat template runs in Jinja with the GIL held, which a worker thread cannot hide (the
  engine thread waits up to the 5 ms switch interval at each GIL hand-back): that cost is
  bounded by ``prompt_fields.MAX_MESSAGES`` and character caps instead.
  The pool only reads the tokenizer (HF fast tokenizers encode through ``&self``; the engine
  thread's detokenizer decodes concurrently, as the server's token-text lookup always did).
* Outputs go to a per-request *sink* (a callable taking :class:`RequestOutput`), called on
  the engine thread; the server's sink hops onto the event loop with
  ``call_soon_threadsafe``. Every sequence ends with exactly one ``finished`` output; an
  aborted one gets the engine's ``finish_reason="abort"`` output.
* Statistics are the engine's (:mod:`llmd.daemon.core.stats`); this loop only publishes them:
  each step's :class:`IterationStats` go to the metrics before the step's outputs reach their
  sinks (a scrape after a reply sees its tokens), and an immutable stats snapshot (typed, and
  as the ``/v1/stats`` dict of ``protocol.py``) is rebuilt on the engine thread, so reading it
  never waits for a step: while requests run at most every ``snapshot_interval`` seconds, plus
  once after an iteration whose commands changed something (a submit, an abort that found its
  request, a cache reset), and before answering an abort or reset that changed something (so
  the caller's next ``/v1/stats`` shows it), never for a command that changed nothing: 1,000
  ``DELETE`` s of unknown ids in one burst cost no rebuild at all (it is O(blocks + live
  requests), ~1 ms for 8k blocks).
* One bad request never hurts the others: a request that fails alone gets the engine's
  ``finish_reason="error"`` output. A step that raises as a whole ends every live sequence
  with one terminal ``"error"`` output, found through the *sinks*, not the scheduler (a
  sequence that finished in that very step has left the scheduler, yet its caller still
  waits), frees their blocks (:meth:`Engine.fail_requests`), and the loop keeps serving; it
  counts the failure and backs off before the next step (:mod:`.engine_health`, which also
  answers ``/health``). An engine thread that ends unexpectedly ends its sequences the same way.
* Data flows one way: this module imports the engine, never the server.

This module is the side any thread calls (:class:`EngineLoop`: its commands, snapshot and
health); the engine thread's side (the loop, the commands' handling, steps, sinks, the stats it
publishes) is :mod:`.engine_thread`.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import queue
import threading
import time
from typing import Callable

from llmd.daemon.core.engine import Engine
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.request import SamplingParams
from llmd.daemon.core.stats import EngineStats
from llmd.daemon.serving.engine_health import EngineHealth
from llmd.daemon.serving.engine_thread import (  # noqa: F401 (re-exported: the daemon's start-up and sinks)
    EngineThreadMixin,
    Sink,
    freeze_startup_heap,
)

TOKENIZE_WORKERS = 2  # a long prompt's tokenization does not hold up a short one behind it


class EngineLoop(EngineThreadMixin):
    """Runs ``engine.step()`` on a background thread while requests are live.

    Args:
        engine: the engine (owned by the loop from :meth:`start` on), or a zero-argument
            factory that builds it: then it is built on the loop's thread (see the module
            docstring), :attr:`ready` resolves to it, or to the factory's exception (and the
            thread ends).
        model_id: served model id reported in stats.
        snapshot_interval: seconds between stats snapshots while busy.
        metrics: optional :class:`~llmd.daemon.serving.metrics.DaemonMetrics`, fed from this thread.
    """

    def __init__(self, engine: Engine | Callable[[], Engine], model_id: str = "", snapshot_interval: float = 0.1,
                 metrics=None, freeze_gc: bool = False):
        self._factory = None if isinstance(engine, Engine) else engine
        self.freeze_gc = freeze_gc  # gc.freeze() once the engine is built (the daemon's own process only)
        self.engine: Engine | None = engine if self._factory is None else None
        self.metrics = metrics
        self.ready: cf.Future = cf.Future()  # → the engine, once built (at once for a built one)
        self.model_id = model_id
        self.snapshot_interval = snapshot_interval
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._index: dict[str, int] = {}  # live child id → its choice index (for terminal outputs)
        self.health = EngineHealth()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmd-engine", daemon=True)
        self.started_at = time.monotonic()
        self._stats: EngineStats | None = None
        self._snapshot: dict = {}
        self._snapshot_time = 0.0
        self._changed = False  # a command changed state since the last snapshot (engine thread)
        self._was_busy = False  # the engine had live requests when this iteration began (engine thread)
        self._tokenizers = cf.ThreadPoolExecutor(TOKENIZE_WORKERS, thread_name_prefix="llmd-tokenize")
        self.num_live = 0  # live child requests (read from any thread)

    # ---- any thread ---------------------------------------------------------------
    def start(self) -> "EngineLoop":
        """Start the thread; with a built engine, :attr:`ready` is resolved on return."""
        if self._factory is None:
            self._adopt(self.engine)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> bool:
        """Abort everything, stop the thread and wait for it (seconds); returns whether it ended."""
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)
        self._tokenizers.shutdown(wait=False, cancel_futures=True)
        return not self._thread.is_alive()

    def submit(self, parent_id: str, prompt: str | list[int] | list[dict], params: SamplingParams, n: int, sink: Sink,
               cache_salt: str | None = None, priority: int = 0, kv: dict | None = None) -> cf.Future:
        """Queue one request of ``n`` sequences (ids :func:`child_request_ids`; each output
        carries its ``index``).

        ``kv``: prefill/decode disaggregation's ``kv_export`` / ``kv_import`` / ``kv_fallback``
        keywords of :meth:`Engine.add_parallel_request` (``serving/kv_transfer``), or None.

        ``prompt`` is text, token ids, or a list of chat messages (rendered with the model's
        template); it is tokenized and length-checked on the tokenizer pool, and a structured-
        output constraint (``params.structured``) compiled there too (cached per spec), then
        queued for the engine thread as token ids. The future resolves to ``(child_ids,
        num_prompt_tokens)`` or raises :class:`LlmdError` (nothing was queued then).
        Cancelling the future before the engine thread takes it drops the request.
        """
        fut: cf.Future = cf.Future()
        params = dataclasses.replace(params)  # process() resolves a missing max_tokens in place

        def queue_it(done: cf.Future) -> None:  # on the tokenizer thread
            if fut.cancelled():
                return
            exc = done.exception()
            if exc is not None:  # counted and resolved by the engine thread, in order
                self._cmds.put(("rejected", exc, fut))
            else:
                self._cmds.put(("submit", parent_id, *done.result(), params, n, sink, cache_salt, priority, kv, fut))

        def prepare():  # on the tokenizer thread: (ProcessedPrompt, compiled grammar or None)
            processed = self.engine.input_processor.process(prompt, params)
            spec = params.structured
            return processed, None if spec is None else self.engine.grammars.compile(spec)

        self._on_tokenizer(prepare).add_done_callback(queue_it)
        return fut

    def compile_grammar(self, spec) -> cf.Future:
        """Compile a structured-output constraint (a ``GrammarSpec``) on the tokenizer pool, as
        :meth:`submit` does (cached per spec). The future raises :class:`LlmdError` (a
        ``RequestError`` naming the field) where xgrammar refuses it or it matches no text."""
        return self._on_tokenizer(lambda: self.engine.grammars.compile(spec))

    def _on_tokenizer(self, fn: Callable) -> cf.Future:
        """Run ``fn`` on the tokenizer pool (a stopped loop: a future raising LlmdError)."""
        try:
            return self._tokenizers.submit(fn)
        except RuntimeError:  # the pool is shut down
            fut: cf.Future = cf.Future()
            fut.set_exception(LlmdError("the engine loop is stopped"))
            return fut

    def abort(self, request_id: str) -> cf.Future:
        """Abort a request (:meth:`Engine.abort_members`: a parent id all its sequences, one
        beam's id its whole beam search). Future → True if something was live."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("abort", request_id, fut))
        return fut

    def tokenize(self, prompt: str | list[int] | list[dict]) -> cf.Future:
        """Token ids of text, token ids or chat messages (:meth:`InputProcessor.tokenize`, on
        the tokenizer pool, as every prompt). Future → list[int]."""
        return self._on_tokenizer(lambda: self.engine.input_processor.tokenize(prompt))

    def detokenize(self, ids: list[int]) -> cf.Future:
        """The text of token ids, special tokens kept (``POST /detokenize``, as vLLM's, and a
        token-id prompt's ``echo``: ``multi_prompt.echo_texts``), on the tokenizer pool: a long
        list takes milliseconds, never on the engine thread or the event loop. The ids must
        already be checked against the vocabulary. Future → str."""
        return self._on_tokenizer(lambda: self.engine.input_processor.tokenizer.decode(ids, skip_special_tokens=False))

    def reset_prefix_cache(self) -> cf.Future:
        """Drop cached-but-free blocks (``POST /v1/cache/reset``). Future → how many."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("reset_prefix_cache", fut))
        return fut

    def export_kv(self, transfer_id: str) -> cf.Future:
        """A producer's pinned KV, copied out and unpinned between two steps
        (:meth:`KVExchange.export <llmd.daemon.core.kv_exchange.KVExchange.export>`). Future →
        ``(KVPayload, fault or None)``, or raises ``KVTransferError`` (unknown / expired id)."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("kv_export", transfer_id, fut))
        return fut

    def abort_all(self) -> cf.Future:
        fut: cf.Future = cf.Future()
        self._cmds.put(("abort_all", fut))
        return fut

    def check_integrity(self) -> cf.Future:
        """Audit the KV manager between two steps (``GET /v1/debug/integrity``, a test hook).
        Future → ``{"ok", "error", "live", "faults_fired"}``: ``error`` is the failed
        invariant of :func:`~llmd.daemon.kv.integrity.check_integrity` (None when ``ok``), ``live``
        the sizes of the per-request tables (all 0 when idle), ``faults_fired`` the fault
        injector's counts (None without one)."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("check_integrity", fut))
        return fut

    def snapshot(self) -> dict:
        """The latest stats snapshot (a dict in the ``protocol.py`` schema; do not mutate)."""
        return self._snapshot

    def stats(self) -> EngineStats | None:
        """The latest typed stats (the snapshot's source; do not mutate)."""
        return self._stats

    def health_state(self, stall_timeout: float) -> tuple[str, str | None]:
        """``("ok", None)``, or the state and reason ``/health`` reports (:meth:`EngineHealth.check`)."""
        return self.health.check(self.ready, self._thread.is_alive(), stall_timeout)

    @property
    def alive(self) -> bool:
        """The engine is built and its thread runs (commands will be answered)."""
        return self.ready.done() and self.engine is not None and self._thread.is_alive()
