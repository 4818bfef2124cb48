"""``llmd bench prefix`` on a small workload: both scenarios run, caching computes fewer prompt
tokens, and the printed table carries the ratios."""

from llmd.daemon.bench.prefix import run_prefix_bench


def test_bench_prefix_small(make_engine):
    lines: list[str] = []
    # a budget below the concurrent scenario's total prompt (4 x ~90 tokens), so later requests
    # are admitted after the first has computed (and cached) the system prompt
    res = run_prefix_bench(make_engine(max_num_batched_tokens=128), system_tokens=80, users=2, turns=2, max_tokens=3,
                           echo=lines.append)
    for name in ("sequential", "concurrent"):
        on, off = res[name][True], res[name][False]
        assert len(on.ttfts) == len(off.ttfts) == 4
        assert on.prefill_tokens < off.prefill_tokens
    # sequential: every turn after a chat's first reuses at least the 64 full system-prompt tokens
    assert res["sequential"][False].prefill_tokens - res["sequential"][True].prefill_tokens >= 2 * 64
    text = "\n".join(lines)
    assert "median TTFT off / on" in text and "prompt tokens off / on" in text and "prefix cache (on)" in text
