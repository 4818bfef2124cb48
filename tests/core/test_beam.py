"""Beam search (daemon/core/beam.py): vLLM's length-penalty scoring, the selection rules, and
the engine's beam groups on a tiny random float64 Llama: block sharing, dropped beams freeing
their blocks, prefix caching, chunked prefill and preemption leaving the beams unchanged,
aborts. The HF reference on SmolLM2 is tests/core/test_beam_reference.py."""

from __future__ import annotations

import pytest
import torch

from llmd.daemon.core.beam import BeamGroup, beam_score, check_beam_params, num_candidates
from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.errors import RequestError
from llmd.daemon.core.parallel import child_request_ids
from llmd.daemon.core.request import Request, RequestStatus, SamplingParams

STOP = 10  # the byte tokenizer has no EOS: token 10 ("\n") is the stop token id of these tests


def vllm_beam_search_score(tokens, cumulative_logprob, eos_token_id, length_penalty=1.0):
    """vLLM v0 ``vllm/sequence.py`` ``Sequence.get_beam_search_score`` (verbatim logic)."""
    seq_len = len(tokens)
    if tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


@pytest.mark.parametrize("penalty", [-0.5, 0.0, 0.7, 1.0, 2.0])
def test_length_penalty_is_vllms(penalty):
    for tokens, cum in (([5, 6, 7, 8, 9], -3.25), ([5, 6, 7, STOP], -1.5), ([5] * 17 + [STOP], -12.0)):
        ours = beam_score(cum, len(tokens), tokens[-1] == STOP, penalty)
        assert ours == pytest.approx(vllm_beam_search_score(tokens, cum, STOP, penalty), rel=1e-15)


def _group(width=2, early_stopping=False, penalty=0.0, max_tokens=8, prompt=3):
    slots = [Request(f"g-{i}", list(range(1, prompt + 1)), SamplingParams(temperature=0.0)) for i in range(width)]
    for r in slots:
        r.status = RequestStatus.RUNNING
    return BeamGroup(slots, frozenset({STOP}), width, penalty, early_stopping, max_tokens, 1000), slots


def _report(g, slots, rows):
    for r, top in zip(slots, rows):
        g.reports[r.request_id] = sorted(top, key=lambda t: -t[1])


def test_penalty_ranks_the_hypotheses():
    """Two hypotheses: a short one with the better cumulative logprob, a longer one with the
    better per-token score. length_penalty 0 ranks by cumulative logprob, 1 by it over prompt
    + output (the EOS not counted): exactly vLLM's scores."""
    for penalty, best in ((0.0, [STOP]), (1.0, [20, 21, STOP])):
        g, s = _group(width=2, penalty=penalty, prompt=3)
        _report(g, s, [[(20, -0.1), (STOP, -0.15), (30, -0.2), (31, -5.0)]])
        beams = g.step(s)  # hypothesis [STOP] at -0.15 (rank 1); beams 20 and 30
        assert [(t, c) for _, t, c in beams] == [(20, -0.1), (30, -0.2)] and len(g.hyps) == 1
        s[0].token_ids.append(20)
        s[1].token_ids.append(30)
        g.cum = {"g-0": -0.1, "g-1": -0.2}
        _report(g, s, [[(21, -0.02), (40, -3.0), (41, -3.1), (42, -3.2)],
                       [(50, -4.0), (51, -4.1), (52, -4.2), (53, -4.3)]])
        assert [t for _, t, _ in g.step(s)] == [21, 40]
        s[0].token_ids.append(21)
        s[1].token_ids[-1] = 20
        s[1].token_ids.append(40)
        g.cum = {"g-0": -0.12, "g-1": -3.1}
        _report(g, s, [[(STOP, -0.1), (60, -6.0), (61, -6.1), (62, -6.2)],
                       [(70, -6.0), (71, -6.1), (72, -6.2), (73, -6.3)]])
        g.step(s)
        scores = {tuple(h.output_token_ids): h.score for h in g.hyps}
        assert scores[(STOP,)] == pytest.approx(vllm_beam_search_score([1, 2, 3, STOP], -0.15, STOP, penalty))
        assert scores[(20, 21, STOP)] == pytest.approx(
            vllm_beam_search_score([1, 2, 3, 20, 21, STOP], -0.22, STOP, penalty))
        assert g.hyps[0].output_token_ids == best


