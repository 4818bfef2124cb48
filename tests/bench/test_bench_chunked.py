"""``llmd bench chunked-prefill`` on a small workload: both modes run to completion, the chunked
one splits the long prompt over more steps, and the table carries the ITL ratio."""

from llmd.daemon.bench.chunked import run_chunked_prefill_bench


def test_bench_chunked_prefill_small(make_engine):
    lines: list[str] = []
    res = run_chunked_prefill_bench(make_engine(max_num_batched_tokens=32), num_decoders=2, decode_tokens=6,
                                    long_prompt=120, period=3, echo=lines.append)
    on, off = res[True], res[False]
    assert on["long_prompts"] == off["long_prompts"] == 1  # at 3 decoded tokens (6 is the end)
    assert on["steps"] > off["steps"]  # 120 prompt tokens over 32-token steps vs one step
    assert on["itl_p99_ms"] > 0 and off["itl_p99_ms"] > 0
    assert "ITL p99 off / on" in lines[-1]
