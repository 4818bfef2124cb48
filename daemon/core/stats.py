"""Typed engine statistics: the engine makes them, the engine loop publishes them, metrics read them.

vLLM v1's ``vllm/v1/metrics/stats.py`` in small:

* :class:`IterationStats`: what one engine step (or abort) did: prefill tokens computed,
  tokens generated, the first-token and inter-token latencies observed, the requests that
  finished. :meth:`Engine.take_iteration_stats` hands over everything since the last call.
* :class:`EngineCounters`: those events summed since the engine started.
* :class:`EngineStats`: a snapshot of the engine's state (KV cache, prefix cache, scheduler,
  live requests, counters, throughput), made by :meth:`Engine.make_stats` on the engine
  thread; :meth:`EngineStats.to_dict` is the ``GET /v1/stats`` payload (schema in
  :mod:`llmd.daemon.protocol`).

Times are ``time.monotonic()`` seconds. Plain data: no torch, nothing from the engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmd.daemon.protocol import STATS_SCHEMA_VERSION, rle

FINISH_REASONS = ("stop", "length", "abort", "error")
#: seconds of history behind the throughput figures
RATE_WINDOW_S = 5.0


@dataclass
class FinishedRequestStats:
    """One sequence that ended: why, and its end-to-end latency (arrival → finish, seconds)."""

    request_id: str
    finish_reason: str
    e2e_latency_s: float


@dataclass
class IterationStats:
    """Events of one or more engine steps and aborts (see the module docstring).

    Attributes:
        num_prompt_tokens: prefill tokens the model computed (prefix-cache hits are not;
            recomputation after preemption is).
        num_generation_tokens: tokens generated.
        time_to_first_tokens_s: per sequence that got its first token, arrival → first token.
        inter_token_latencies_s: per later token, the time since the sequence's previous one.
        finished: sequences that ended (finish reason "stop", "length", "abort" or "error").
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.num_prompt_tokens or self.num_generation_tokens or self.finished)


@dataclass
class EngineCounters:
    """Totals since the engine started (the ``counters`` of ``/v1/stats``)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_rejected: int = 0
    num_preemptions: int = 0
    requests_finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))

    def record(self, it: IterationStats) -> None:
        self.prompt_tokens += it.num_prompt_tokens
        self.generation_tokens += it.num_generation_tokens
        for f in it.finished:
            reason = f.finish_reason if f.finish_reason in self.requests_finished else "abort"
            self.requests_finished[reason] += 1

    def copy(self) -> "EngineCounters":
        return EngineCounters(self.prompt_tokens, self.generation_tokens, self.requests_rejected,
                              self.num_preemptions, dict(self.requests_finished))


class RateWindow:
    """Prompt and generation tokens per second over the last :data:`RATE_WINDOW_S` seconds."""

    def __init__(self, started_at: float):
        self.started_at = started_at
        self._log: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generated tokens)

    def add(self, now: float, prompt_tokens: int, generation_tokens: int) -> None:
        self._log.append((now, prompt_tokens, generation_tokens))

    def rates(self, now: float) -> tuple[float, float]:
        """(prompt tokens/s, generation tokens/s); the span is the window, or the time since
        the start when that is shorter."""
        while self._log and now - self._log[0][0] > RATE_WINDOW_S:
            self._log.popleft()
        span = max(1e-9, min(RATE_WINDOW_S, now - self.started_at))
        return sum(r[1] for r in self._log) / span, sum(r[2] for r in self._log) / span


@dataclass
class KVCacheGroupStats:
    """One KV cache group: blocks its requests' tables hold, over the shared pool."""

    name: str
    sliding_window: int | None
    layers: list[int]
    total: int
    used: int
    free: int
    usage: float


@dataclass
class KVCacheStats:
    """The paged KV cache (blocks; ``used + cached_free + free == total``, the usable blocks).

    ``block_states``: per block id, "null" / "free" / "cached" / "used" (run-length encoded by
    :meth:`EngineStats.to_dict`)."""

    block_size: int
    num_blocks: int
    total: int
    used: int
    cached_free: int
    free: int
    bytes_per_token: int
    memory_bytes: int
    usage: float
    groups: list[KVCacheGroupStats]
    block_states: list[str]


@dataclass
class PrefixCacheStats:
    queries: int
    hits: int
    enabled: bool
    evictions: int


@dataclass
class SchedulerStats:
    running: int
    waiting: int
    preempted: int
    context_shifts: int = 0  # cumulative: context shifts done (--context-overflow shift)


@dataclass
class RequestStats:
    """One live sequence (``ttft_s`` None before its first token; seconds)."""

    id: str
    state: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    blocks: int
    block_table: list[int]
    block_tables: list[list[int]]
    ttft_s: float | None
    age_s: float
    preemptions: int
    priority: int


@dataclass
class EngineStats:
    """A snapshot of one engine (made on its thread by :meth:`Engine.make_stats`)."""

    kv_cache_dtype: str
    kv_cache: KVCacheStats
    prefix_cache: PrefixCacheStats
    scheduler: SchedulerStats
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    counters: EngineCounters
    requests: list[RequestStats]
    kv_transfer: dict = field(default_factory=dict)  # KVExchange.stats(): pins, pulls, imports
    runtime: str = ""  # Engine.runtime_summary(): dtype, attention backend and kernels, threads, linears

    def to_dict(self, model_id: str, uptime_s: float, block_map: dict | None = None,
                requests: list[dict] | None = None) -> dict:
        """The ``GET /v1/stats`` payload (schema ``STATS_SCHEMA_VERSION`` of ``protocol.py``).
        ``block_map``: an earlier payload's ``block_map`` to reuse (the run-length encoding of
        ``kv_cache.block_states`` is O(blocks): ~4.6 ms for 65,536 blocks); None encodes this one's.
        ``requests``: an earlier payload's entries for :attr:`requests` to reuse (shared, not
        copied); None converts this one's."""
        kv, c = self.kv_cache, self.counters
        return {
            "schema_version": STATS_SCHEMA_VERSION,
            "model": model_id,
            "kv_cache_dtype": self.kv_cache_dtype,
            "runtime": self.runtime,
            "uptime_s": uptime_s,
            "kv_cache": {"block_size": kv.block_size, "num_blocks": kv.num_blocks, "total": kv.total, "used": kv.used,
                         "cached_free": kv.cached_free, "free": kv.free, "bytes_per_token": kv.bytes_per_token,
                         "memory_bytes": kv.memory_bytes, "usage": kv.usage,
                         "groups": [vars(g).copy() for g in kv.groups]},
            "block_map": block_map if block_map is not None else {"encoding": "rle", "runs": rle(kv.block_states)},
            "prefix_cache": vars(self.prefix_cache).copy(),
            "scheduler": vars(self.scheduler).copy(),
            "throughput": {"prompt_tokens_per_s": self.prompt_tokens_per_s,
                           "generation_tokens_per_s": self.generation_tokens_per_s},
            "counters": {"prompt_tokens": c.prompt_tokens, "generation_tokens": c.generation_tokens,
                         "requests_rejected": c.requests_rejected, "num_preemptions": c.num_preemptions,
                         "requests_finished": dict(c.requests_finished)},
            "requests": requests if requests is not None else [vars(r).copy() for r in self.requests],
            "kv_transfer": dict(self.kv_transfer),
        }