def test_eos_counts_only_within_the_first_width_ranks_and_early_stopping():
    """HF's rule: a stop token ranked beyond beam_width among the candidates is no hypothesis;
    early_stopping True ends once beam_width hypotheses exist, False only when the best live
    beam cannot beat the worst of them."""
    g, s = _group(width=2)
    _report(g, s, [[(20, -0.1), (21, -0.2), (STOP, -0.3), (22, -0.4)]])
    assert [t for _, t, _ in g.step(s)] == [20, 21] and g.hyps == []
    assert num_candidates(2, 1) == 4 and num_candidates(4, 2) == 12
    for early, ends in ((True, True), (False, False)):
        g, s = _group(width=2, early_stopping=early)
        _report(g, s, [[(STOP, -0.1), (20, -0.2), (30, -0.3), (31, -0.4)]])
        g.step(s)
        s[0].token_ids.append(20)
        s[1].token_ids.append(30)
        g.cum = {"g-0": -0.2, "g-1": -0.3}
        _report(g, s, [[(STOP, -0.5), (21, -0.6), (22, -0.7), (23, -0.8)], [(32, -0.1), (33, -2.0), (34, -2.1),
                                                                           (35, -2.2)]])
        beams = g.step(s)  # hypotheses -0.1 and -0.7; the best live beam is at -0.4 > -0.7
        assert (beams is None) == ends and len(g.hyps) == 2
    g.cum = {"g-0": -0.4, "g-1": -0.8}
    s[0].token_ids.append(32)
    s[1].token_ids.append(21)
    _report(g, s, [[(40, -0.5), (41, -0.6), (42, -0.7), (43, -0.8)], [(44, -0.1), (45, -0.2), (46, -0.3), (47, -0.4)]])
    assert g.step(s) is None  # best live -0.9 <= worst hypothesis -0.7: it cannot improve


@pytest.mark.parametrize("field,change", [("temperature", {"temperature": 0.7}), ("n", {}),
                                          ("stop", {"stop": ["x"]}), ("logprobs", {"logprobs": 1}),
                                          ("early_stopping", {"early_stopping": "sometimes"}),
                                          ("repetition_penalty", {"repetition_penalty": 1.2}),
                                          ("min_tokens", {"min_tokens": 2})])
def test_invalid_combinations_name_the_field(field, change):
    params = SamplingParams(**{"temperature": 0.0, "use_beam_search": True, **change})
    with pytest.raises(RequestError) as e:
        check_beam_params(params, 1 if field == "n" else 2)
    assert e.value.param == field


# ---- the engine on a tiny random float64 Llama ------------------------------------------
@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    from tiny_engine import VOCAB
    from tiny_gguf import write_tiny_llama

    from llmd.models.gguf_loader import load_model

    path = tmp_path_factory.mktemp("beam") / "tiny.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=VOCAB)
    return load_model(str(path), torch.float64, "cpu")[0]


def make(tiny64, **kw) -> Engine:
    from tiny_engine import ByteTokenizer

    cfg = dict(device="cpu", dtype="float64", attention_backend="torch", threads=1, kv_cache_memory=2 * 2**20,
               prefix_cache_seed=0, block_size=4, max_model_len=256)
    return Engine(tiny64, ByteTokenizer(), EngineConfig(**{**cfg, **kw}))


PROMPTS = ["the cat sat on", "beam search shares blocks", "a"]


