"""Prometheus metrics for ``GET /metrics`` (text exposition format, via ``prometheus-client``).

The vLLM metric set under an ``llmd:`` prefix, every series labelled ``model_name``:

* gauges (refreshed from the stats snapshot on each scrape): ``num_requests_running``,
  ``num_requests_waiting`` (sequences), ``kv_cache_usage_perc`` (fraction 0..1 of usable
  KV blocks in use, despite the name; vLLM's convention);
* counters: ``prompt_tokens_total`` (prefill tokens computed), ``generation_tokens_total``
  (tokens generated), ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (tokens),
  ``num_preemptions_total``, ``request_success_total``
  (finished sequences, label ``finished_reason``: stop / length / abort / error);
* histograms (seconds): ``time_to_first_token_seconds`` (engine arrival → first token),
  ``inter_token_latency_seconds`` (between consecutive tokens of a sequence),
  ``e2e_request_latency_seconds`` (engine arrival → finish);
* ``engine_errors_total`` (``llmd:`` only; vLLM has no such series): engine steps that failed
  as a whole, each ending every live sequence with ``finished_reason="error"``
  (:meth:`DaemonMetrics.engine_error`, from the engine loop);
* ``num_context_shifts_total`` (``llmd:`` only; vLLM has no context shift): context shifts done
  (``--context-overflow shift``), synced from the stats snapshot on each scrape.

``--metrics-compat vllm`` registers the same metrics a second time under vLLM's own names
(``vllm:`` prefix, e.g. ``vllm:kv_cache_usage_perc``), so existing Grafana dashboards and
tools read llmd unchanged. Each daemon gets its own :class:`CollectorRegistry` (never the
process-global one), so in-process servers and tests do not collide.

Metrics count nothing themselves: they read what the engine made (:mod:`llmd.daemon.core.stats`).
:meth:`DaemonMetrics.record` takes each step's :class:`IterationStats` (tokens, latencies,
finished sequences) on the engine thread, from the :class:`EngineLoop`, before the step's
outputs reach their clients; :meth:`DaemonMetrics.refresh` sets the gauges (and the counters
the engine keeps cumulatively) from the latest :class:`EngineStats` on each scrape, and
:meth:`DaemonMetrics.render` runs on the event loop. prometheus-client's metric objects are
thread-safe.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.stats import FINISH_REASONS

COMPAT_PREFIXES = {"vllm": "vllm:"}
PREFIX = "llmd:"
# vLLM's bucket boundaries (seconds), so dashboards' quantile panels line up.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
# (type, name without prefix and without _total, help, histogram buckets)
SPECS = [
    (Gauge, "num_requests_running", "Number of sequences in the running batch.", None),
    (Gauge, "num_requests_waiting", "Number of sequences waiting to be scheduled.", None),
    (Gauge, "kv_cache_usage_perc", "KV-cache usage as a fraction of usable blocks (1 = 100%).", None),
    (Counter, "prompt_tokens", "Number of prefill tokens processed.", None),
    (Counter, "generation_tokens", "Number of generation tokens processed.", None),
    (Counter, "prefix_cache_queries", "Prefix cache queries, in tokens.", None),
    (Counter, "prefix_cache_hits", "Prefix cache hits, in tokens.", None),
    (Counter, "num_preemptions", "Cumulative number of preemptions.", None),
    (Histogram, "time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS),
    (Histogram, "inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS),
    (Histogram, "e2e_request_latency_seconds", "End-to-end request latency in seconds.", E2E_BUCKETS),
]


class DaemonMetrics:
    """One daemon's Prometheus metrics.

    Args:
        model_name: the served model id (the ``model_name`` label).
        compat: None, or ``"vllm"`` to also export every metric under the ``vllm:`` prefix.
    Raises:
        LlmdError: an unknown ``compat``.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, compat: str | None = None):
        if compat is not None and compat not in COMPAT_PREFIXES:
            raise LlmdError(f"--metrics-compat must be one of {sorted(COMPAT_PREFIXES)}, got {compat!r}")
        self.registry = CollectorRegistry()
        self.prefixes = [PREFIX] + ([COMPAT_PREFIXES[compat]] if compat else [])
        self._m: dict[str, list] = {}  # name -> its labelled child in each prefix
        self._success: list[dict] = []  # per prefix: finish reason -> labelled counter
        for prefix in self.prefixes:
            for cls, name, doc, buckets in SPECS:
                kw = {"buckets": buckets} if buckets else {}
                metric = cls(prefix + name, doc, ["model_name"], registry=self.registry, **kw)
                self._m.setdefault(name, []).append(metric.labels(model_name))
            success = Counter(prefix + "request_success", "Count of finished sequences.",
                              ["model_name", "finished_reason"], registry=self.registry)
            self._success.append({r: success.labels(model_name, r) for r in FINISH_REASONS})
        self._synced = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
                        "num_context_shifts": 0}
        self._engine_errors = Counter(PREFIX + "engine_errors", "Engine steps that failed as a whole (every live "
                                      "sequence then ended with finish_reason error).", ["model_name"],
                                      registry=self.registry).labels(model_name)
        # llmd: only (vLLM has no context shift), synced from the stats with the other cumulative counters
        self._m["num_context_shifts"] = [Counter(PREFIX + "num_context_shifts", "Cumulative number of context shifts "
                                                 "(--context-overflow shift).", ["model_name"],
                                                 registry=self.registry).labels(model_name)]

    # ---- fan-out over prefixes ----------------------------------------------------------
    def _inc(self, name: str, amount: float = 1.0) -> None:
        for m in self._m[name]:
            m.inc(amount)

    def _observe(self, name: str, seconds: float) -> None:
        for m in self._m[name]:
            m.observe(max(0.0, seconds))

    def _set(self, name: str, value: float) -> None:
        for m in self._m[name]:
            m.set(value)

    # ---- engine thread ------------------------------------------------------------------
    def record(self, it) -> None:
        """One or more engine steps' :class:`~llmd.daemon.core.stats.IterationStats` (seconds)."""
        if it.num_prompt_tokens:
            self._inc("prompt_tokens", it.num_prompt_tokens)
        if it.num_generation_tokens:
            self._inc("generation_tokens", it.num_generation_tokens)
        for t in it.time_to_first_tokens_s:
            self._observe("time_to_first_token_seconds", t)
        for t in it.inter_token_latencies_s:
            self._observe("inter_token_latency_seconds", t)
        for f in it.finished:
            self._observe("e2e_request_latency_seconds", f.e2e_latency_s)
            reason = f.finish_reason if f.finish_reason in FINISH_REASONS else "abort"
            for per_prefix in self._success:
                per_prefix[reason].inc()

    def engine_error(self) -> None:
        """One engine step failed as a whole (``llmd:engine_errors_total``)."""
        self._engine_errors.inc()

    # ---- event loop (scrape) ------------------------------------------------------------
    def refresh(self, stats) -> None:
        """Set the gauges (and sync the engine's cumulative prefix-cache and preemption
        counters) from the latest :class:`~llmd.daemon.core.stats.EngineStats`."""
        if stats is None:
            return
        self._set("num_requests_running", stats.scheduler.running)
        self._set("num_requests_waiting", stats.scheduler.waiting)
        self._set("kv_cache_usage_perc", min(1.0, max(0.0, float(stats.kv_cache.usage))))
        totals = {"prefix_cache_queries": stats.prefix_cache.queries, "prefix_cache_hits": stats.prefix_cache.hits,
                  "num_preemptions": stats.counters.num_preemptions,
                  "num_context_shifts": getattr(stats.scheduler, "context_shifts", 0)}
        for name, total in totals.items():
            delta = total - self._synced[name]
            if delta > 0:  # counters only go up; the snapshot may lag, never rewind
                self._inc(name, delta)
                self._synced[name] = total

    def render(self) -> bytes:
        """The registry in Prometheus text format (``content_type``)."""
        return generate_latest(self.registry)
