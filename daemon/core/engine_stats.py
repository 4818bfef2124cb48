"""The engine's statistics, kept on the engine thread: :class:`StatsMixin` counts each step
and each finished request into ``counters`` (:class:`~.stats.EngineCounters`) and the token
rates' window, and, with ``log_stats``, records the per-step events
(:class:`~.stats.IterationStats`: time to first token and inter-token latencies in seconds)
that :meth:`~StatsMixin.take_iteration_stats` hands over; :meth:`~StatsMixin.make_stats` takes
a snapshot of the KV cache, prefix cache, scheduler and live requests
(:class:`~.stats.EngineStats`, the ``/v1/stats`` dict).

:class:`StatsMixin` is a base of :class:`~llmd.daemon.core.engine.Engine`; it reads the
engine's ``kv_manager``, ``scheduler``, ``kv_exchange`` and ``thread_governor``; its own state
(``counters``, ``rates``, ``log_stats``) is set by :meth:`~StatsMixin._init_stats`.
"""

from __future__ import annotations

import time

from llmd.daemon.core.request import Request, RequestStatus
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


class StatsMixin:
    """The statistics of :class:`~llmd.daemon.core.engine.Engine` (see the module docstring).

    Attributes:
        counters: :class:`~.stats.EngineCounters` since the engine was built.
        rates: the window of recent steps' prompt and generation tokens (tokens/s).
        log_stats: keep per-step events (:meth:`take_iteration_stats`) for a consumer such as
            the daemon's metrics (off by default: nobody would take them).
    """

    def _init_stats(self) -> None:
        """Zero the statistics (the engine's ``__init__``)."""
        self.counters = EngineCounters()
        self.rates = RateWindow(time.monotonic())
        self.log_stats = False
        self._iteration = IterationStats()
        self._runtime: str | None = None  # runtime_summary(), for make_stats

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

    def _count_finished(self, req: Request, reason: str) -> None:
        """Count a request that ended with ``reason`` and (with :attr:`log_stats`) record its
        end-to-end latency."""
        self.counters.requests_finished[reason] += 1
        if self.log_stats:
            self._iteration.finished.append(
                FinishedRequestStats(req.request_id, reason, time.monotonic() - req.arrival_time))

    def take_iteration_stats(self) -> IterationStats:
        """The events since the last call (empty unless :attr:`log_stats`)."""
        it, self._iteration = self._iteration, IterationStats()
        return it

    def make_stats(self, block_states: list[str] | None = None,
                   requests: list[RequestStats] | None = None) -> EngineStats:
        """A snapshot of the KV cache, prefix cache, scheduler, live requests and counters
        (O(blocks + live requests and their block tables)). ``block_states``: an earlier
        snapshot's per-block states to reuse (the only O(blocks) part: ~1.9 ms for 65,536
        blocks); None reads the pool's now. ``requests``: the live requests' entries to publish
        as given (the light snapshot's: an earlier snapshot's less the finished ones) instead of
        reading each one's block tables; with one KV cache group the per-group count is then
        the pool's used count (O(1)), with several it still walks the held blocks."""
        now = time.monotonic()
        kv, sched = self.kv_manager, self.scheduler
        cached_free = kv.block_pool.num_cached_free_blocks
        total, used, free = kv.num_usable_blocks, kv.num_used_blocks, kv.num_free_blocks - cached_free
        # one group: the blocks its tables hold are the pool's used ones (kv/integrity.py's invariant)
        per_group = [used] if requests is not None and len(kv.groups) == 1 else kv.num_used_blocks_per_group()
        groups = [KVCacheGroupStats(g.name, g.sliding_window, list(g.layer_ids), total, n, free, n / max(1, total))
                  for g, n in zip(kv.groups, per_group)]
        if requests is None:
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
                                  self.num_blocks * self.block_bytes, kv.usage, groups,
                                  kv.block_pool.block_states() if block_states is None else block_states),
            prefix_cache=PrefixCacheStats(kv.prefix_cache_queries, kv.prefix_cache_hits, kv.enable_caching,
                                          kv.block_pool.num_evictions),
            scheduler=SchedulerStats(len(sched.running), len(sched.waiting),
                                     sum(1 for r in sched.waiting if r.num_preemptions), sched.num_context_shifts),
            prompt_tokens_per_s=prompt_rate, generation_tokens_per_s=generation_rate,
            counters=counters, requests=requests, kv_transfer=self.kv_exchange.stats(),
        )