def run(engine: Engine, width=4, max_tokens=12, early_stopping=False, others=(), check=False):
    """Beam groups of every prompt (and greedy ``others``) at once; per group its beams in
    rank order; also the peak of blocks in use and whether integrity held every step."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, use_beam_search=True, length_penalty=0.0,
                        early_stopping=early_stopping, stop_token_ids=[STOP])
    for i, p in enumerate(PROMPTS):
        engine.add_parallel_request(p, sp, child_request_ids(f"b{i}", width), parent_id=f"b{i}")
    for i, p in enumerate(others):
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0), f"o{i}")
    res, peak = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            res[o.request_id] = (o.index, o.new_token_ids, o.finish_reason)
        peak = max(peak, engine.kv_manager.num_used_blocks)
        if check:
            engine.kv_manager.check_integrity()
    groups = [[res[c][1:] for c in child_request_ids(f"b{i}", width)] for i in range(len(PROMPTS))]
    return groups, peak


def test_beams_share_blocks_and_free_them(tiny64):
    """Four beams of 14 tokens of prompt: forks share every block of their history (peak far
    below four independent sequences, and below the same search copying its blocks), every
    block is back when the groups end, and integrity holds at every step."""
    e = make(tiny64, enable_prefix_caching=False)
    shared, peak_shared = run(e, check=True)
    assert e.kv_manager.num_used_blocks == 0 and not e.requests
    e.beams.share_blocks = False
    copied, peak_copied = run(e, check=True)
    assert copied == shared
    independent = sum(4 * -(-(len(p) + 12) // 4) for p in PROMPTS)
    assert peak_shared < 0.75 * peak_copied <= 0.75 * independent, (peak_shared, peak_copied, independent)
    for beams in shared:
        assert len({tuple(b[0]) for b in beams}) == 4  # four distinct beams, each a full answer
        assert all(reason in ("stop", "length") for _, reason in beams)


def test_prefix_cache_chunks_and_preemption_leave_the_beams_unchanged(tiny64):
    """The same beams with prefix caching on, with 3-token prefill chunks, and in a pool so
    small that beams are preempted (alongside greedy requests) and recomputed."""
    want, _ = run(make(tiny64, enable_prefix_caching=False), max_tokens=10)
    assert run(make(tiny64, enable_prefix_caching=True), max_tokens=10)[0] == want
    assert run(make(tiny64, max_prefill_chunk=3, max_num_batched_tokens=8), max_tokens=10)[0] == want
    tight = make_tight(tiny64, blocks=40)
    got, _ = run(tight, max_tokens=10, others=["x" * 9, "y" * 5], check=True)
    assert got == want
    assert tight.scheduler.num_preemptions > 0
    assert tight.kv_manager.num_used_blocks == 0


def make_tight(tiny64, blocks: int) -> Engine:
    """An engine whose KV pool holds ``blocks`` blocks (block 0 is the null block)."""
    probe = make(tiny64)
    return make(tiny64, kv_cache_memory=blocks * probe.block_bytes)


def test_abort_by_parent_frees_every_beam(tiny64):
    e = make(tiny64)
    sp = SamplingParams(max_tokens=20, temperature=0.0, use_beam_search=True)
    e.add_parallel_request("abort me", sp, child_request_ids("p", 3), parent_id="p")
    for _ in range(4):
        e.step()
    assert e.kv_manager.num_used_blocks > 0
    assert e.abort("p")
    assert e.kv_manager.num_used_blocks == 0 and not e.requests and "p-0" not in e.beams
    e.kv_manager.check_integrity()


@pytest.mark.parametrize("target", ["p-0", "p-2"])
def test_abort_of_one_beams_id_ends_the_whole_search(tiny64, target):
    """Aborting one beam's sequence id (as ``llmd ps`` and ``/v1/stats`` list them) aborts the
    whole search: slots are reassigned every step, so one slot alone means nothing. Every
    beam leaves with its blocks and no beam reports later; parallel sampling beside it keeps
    its per-sequence abort (the other sequences run to their end)."""
    e = make(tiny64)
    sp = SamplingParams(max_tokens=20, temperature=0.0, use_beam_search=True, ignore_eos=True)
    e.add_parallel_request("abort me", sp, child_request_ids("p", 3), parent_id="p")
    e.add_parallel_request("sample me", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           child_request_ids("q", 3), parent_id="q")
    for _ in range(4):
        e.step()
    live = [e.requests[b] for b in child_request_ids("p", 3)]
    g = e.beams._group_of[live[0].request_id]
    ranked = sorted(live, key=lambda r: -beam_score(g.cum[r.request_id], r.num_tokens, False, g.length_penalty))
    expected = {f"p-{i}": list(r.output_token_ids) for i, r in enumerate(ranked)}  # best first, into slot order
    outs = e.abort_requests(e.abort_members(target))
    # the search's answer so far: every beam's tokens and text, best first, as a finished search answers
    assert {o.request_id: o.new_token_ids for o in outs} == expected and all(len(t) == 4 for t in expected.values())
    assert all(o.finish_reason == "abort" and o.new_text == e.tokenizer.decode(o.new_token_ids)
               and o.num_output_tokens == 4 for o in outs)
    beams = child_request_ids("p", 3)
    assert not set(beams) & (set(e.requests) | set(e.kv_manager.req_to_blocks))
    assert "p" not in e.parallel and not any(b in e.beams for b in beams)
    assert e.abort("q-1") and sorted(e.requests) == ["q-0", "q-2"]
    ends = {}
    while e.has_unfinished_requests():
        for o in e.step():
            assert o.request_id in ("q-0", "q-2"), o
            if o.finished:
                ends[o.request_id] = o.finish_reason
    assert ends == {"q-0": "length", "q-2": "length"}
    assert e.kv_manager.num_used_blocks == 0
    e.kv_manager.check_integrity()
