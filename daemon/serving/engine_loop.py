"""The engine loop: one background thread owns the :class:`Engine`; everyone else talks to it
through a thread-safe command queue.

Why a thread: a CPU step takes up to a few hundred milliseconds (token budget 256), and
the HTTP event loop must keep answering ``/health`` and ``/v1/stats`` meanwhile. torch
releases the GIL inside its kernels, so the event loop stays responsive.

Rules:

* Only the engine thread touches the engine (tokenizer included): commands (submit,
  abort) run between steps, in FIFO order, so an abort queued after its submit always
  finds the request, and an abort takes effect within one step.
* Outputs go to a per-request *sink* (a callable taking :class:`RequestOutput`), called on
  the engine thread; the server's sink hops onto the event loop with
  ``call_soon_threadsafe``. Every request ends with exactly one ``finished`` output;
  an aborted one gets a synthetic output with ``finish_reason="abort"``.
* Stats are published as an immutable snapshot dict (schema in ``protocol.py``) rebuilt on
  the engine thread at most every ``snapshot_interval`` seconds and after every command,
  so reading them never waits for a step.
* Data flows one way: this module imports the engine, never the server.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from typing import Callable

from llmd.daemon.core.engine import Engine, RequestOutput
from llmd.daemon.protocol import STATS_SCHEMA_VERSION, rle
from llmd.daemon.core.request import RequestStatus, SamplingParams
from llmd.models.errors import LlmdError

log = logging.getLogger("llmd.engine_loop")
Sink = Callable[[RequestOutput], None]
RATE_WINDOW_S = 5.0


def _resolve(fut: cf.Future, result=None, exc: BaseException | None = None) -> None:
    """Complete ``fut`` unless it is already done (a cancelled caller); never raises."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except cf.InvalidStateError:
        pass


