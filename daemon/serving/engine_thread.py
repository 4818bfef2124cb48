"""The engine loop's engine-thread side: :class:`EngineThreadMixin` builds or adopts the
engine, then runs the loop (queued commands between steps, in FIFO order; one step while
anything is live), hands every output to its request's sink, ends every live sequence when a
step fails, and publishes the engine's stats (per-step events to the metrics, the ``/v1/stats``
snapshot); :func:`freeze_startup_heap` runs once a factory has built the engine. The rules
these follow are the :mod:`.engine_loop` module docstring's.

:class:`EngineThreadMixin` is a base of :class:`~llmd.daemon.serving.engine_loop.EngineLoop`;
it reads the loop's ``engine``, ``metrics``, ``health``, ``ready``, ``model_id``,
``snapshot_interval``, ``started_at`` and ``freeze_gc``; its state (``_cmds``, ``_sinks``,
``_index``, ``_stop``, ``_factory``, the snapshot's fields, ``num_live``) is set by the loop's
``__init__``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import gc
import logging
import queue
import time
from typing import Callable

from llmd.daemon.core.engine import Engine
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.outputs import RequestOutput
from llmd.daemon.core.parallel import child_request_ids

log = logging.getLogger("llmd.engine_loop")
Sink = Callable[[RequestOutput], None]


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


class EngineThreadMixin:
    """What :class:`~llmd.daemon.serving.engine_loop.EngineLoop` runs on its engine thread (see
    the module docstring); only that thread calls these, :meth:`_adopt` aside (``start()`` with a
    built engine, before the thread runs)."""

    def _adopt(self, engine: Engine) -> None:
        self.engine = engine
        engine.log_stats = self.metrics is not None  # per-step events only when someone reads them
        self._publish_snapshot()
        self.ready.set_result(engine)

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
        busy = self._was_busy = self.engine.has_unfinished_requests()
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
                result = self._abort_ids(self.engine.abort_members(cmd[1]))
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
            # an unknown id's abort (False) changes nothing; a submit while others run waits for the
            # next scheduled rebuild (<= snapshot_interval), so a stream of arrivals does not rebuild
            # every live request's entry each iteration (1.2 ms at 64 running, 4.5+ ms at 256)
            self._changed |= bool(result) and (kind != "submit" or not self._was_busy)
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
        finished = [out.request_id for out in outputs if out.finished]
        if finished:  # before the last chunks go out: a /v1/stats read after a reply's end sees it gone and
            # its blocks free; the block map too once nothing runs (the dashboard's idle picture), else the
            # map and the other requests' entries are reused (light)
            self._publish_snapshot(light=self.engine.has_unfinished_requests(), finished=finished)
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

    def _publish_snapshot(self, light: bool = False, finished: list[str] = ()) -> None:
        """Rebuild the stats snapshot (engine thread; O(blocks + live requests and their block tables)).

        ``light``: the last snapshot less the ``finished`` request ids, with fresh counts (KV
        blocks used / free / cached, scheduler, counters, throughput): the per-block map
        (``block_map``, the dashboard's cells) and the other live requests' entries (tokens,
        blocks, block tables) are reused from it, so they may trail the counts by up to
        ``snapshot_interval``. It reads no block table (one KV cache group): O(live requests)
        to drop the finished ones, 0.12-0.15 ms with 256 running and 768 waiting on a tiny engine,
        against 3.8 ms when it rebuilt every live request's entry. A step that finishes
        requests takes one before their last outputs reach the sinks, so a ``/v1/stats`` read
        after a reply's end sees the request gone and its blocks free (the full snapshots,
        every ``snapshot_interval``, lagged it by up to that long: a client checking for leaked
        blocks saw one). It leaves the full snapshot's clock alone, so the map and the entries
        still refresh on schedule."""
        now = time.monotonic()
        prev = self._stats if light else None
        if prev is None:
            stats = self.engine.make_stats()
            self._snapshot = stats.to_dict(self.model_id, now - self.started_at)
            self._snapshot_time = now
            self._changed = False
        else:
            gone = set(finished)
            keep = [i for i, r in enumerate(prev.requests) if r.id not in gone]
            entries = self._snapshot["requests"]
            stats = self.engine.make_stats(prev.kv_cache.block_states, [prev.requests[i] for i in keep])
            self._snapshot = stats.to_dict(self.model_id, now - self.started_at, self._snapshot.get("block_map"),
                                           [entries[i] for i in keep])
        self._stats = stats
