"""Engine on the real SmolLM2: continuous batching is batch-invariant, aborts free every block."""

import pytest
import torch

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.request import SamplingParams


def mixed_prompts(tokenizer) -> list[list[int]]:
    texts = [
        "Hi",
        "The quick brown fox",
        "Write a haiku about the sea.",
        "Explain why the sky is blue in two sentences.",
        "List three prime numbers:",
        "Once upon a time, in a small village by the mountains, there lived an old clockmaker who " * 3,
        "def fibonacci(n):",
        "Translate to French: good morning, my friend. How are you today? " * 4,
    ]
    return [tokenizer.encode(t) for t in texts]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_batch_invariance_and_mixed_steps(make_engine, smollm2_tokenizer):
    """8 mixed-length requests together give exactly the tokens each gives alone; the schedule
    really batched them (>= 2 requests in most steps, a step mixing prefill with decode)."""
    prompts = mixed_prompts(smollm2_tokenizer)
    assert len({len(p) for p in prompts}) == 8
    solo = []
    for p in prompts:
        [r] = make_engine().generate([p], greedy(10))
        solo.append(r["token_ids"])

    engine = make_engine(max_num_batched_tokens=64)
    ids = [engine.add_request(p, greedy(10)) for p in prompts[:4]]
    got = {i: [] for i in ids}
    steps = []
    while engine.has_unfinished_requests():
        if len(steps) == 3:  # late arrivals join while the first four decode
            for p in prompts[4:]:
                rid = engine.add_request(p, greedy(10))
                ids.append(rid)
                got[rid] = []
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
        steps.append(engine.last_scheduler_output)
    assert [got[i] for i in ids] == solo
    multi = sum(len(s.scheduled) >= 2 for s in steps)
    assert multi >= 0.8 * len(steps)
    assert any(s.num_prefills and s.num_decodes for s in steps)
    assert max(s.total_num_scheduled_tokens for s in steps) <= 64
    engine.kv_manager.check_integrity()
    assert engine.kv_manager.num_used_blocks == 0


def test_aborts_free_every_block(make_engine, smollm2_tokenizer):
    engine = make_engine(max_num_batched_tokens=32, max_num_seqs=4)
    prompts = mixed_prompts(smollm2_tokenizer)
    ids = [engine.add_request(p, greedy(12)) for p in prompts]
    engine.abort(ids[7])  # still waiting
    finished = {}
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        if step == 2:
            engine.abort(ids[5])  # mid-prefill (long prompt, 32-token budget)
        if step == 6:
            engine.abort(ids[0])  # decoding
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.finish_reason
        engine.kv_manager.check_integrity()
    assert not engine.has_unfinished_requests()
    assert set(finished) == set(ids) - {ids[0], ids[5], ids[7]}
    assert set(finished.values()) == {"length"}
    assert engine.kv_manager.num_used_blocks == 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_usable_blocks
    assert engine.abort(ids[0]) is False  # idempotent


def test_stop_string_ends_request(make_engine, smollm2_tokenizer):
    engine = make_engine()
    p = smollm2_tokenizer.encode("Count: 1, 2, 3, 4, 5,")
    [full] = engine.generate([p], greedy(12))
    stop = full["text"][4:7]
    assert stop.strip()
    [cut] = engine.generate([p], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]))
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert engine.kv_manager.num_used_blocks == 0


def test_stop_token_ends_request_without_its_text(make_engine, smollm2_tokenizer):
    """A ``stop_token_ids`` token ends the request with its id (and logprob) in the output and
    its text left out, as vLLM's detokenizer does (found by a user: ``" 3,"`` for a stop on ``,``)."""
    engine = make_engine()
    p = smollm2_tokenizer.encode("Count: 1, 2, 3, 4, 5,")
    [full] = engine.generate([p], greedy(12))
    ids = full["token_ids"]
    k = 2
    stop = ids[k]
    assert smollm2_tokenizer.decode([stop]).strip() and ids.index(stop) == k
    [cut] = engine.generate([p], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop]))
    assert cut["finish_reason"] == "stop"
    assert cut["token_ids"] == ids[: k + 1]
    assert cut["text"] == smollm2_tokenizer.decode(ids[:k])
    assert engine.kv_manager.num_used_blocks == 0