class EngineLoop:
    """Runs ``engine.step()`` on a background thread while requests are live.

    Args:
        engine: the engine (owned by the loop from :meth:`start` on).
        model_id: served model id reported in stats.
        snapshot_interval: seconds between stats snapshots while busy.
        metrics: optional :class:`~llmd.daemon.metrics.DaemonMetrics`, fed from this thread.
    """

    def __init__(self, engine: Engine, model_id: str = "", snapshot_interval: float = 0.1, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self.model_id = model_id
        self.snapshot_interval = snapshot_interval
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._groups: dict[str, list[str]] = {}  # parent id -> child request ids
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmd-engine", daemon=True)
        self.started_at = time.monotonic()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests_rejected": 0, "num_preemptions": 0,
                         "requests_finished": {"stop": 0, "length": 0, "abort": 0}}
        self._rate_log: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generated tokens)
        self._snapshot: dict = {}
        self._snapshot_time = 0.0
        self.num_live = 0  # live child requests (read from any thread)

    # ---- any thread ---------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._publish_snapshot()
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything, stop the thread and wait for it (seconds)."""
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)

    def submit(self, parent_id: str, prompt: str | list[int] | list[dict], params: list[SamplingParams], sink: Sink,
               chat: bool = False, cache_salt: str | None = None, priority: int = 0) -> cf.Future:
        """Queue one request of ``len(params)`` independent sequences (ids ``{parent_id}-{i}``).

        ``prompt`` is text, token ids, or (``chat=True``) a list of chat messages rendered
        with the model's template. The future resolves to ``(child_ids, num_prompt_tokens)``
        or raises :class:`LlmdError` (nothing was queued then).
        """
        fut: cf.Future = cf.Future()
        self._cmds.put(("submit", parent_id, prompt, params, sink, chat, cache_salt, priority, fut))
        return fut

    def abort(self, request_id: str) -> cf.Future:
        """Abort a request (parent id: all its sequences). Future → True if something was live."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("abort", request_id, fut))
        return fut

    def reset_prefix_cache(self) -> cf.Future:
        """Drop cached-but-free blocks (``POST /v1/cache/reset``). Future → how many."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("reset_prefix_cache", fut))
        return fut

    def abort_all(self) -> cf.Future:
        fut: cf.Future = cf.Future()
        self._cmds.put(("abort_all", fut))
        return fut

    def snapshot(self) -> dict:
        """The latest stats snapshot (a dict in the ``protocol.py`` schema; do not mutate)."""
        return self._snapshot

    # ---- engine thread ------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._iteration()
            except Exception:  # never let the engine thread die silently
                log.exception("engine loop iteration failed")
        self._abort_ids(list(self._sinks))
        self._publish_snapshot()

    def _iteration(self) -> None:
        """Run queued commands (blocking while idle), then one step if anything is live."""
        busy = self.engine.has_unfinished_requests()
        try:
            cmd = self._cmds.get(block=not busy, timeout=None if busy else 0.5)
        except queue.Empty:
            cmd = None
        while cmd is not None:
            self._handle(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
        if self.engine.has_unfinished_requests() and not self._stop.is_set():
            self._step()
        if time.monotonic() - self._snapshot_time >= self.snapshot_interval or not self.engine.has_unfinished_requests():
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
                result = self._abort_ids(self._groups.get(cmd[1], [cmd[1]]))
            elif kind == "reset_prefix_cache":
                result = self.engine.reset_prefix_cache()
            else:  # abort_all
                result = self._abort_ids(list(self._sinks))
            _resolve(fut, result=result)
        except LlmdError as e:
            self.counters["requests_rejected"] += 1
            _resolve(fut, exc=e)
        except Exception as e:  # a bug must not kill the loop
            log.exception("engine command %s failed", kind)
            _resolve(fut, exc=e)
        self._publish_snapshot()

    def _submit(self, parent_id, prompt, params, sink, chat, cache_salt=None, priority=0):
        tok = self.engine.tokenizer
        if chat:
            ids = tok.apply_chat(prompt)
        else:
            ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if parent_id in self._groups:
            raise LlmdError(f"request id {parent_id!r} is already in use")
        # one prompt, n sequences: prefilled once, then forked (parallel sampling)
        children = self.engine.add_parallel_request(
            ids, dataclasses.replace(params[0]), [f"{parent_id}-{i}" for i in range(len(params))], cache_salt, priority)
        for rid in children:
            self._sinks[rid] = sink
            if self.metrics is not None:
                self.metrics.on_arrival(rid, time.monotonic())
        self._groups[parent_id] = children
        self.num_live += len(children)
        return children, len(ids)

    def _abort_ids(self, ids: list[str]) -> bool:
        any_live = False
        for rid in ids:
            req = self.engine.scheduler.requests.get(rid)
            if req is None or rid not in self._sinks:
                continue
            self.engine.abort(rid)
            any_live = True
            self._deliver(RequestOutput(request_id=rid, finished=True, finish_reason="abort",
                                        num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens))
        return any_live

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("engine step failed; aborting the live requests")
            self._abort_ids(list(self._sinks))
            return
        sched = self.engine.last_scheduler_output
        n_prompt = sum(s.num_new_tokens for s in sched.scheduled if s.is_prefill) if sched else 0
        self.counters["prompt_tokens"] += n_prompt
        if self.metrics is not None:
            self.metrics.on_step(n_prompt)
        self.counters["generation_tokens"] += len(outputs)
        self._rate_log.append((time.monotonic(), n_prompt, len(outputs)))
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if self.metrics is not None:  # before the sink, so a scrape after the reply sees it
            self.metrics.on_output(out, time.monotonic())
        if out.finished:
            self._sinks.pop(out.request_id, None)
            self.num_live -= sink is not None
            self.counters["requests_finished"][out.finish_reason or "abort"] += 1
            parent = out.request_id.rsplit("-", 1)[0]
            if all(c not in self._sinks for c in self._groups.get(parent, ())):
                self._groups.pop(parent, None)
        if sink is None:
            return
        try:
            sink(out)
        except Exception:  # the client's event loop is gone; its request is aborted elsewhere
            log.debug("sink for %s failed", out.request_id, exc_info=True)

    def _publish_snapshot(self) -> None:
        """Rebuild the stats dict (engine thread; O(blocks + live requests))."""
        eng, now = self.engine, time.monotonic()
        kv, sched = eng.kv_manager, eng.scheduler
        while self._rate_log and now - self._rate_log[0][0] > RATE_WINDOW_S:
            self._rate_log.popleft()
        span = max(1e-9, min(RATE_WINDOW_S, now - self.started_at))
        cached_free = kv.block_pool.num_cached_free_blocks
        total, used, free = kv.num_usable_blocks, kv.num_used_blocks, kv.num_free_blocks - cached_free
        groups = [{"name": g.name, "sliding_window": g.sliding_window, "layers": list(g.layer_ids), "total": total,
                   "used": n, "free": free, "usage": n / max(1, total)}
                  for g, n in zip(kv.groups, kv.num_used_blocks_per_group())]
        reqs = []
        for req in list(sched.running) + list(sched.waiting):
            reqs.append({
                "id": req.request_id, "state": "running" if req.status == RequestStatus.RUNNING else "waiting",
                "prompt_tokens": req.num_prompt_tokens, "cached_tokens": req.num_cached_tokens, "generated_tokens": req.num_output_tokens,
                "blocks": kv.num_blocks_held(req.request_id), "block_table": kv.get_block_table(req.request_id),
                "block_tables": kv.get_block_tables(req.request_id),
                "ttft_s": None if req.first_token_time is None else req.first_token_time - req.arrival_time,
                "age_s": now - req.arrival_time, "preemptions": req.num_preemptions, "priority": req.priority,
            })
        c = self.counters
        kv_dtype = getattr(eng.config, "kv_cache_dtype", None)
        self._snapshot = {
            "schema_version": STATS_SCHEMA_VERSION,
            "model": self.model_id,
            "kv_cache_dtype": eng.config.dtype if kv_dtype in (None, "auto") else kv_dtype,
            "uptime_s": now - self.started_at,
            "kv_cache": {"block_size": kv.block_size, "num_blocks": kv.num_blocks, "total": total, "used": used,
                         "cached_free": cached_free, "free": free,
                         "bytes_per_token": eng.bytes_per_token, "memory_bytes": eng.num_blocks * eng.block_bytes, "usage": kv.usage, "groups": groups},
            "block_map": {"encoding": "rle", "runs": rle(kv.block_pool.block_states())},
            "prefix_cache": {"queries": kv.prefix_cache_queries, "hits": kv.prefix_cache_hits,
                             "enabled": kv.enable_caching, "evictions": kv.block_pool.num_evictions},
            "scheduler": {"running": len(sched.running), "waiting": len(sched.waiting),
                          "preempted": sum(1 for r in sched.waiting if r.num_preemptions)},
            "throughput": {"prompt_tokens_per_s": sum(r[1] for r in self._rate_log) / span,
                           "generation_tokens_per_s": sum(r[2] for r in self._rate_log) / span},
            "counters": {**c, "requests_finished": dict(c["requests_finished"]), "num_preemptions": sched.num_preemptions},
            "requests": reqs,
        }
        self._snapshot_time = now
