"""``GET /metrics`` (Prometheus text): the real session daemon, and the vLLM-compat names."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from llmd.daemon.core.stats import FinishedRequestStats, IterationStats
from llmd.daemon.serving.metrics import DaemonMetrics

VLLM_NAMES = ["vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
              "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
              "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
              "vllm:request_success_total"]


def parse(text: str) -> dict[tuple, float]:
    """Prometheus text → {(sample name, (label, value) pairs except model_name): value}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def scrape(daemon) -> dict[tuple, float]:
    conn, resp = daemon.client()._send("GET", "/metrics")
    try:
        assert resp.status == 200
        assert resp.getheader("Content-Type").startswith("text/plain")
        return parse(resp.read().decode())
    finally:
        conn.close()


def test_metrics_endpoint_counts_requests(llmd_daemon):
    c = llmd_daemon.client()
    llmd_daemon.wait_idle()
    before = scrape(llmd_daemon)
    r1 = c.completion(prompt="The capital of France is", max_tokens=5, temperature=0, ignore_eos=True)
    chunks = list(c.stream("/v1/chat/completions", dict(
        messages=[{"role": "user", "content": "Count to ten."}], max_tokens=7, temperature=0, ignore_eos=True,
        stream_options={"include_usage": True})))
    usages = [r1["usage"], chunks[-1]["usage"]]
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == 12
    llmd_daemon.wait_idle()
    after = scrape(llmd_daemon)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("llmd:generation_tokens_total") == generated
    assert 0 < delta("llmd:prompt_tokens_total") <= sum(u["prompt_tokens"] for u in usages)
    assert delta("llmd:time_to_first_token_seconds_count") == 2
    assert delta("llmd:e2e_request_latency_seconds_count") == 2
    assert delta("llmd:inter_token_latency_seconds_count") == generated - 2  # one token per step
    assert delta("llmd:request_success_total", finished_reason="length") == 2
    assert delta("llmd:time_to_first_token_seconds_sum") > 0
    assert 0.0 <= after[("llmd:kv_cache_usage_perc", ())] <= 1.0
    assert after[("llmd:num_requests_running", ())] == 0
    assert after[("llmd:num_requests_waiting", ())] == 0
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total"):
        assert ("llmd:" + name, ()) in after
    assert not any(k[0].startswith("vllm:") for k in after)  # compat names only when asked


def test_vllm_compat_names():
    m = DaemonMetrics("tiny", compat="vllm")

    def stats(running, waiting, usage):  # the fields of EngineStats that metrics read
        return SimpleNamespace(scheduler=SimpleNamespace(running=running, waiting=waiting),
                               kv_cache=SimpleNamespace(usage=usage), prefix_cache=SimpleNamespace(queries=8, hits=3),
                               counters=SimpleNamespace(num_preemptions=1))

    # a request arriving at 10.0: 4 prompt tokens, its first token at 10.5, the second (last) at 10.75
    m.record(IterationStats(num_prompt_tokens=4, num_generation_tokens=1, time_to_first_tokens_s=[0.5]))
    m.record(IterationStats(num_generation_tokens=1, inter_token_latencies_s=[0.25],
                            finished=[FinishedRequestStats("r-0", "stop", 0.75)]))
    m.refresh(stats(1, 2, 0.25))
    samples = parse(m.render().decode())
    for prefix in ("llmd:", "vllm:"):
        for name in VLLM_NAMES:
            key = prefix + name.split(":", 1)[1]
            assert any(k[0] == key for k in samples), key
        assert samples[(prefix + "kv_cache_usage_perc", ())] == 0.25
        assert samples[(prefix + "num_requests_waiting", ())] == 2
        assert samples[(prefix + "generation_tokens_total", ())] == 2
        assert samples[(prefix + "prompt_tokens_total", ())] == 4
        assert samples[(prefix + "prefix_cache_hits_total", ())] == 3
        assert samples[(prefix + "time_to_first_token_seconds_sum", ())] == 0.5
        assert samples[(prefix + "inter_token_latency_seconds_sum", ())] == 0.25
        assert samples[(prefix + "e2e_request_latency_seconds_sum", ())] == 0.75
        assert samples[(prefix + "request_success_total", (("finished_reason", "stop"),))] == 1
    m.refresh(stats(0, 0, 0.0))
    assert parse(m.render().decode())[("vllm:prefix_cache_hits_total", ())] == 3  # synced once, not re-added
    assert DaemonMetrics("a").registry is not DaemonMetrics("a").registry  # per-daemon registries


def test_serve_has_metrics_compat_option():
    from click.testing import CliRunner

    from llmd.daemon.cli.main import main

    out = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--metrics-compat" in out and "vllm" in out


def test_context_shifts_are_an_llmd_counter():
    """``llmd:num_context_shifts_total`` follows the stats' cumulative count (synced, never
    re-added), under the ``llmd:`` prefix only (vLLM has no context shift)."""
    m = DaemonMetrics("tiny", compat="vllm")

    def stats(shifts):
        return SimpleNamespace(scheduler=SimpleNamespace(running=0, waiting=0, context_shifts=shifts),
                               kv_cache=SimpleNamespace(usage=0.0), prefix_cache=SimpleNamespace(queries=0, hits=0),
                               counters=SimpleNamespace(num_preemptions=0))

    for shifts in (3, 5, 5):
        m.refresh(stats(shifts))
    samples = parse(m.render().decode())
    assert samples[("llmd:num_context_shifts_total", ())] == 5
    assert not any(k[0].startswith("vllm:num_context_shifts") for k in samples)