def test_stop_string_completed_by_the_last_token_is_stop(make_engine, smollm2_tokenizer):
    """A stop string that the max_tokens-th token completes cuts the text there and finishes with
    "stop", not "length" (found by a user; vLLM reports "stop")."""
    engine = make_engine()
    p = smollm2_tokenizer.encode("Count: 1, 2, 3, 4, 5,")
    [full] = engine.generate([p], greedy(12))
    ids = full["token_ids"]
    for k in range(2, 11):
        head = smollm2_tokenizer.decode(ids[: k + 1])
        stop = head[-2:]
        if stop.strip() and head.find(stop) == len(head) - 2 and smollm2_tokenizer.decode(ids[:k]) != head:
            break
    [cut] = engine.generate([p], SamplingParams(max_tokens=k + 1, temperature=0.0, stop=[stop]))
    assert (cut["finish_reason"], cut["text"]) == ("stop", head[:-2]), (k, stop, cut)
    assert engine.kv_manager.num_used_blocks == 0


def test_min_tokens_holds_off_stop_tokens_and_strings(make_engine, smollm2_tokenizer):
    """vLLM's min_tokens on the real model: the stop token that ended the greedy text at position
    k is masked until min_tokens, and a stop string is looked for only after them."""
    engine = make_engine()
    p = smollm2_tokenizer.encode("Count: 1, 2, 3, 4, 5,")
    [full] = engine.generate([p], greedy(12))
    ids, k = full["token_ids"], 2
    sp = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ids[k]], min_tokens=k + 3)
    [held] = engine.generate([p], sp)
    assert len(held["token_ids"]) >= k + 3 and ids[k] not in held["token_ids"][: k + 3]
    stop = smollm2_tokenizer.decode(ids[k:k + 1])
    [cut] = engine.generate([p], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], min_tokens=k + 1))
    assert len(cut["token_ids"]) > k + 1 and cut["text"].count(stop) >= 1
    assert engine.kv_manager.num_used_blocks == 0


def test_seeded_sampling_is_reproducible_across_batches(make_engine, smollm2_tokenizer):
    p = smollm2_tokenizer.encode("My favourite animal is")
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234)
    engine = make_engine()
    [alone] = engine.generate([p], params)
    others = mixed_prompts(smollm2_tokenizer)[:3]
    res = engine.generate([others[0], p, others[1], others[2]],
                          [greedy(10), SamplingParams(**vars(params)), greedy(5), greedy(7)])
    assert res[1]["token_ids"] == alone["token_ids"]


@pytest.mark.parametrize(
    "kw, prompt_len, max_tokens, match",
    [
        ({"max_model_len": 64}, 64, 1, r"prompt has 64 tokens but the context is 64 tokens"),
        ({"max_model_len": 64}, 60, 10, r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 exceeds the context of 64"),
        ({"kv_cache_memory": 10 * 16 * 46080}, 100, 100, r"needs 13 KV blocks .* only 9"),
        ({}, 0, 5, "prompt is empty"),
    ],
)
def test_bad_requests_are_rejected_clearly(make_engine, kw, prompt_len, max_tokens, match):
    engine = make_engine(**kw)
    with pytest.raises(LlmdError, match=match):
        engine.add_request([100] * prompt_len, greedy(max_tokens))
    assert not engine.has_unfinished_requests()
    [ok] = engine.generate([[100] * 5], greedy(2))  # the engine still serves
    assert len(ok["token_ids"]) == 2


def test_missing_max_tokens_means_remaining_context(make_engine):
    engine = make_engine(max_model_len=40)
    rid = engine.add_request([100] * 30, SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    assert engine.scheduler.requests[rid].sampling_params.max_tokens == 10
    n = 0
    while engine.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in engine.step())
    assert n == 10


def test_kv_pool_size_is_exact(make_engine, smollm2):
    cfg = smollm2[1]
    bpt = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    memory = 3_000_000
    engine = make_engine(kv_cache_memory=memory, block_size=16)
    assert engine.bytes_per_token == bpt == 46080
    assert engine.num_blocks == memory // (16 * bpt)
    assert engine.runner.kv_caches[0].shape == (2, engine.num_blocks, 16, cfg.num_kv_heads, cfg.head_dim)
    assert engine.runner.kv_caches[0].dtype == torch.float32
