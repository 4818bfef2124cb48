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
  bounded by the validation's ``MAX_MESSAGES`` and character caps instead.
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
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import gc
import logging
import queue
import threading
import time
from typing import Callable

from llmd.daemon.core.engine import Engine
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.outputs import RequestOutput
from llmd.daemon.core.parallel import child_request_ids
from llmd.daemon.core.request import SamplingParams
from llmd.daemon.core.stats import EngineStats
from llmd.daemon.serving.engine_health import EngineHealth

log = logging.getLogger("llmd.engine_loop")
Sink = Callable[[RequestOutput], None]
TOKENIZE_WORKERS = 2  # a long prompt's tokenization does not hold up a short one behind it


def _resolve(fut: cf.Future, result=None, exc: BaseException | None = None) -> None:
    """Complete ``fut`` unless it is already done (a cancelled caller); never raises."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except cf.InvalidStateError:
        pass


def freeze_startup_heap() -> int:
    """``gc.collect()`` then ``gc.freeze()``: every object alive once the engine is built (the
    model, torch, the tokenizer: ~202k tracked objects in ``llmd serve`` with SmolLM2) moves to
    the permanent generation, so a full collection no longer traverses them. Measured on the
    2-core Zen 4 (2026-12-06) inside ``llmd serve``: a full collection took 98–103 ms before (an
    inter-token gap of that size for every stream whenever one runs on the engine thread) and
    0.01 ms after. vLLM's engine core does the same after start-up. Returns the frozen count."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class EngineLoop:
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
        self._tokenizers = cf.ThreadPoolExecutor(TOKENIZE_WORKERS, thread_name_prefix="llmd-tokenize")
        self.num_live = 0  # live child requests (read from any thread)

    # ---- any thread ---------------------------------------------------------------
    def start(self) -> "EngineLoop":
        """Start the thread; with a built engine, :attr:`ready` is resolved on return."""
        if self._factory is None:
            self._adopt(self.engine)
        self._thread.start()
        return self

    def _adopt(self, engine: Engine) -> None:
        self.engine = engine
        engine.log_stats = self.metrics is not None  # per-step events only when someone reads them
        self._publish_snapshot()
        self.ready.set_result(engine)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything, stop the thread and wait for it (seconds)."""
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)
        self._tokenizers.shutdown(wait=False, cancel_futures=True)

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

    def _on_tokenizer(self, fn: Callable) -> cf.Future:
        """Run ``fn`` on the tokenizer pool (a stopped loop: a future raising LlmdError)."""
        try:
            return self._tokenizers.submit(fn)
        except RuntimeError:  # the pool is shut down
            fut: cf.Future = cf.Future()
            fut.set_exception(LlmdError("the engine loop is stopped"))
            return fut

    def abort(self, request_id: str) -> cf.Future:
        """Abort a request (parent id: all its sequences). Future → True if something was live."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("abort", request_id, fut))
        return fut

    def tokenize(self, prompt: str | list[int] | list[dict]) -> cf.Future:
        """Token ids of text, token ids or chat messages (:meth:`InputProcessor.tokenize`, on
        the tokenizer pool, as every prompt). Future → list[int]."""
        return self._on_tokenizer(lambda: self.engine.input_processor.tokenize(prompt))

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

    # ---- engine thread ------------------------------------------------------------
    def _run(self) -> None:
        if self._factory is not None:
            try:
                engine = self._factory()
                if self.freeze_gc:
                    freeze_startup_heap()
                self._adopt(engine)
            except BaseException as e:  # the caller awaiting `ready` reports it
                self.ready.set_exception(e)
                return
        self.health.progressed()
        try:
            while not self._stop.is_set():
                try:
                    self._iteration()
                except Exception:  # never let the engine thread die silently
                    log.exception("engine loop iteration failed")
                    self._stop.wait(self.health.step_failed())
        finally:
            self.engine.kv_exchange.release_all()  # pinned KV nobody will pull now
            if self._stop.is_set():
                self._abort_ids(list(self._sinks))
            else:  # the thread dies (a BaseException): nobody would answer these callers
                self._fail_all("the engine thread stopped unexpectedly")
            self._publish_snapshot()

    def _iteration(self) -> None:
        """Run queued commands (blocking while idle or backing off after a failed step), then
        one step if anything is live."""
        busy = self.engine.has_unfinished_requests()
        backoff = self.health.backoff_left()
        try:
            cmd = self._cmds.get(block=not busy or backoff > 0, timeout=backoff if busy else 0.5)
        except queue.Empty:
            cmd = None
        while cmd is not None:
            self._handle(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
        if self.engine.kv_exchange.pins:  # a producer's pins past their deadline go back to the pool
            self._changed |= bool(self.engine.kv_exchange.expire())
        if self.engine.has_unfinished_requests() and not self._stop.is_set() and not self.health.backoff_left():
            self._step()
        self.health.progressed()
        stale = time.monotonic() - self._snapshot_time >= self.snapshot_interval
        if stale or self._changed or not self.engine.has_unfinished_requests():
            self._publish_snapshot()

    def _handle(self, cmd: tuple) -> None:
        kind, fut = cmd[0], cmd[-1]
        if kind == "wake":
            return
        # A submit whose caller already gave up (its awaiting task was cancelled, which
        # cancels the future) is skipped; aborts run regardless.
        if not fut.set_running_or_notify_cancel() and kind == "submit":
            return
        try:
            if kind == "submit":
                result = self._submit(*cmd[1:-1])
            elif kind == "abort":
                result = self._abort_ids(self.engine.parallel.members(cmd[1]))
            elif kind == "rejected":  # the tokenizer pool refused a submit
                self.engine.counters.requests_rejected += isinstance(cmd[1], LlmdError)
                raise cmd[1]
            elif kind == "reset_prefix_cache":
                result = self.engine.reset_prefix_cache()
            elif kind == "kv_export":
                result = self.engine.kv_exchange.export(cmd[1])
            elif kind == "check_integrity":
                _resolve(fut, result=self._integrity())
                return
            else:  # abort_all
                result = self._abort_ids(list(self._sinks))
            self._changed |= bool(result)  # an unknown id's abort (False) changes nothing
            if result and kind != "submit":  # read-your-writes: the caller's next /v1/stats shows the abort
                self._publish_snapshot()
            _resolve(fut, result=result)
        except LlmdError as e:
            self._changed |= kind == "rejected"  # counters.requests_rejected
            _resolve(fut, exc=e)
        except Exception as e:  # a bug must not kill the loop
            log.exception("engine command %s failed", kind)
            _resolve(fut, exc=e)

    def _integrity(self) -> dict:
        eng = self.engine
        try:
            eng.kv_manager.check_integrity()
            error = None
        except AssertionError as e:
            error = str(e) or "assertion failed"
        live = {"sinks": len(self._sinks), "engine_requests": len(eng.requests), "detokenizers": len(eng.detokenizers),
                "kv_tables": len(eng.kv_manager.req_to_blocks), "used_blocks": eng.kv_manager.num_used_blocks}
        fired = dict(eng.faults.fired) if eng.faults is not None else None
        return {"ok": error is None, "error": error, "live": live, "faults_fired": fired}

    def _submit(self, parent_id, prompt, grammar, params, n, sink, cache_salt=None, priority=0, kv=None):
        # one prompt, n sequences: prefilled once, then forked (parallel sampling); each its own matcher
        children = self.engine.add_parallel_request(prompt, dataclasses.replace(params),
                                                    child_request_ids(parent_id, n), cache_salt, priority,
                                                    parent_id=parent_id, grammar=grammar, **(kv or {}))
        for i, rid in enumerate(children):
            self._sinks[rid], self._index[rid] = sink, i
        self.num_live += len(children)
        return children, self.engine.requests[children[0]].num_prompt_tokens

    def _abort_ids(self, ids: list[str]) -> bool:
        outputs = self.engine.abort_requests([rid for rid in ids if rid in self._sinks])
        self._publish_events()
        for out in outputs:
            self._deliver(out)
        return bool(outputs)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            wait = self.health.step_failed()
            if self.metrics is not None:
                self.metrics.engine_error()
            log.exception("engine step failed (%d in a row; next step in %.2f s); ending its %d live sequences",
                          self.health.step_failures, wait, len(self._sinks))
            self._fail_all(f"the engine step failed: {type(e).__name__}: {e}")
            return
        self.health.step_succeeded()
        self._publish_events()
        for out in outputs:
            self._deliver(out)

    def _fail_all(self, message: str) -> None:
        """End every sequence that has a sink with one ``finish_reason="error"`` output: the
        engine's (blocks freed) where it still knows the sequence, else a bare one."""
        ids = list(self._sinks)
        try:
            outputs = self.engine.fail_requests(ids, message)
            self._publish_events()
        except Exception:  # the engine is broken too: the callers still get their ending
            log.exception("ending the live sequences failed")
            outputs = []
        for out in outputs:
            self._deliver(out)
        for rid in [rid for rid in ids if rid in self._sinks]:
            self._deliver(RequestOutput(request_id=rid, finished=True, finish_reason="error", error=message,
                                        index=self._index.get(rid, 0)))

    def _publish_events(self) -> None:
        """Hand the engine's per-step events to the metrics (before any sink is called)."""
        it = self.engine.take_iteration_stats()
        if self.metrics is not None and it:
            self.metrics.record(it)

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if out.finished:
            self._sinks.pop(out.request_id, None)
            self._index.pop(out.request_id, None)
            self.num_live -= sink is not None
        if sink is None:
            return
        try:
            sink(out)
        except Exception:  # the client's event loop is gone; its request is aborted elsewhere
            log.debug("sink for %s failed", out.request_id, exc_info=True)

    def _publish_snapshot(self) -> None:
        """Rebuild the stats snapshot (engine thread; O(blocks + live requests))."""
        now = time.monotonic()
        stats = self.engine.make_stats()
        self._snapshot = stats.to_dict(self.model_id, now - self.started_at)
        self._stats = stats
        self._snapshot_time = now
        self._changed = False
