"""One bad request never hurts the others, at the engine: a request whose postprocessing
raises, or whose logits row is NaN, ends alone with ``finish_reason="error"`` (blocks freed);
after a step that raised as a whole, :meth:`Engine.fail_requests` ends every sequence,
including one that finished in that very step. Faults come from the test hook
(``llmd.daemon.core.faults``) on the tiny random-GGUF engine."""

from __future__ import annotations

import json

import pytest
from tiny_engine import tiny_engine

from llmd.daemon.core.engine import float16_warning
from llmd.daemon.core.faults import FaultInjector, InjectedFault
from llmd.daemon.core.request import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("tiny") / "tiny.gguf", max_num_seqs=4)


def run(engine, seeds, max_tokens=6, **kw):
    """Greedy requests with these seeds; returns ({seed: outputs}, ids)."""
    ids = {s: engine.add_request(f"prompt {s}", SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=s, **kw))
           for s in seeds}
    by_id = {rid: s for s, rid in ids.items()}
    outs = {s: [] for s in seeds}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[by_id[o.request_id]].append(o)
    return outs


def assert_clean(engine):
    assert engine.kv_manager.num_used_blocks == 0 and not engine.requests and not engine.detokenizers
    engine.kv_manager.check_integrity()


@pytest.mark.parametrize("kind", ["postprocess", "nan"])
def test_one_request_fails_alone(engine, kind):
    """The victim (seed 12) gets exactly one terminal output, ``error`` at its 2nd token; the
    others' tokens equal a fault-free run's, and no NaN reaches their (or any) logprobs."""
    clean = run(engine, [11, 12, 13], logprobs=2)
    injector = FaultInjector.parse(f"{kind}:12@2").install(engine)
    try:
        outs = run(engine, [11, 12, 13], logprobs=2)
    finally:
        engine.faults = None
    assert injector.fired[kind] == 1
    victim = outs[12]
    assert [o.finished for o in victim] == [False, True]
    assert victim[-1].finish_reason == "error"
    assert ("postprocessing failed" if kind == "postprocess" else "non-finite logits") in victim[-1].error
    for s in (11, 13):
        assert [o.new_token_ids for o in outs[s]] == [o.new_token_ids for o in clean[s]]
        assert outs[s][-1].finish_reason == "length" and sum(o.finished for o in outs[s]) == 1
    lps = [[lp.logprob, lp.top] for o in sum(outs.values(), []) for lp in o.logprobs if lp is not None]
    json.dumps(lps, allow_nan=False)  # raises on NaN / inf
    assert engine.counters.requests_finished["error"] >= 1
    assert_clean(engine)


def test_step_failure_then_fail_requests_ends_every_sequence(engine):
    """The step fault fires at seed 21's 3rd token, which is also its last (max_tokens 3): it
    left the scheduler in that step, yet ``fail_requests`` still ends it; the live ones too."""
    FaultInjector.parse("step:21@3").install(engine)
    try:
        ids = [engine.add_request(f"p{s}", SamplingParams(max_tokens=3 if s == 21 else 8, temperature=0.0, seed=s))
               for s in (21, 22, 23)]
        outs = []
        with pytest.raises(InjectedFault):
            for _ in range(10):
                outs += engine.step()
    finally:
        engine.faults = None
    assert ids[0] not in engine.requests  # finished (length) in the failed step, output never made
    final = engine.fail_requests(ids, "step failed")
    assert sorted(o.request_id for o in final) == sorted(ids)
    assert all(o.finished and o.finish_reason == "error" and o.error == "step failed" for o in final)
    assert not any(o.finished for o in outs) and engine.fail_requests(ids, "again") == []
    assert_clean(engine)


def test_float16_warning_names_gemma3_only():
    assert "bfloat16" in float16_warning("gemma3", "float16")
    assert float16_warning("gemma3", "bfloat16") is None and float16_warning("llama", "float16") is None


def test_fault_spec_errors_name_the_entry():
    with pytest.raises(ValueError, match="'oops:1'"):
        FaultInjector.parse("nan:1,oops:1")
    assert FaultInjector.parse("hang:5@2=0.5").faults[0].value == 0.5
