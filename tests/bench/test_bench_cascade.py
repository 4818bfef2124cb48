"""``llmd bench cascade`` on a small workload: both settings run, the cascade is really taken
with the flag off and never with ``--disable-cascade-attn``, and the tokens agree (float32)."""

from llmd.daemon.bench.cascade import run_cascade_bench
from llmd.kernels import cpu_cascade


def test_bench_cascade_small(make_engine, monkeypatch):
    found: list = []
    real = cpu_cascade.find_cascades

    def spy(*a):
        found.append(real(*a))
        return found[-1]

    monkeypatch.setattr(cpu_cascade, "find_cascades", spy)
    lines: list[str] = []
    # a budget below the 4 prompts' total, so the later ones hit the cached system prompt
    res = run_cascade_bench(make_engine(attention_backend="cpu", max_num_batched_tokens=128), system_tokens=96,
                            users=4, max_tokens=4, repeats=1, echo=lines.append)
    assert any(found)  # cascades planned (only the engine without the flag looks for them)
    assert res[True].outputs == res[False].outputs and all(len(o) == 4 for o in res[True].outputs)
    assert res[True].decode_steps and res[False].decode_steps
    text = "\n".join(lines)
    assert "cascade on :" in text and "cascade off:" in text and "same tokens: True" in text


def test_disable_cascade_attn_reaches_the_metadata(make_engine):
    eng = make_engine(attention_backend="cpu", disable_cascade_attn=True)
    assert eng.runner.inputs.cascade_attn is False
    assert make_engine(attention_backend="cpu").runner.inputs.cascade_attn is True
