"""Prefix caching and parallel sampling on the real SmolLM2 (cases P1, P2) and on the KV
manager alone (LRU eviction, hash isolation, a hypothesis run with hits, evictions, forks
and aborts)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd.daemon.core.request import SamplingParams
from llmd.daemon.kv import KVCacheManager
from llmd.daemon.kv.prefix_cache import extra_keys, hash_block_tokens

GREEDY8 = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)


def run(engine, prompt: list[int], params: SamplingParams = GREEDY8, salt: str | None = None) -> dict:
    """One request to completion: tokens, top logprobs, cached tokens and tokens the runner computed."""
    rid = engine.add_request(list(prompt), params, cache_salt=salt)
    out = {"tokens": [], "top": [], "cached": None, "computed": 0}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out["tokens"] += o.new_token_ids
            out["top"] += [lp.top for lp in o.logprobs if lp is not None]
            out["cached"] = o.num_cached_tokens
        out["computed"] += sum(s.num_new_tokens for s in engine.last_scheduler_output.scheduled if s.request_id == rid)
        engine.kv_manager.check_integrity()
    return out


def assert_same_output(a: dict, b: dict, tol: float = 1e-4) -> None:
    assert a["tokens"] == b["tokens"]
    for ta, tb in zip(a["top"], b["top"]):
        assert [t for t, _ in ta] == [t for t, _ in tb]
        assert max(abs(x - y) for (_, x), (_, y) in zip(ta, tb)) < tol


def test_p1_block_aligned_hits(make_engine):
    """Case P1: three identical 32-token prompts give identical outputs; requests 2 and 3
    report 16 cached tokens (full blocks only, never the last prompt token); 31 -> 16,
    33 -> 32, 48 -> 32; the query/hit counters add up."""
    engine = make_engine(prefix_cache_seed=1)
    prompt = list(range(500, 548))
    first, second, third = (run(engine, prompt[:32]) for _ in range(3))
    assert first["cached"] == 0 and second["cached"] == third["cached"] == 16
    assert first["tokens"] == second["tokens"] == third["tokens"]
    assert second["computed"] == 32 - 16 + 7  # the runner saw only the uncached tokens, then 7 decodes
    for n, want in ((31, 16), (33, 32), (48, 32)):
        assert run(engine, prompt[:n])["cached"] == want, n
    kv = engine.kv_manager
    assert kv.prefix_cache_queries == 3 * 32 + 31 + 33 + 48
    assert kv.prefix_cache_hits == 16 + 16 + 16 + 32 + 32
    assert kv.num_used_blocks == 0 and kv.block_pool.num_cached_free_blocks > 0


def test_p2_salts_isolate(make_engine):
    """Case P2: salt "a" then "b": 0 cached; "a" again: >= 32."""
    engine = make_engine(prefix_cache_seed=2)
    prompt = list(range(700, 748))
    assert run(engine, prompt, salt="a")["cached"] == 0
    assert run(engine, prompt, salt="b")["cached"] == 0
    assert run(engine, prompt, salt="a")["cached"] >= 32
    assert run(engine, prompt)["cached"] == 0  # no salt is its own namespace


def test_extra_keys_isolate_model_and_kv_dtype():
    """Same tokens, different model, KV dtype or salt: different block hashes."""
    toks = list(range(16))
    keys = {extra_keys("smollm2", "auto", None), extra_keys("smollm2", "int8", None),
            extra_keys("gemma3", "auto", None), extra_keys("smollm2", "auto", "a"), extra_keys("smollm2", "auto", "")}
    assert len({hash_block_tokens(b"root", toks, k) for k in keys}) == 5
    assert hash_block_tokens(b"root", toks, b"") != hash_block_tokens(b"other", toks, b"")


def test_shared_system_prompt_skips_prefill_and_poison_changes_logits(make_engine, smollm2_tokenizer):
    """A 1,000-token system prompt shared by two requests: the second feeds the model only its
    new tokens and matches a cache-off engine; poisoning the cached K/V changes its logits."""
    system = smollm2_tokenizer.encode("You are a careful assistant who answers in short sentences. " * 90)[:1000]
    q1 = smollm2_tokenizer.encode(" Question: what is the capital of France?")
    q2 = smollm2_tokenizer.encode(" Question: name a prime number larger than ten.")
    on = make_engine(prefix_cache_seed=3)
    run(on, system + q1)
    hit = run(on, system + q2)
    assert hit["cached"] == 1000 // 16 * 16
    assert hit["computed"] == len(system + q2) - hit["cached"] + 7
    off = run(make_engine(enable_prefix_caching=False), system + q2)
    assert off["cached"] == 0 and off["computed"] == len(system + q2) + 7
    assert_same_output(hit, off)
    # poison every cached block's K/V through the runner's tensors: the next hit must differ
    pool = on.kv_manager.block_pool
    ids = torch.tensor([b.block_id for b in pool.cached_block_hash_to_block.values()])
    gen = torch.Generator().manual_seed(0)
    for cache in on.runner.caches:
        cache.data[:, ids] = torch.randn(cache.data[:, ids].shape, generator=gen) * 3
    poisoned = run(on, system + q2)
    assert poisoned["cached"] == hit["cached"]
    assert max(abs(x - y) for (_, x), (_, y) in zip(poisoned["top"][0], hit["top"][0])) > 1e-2


def test_parallel_sampling_shares_the_prompt(make_engine):
    """n=4 with a seed: reproducible, >= 3 distinct choices, the prompt prefilled once, its
    full blocks held 4 times while running and released after; one copy per appending sibling."""
    engine = make_engine(prefix_cache_seed=4)
    prompt = list(range(900, 940))  # 2 full blocks + 8 tokens in a shared partial block
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True)

    def go():
        ids = engine.add_parallel_request(prompt, sp, [f"s-{i}" for i in range(4)])
        toks, refs, copies, prompt_computed = {i: [] for i in ids}, [], [], 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            so = engine.last_scheduler_output
            prompt_computed += sum(s.num_new_tokens for s in so.scheduled if s.is_prefill)
            copies += so.blocks_to_copy
            for o in outs:
                toks[o.request_id] += o.new_token_ids
            live = engine.kv_manager.request_ids()
            if len(live) == 4:
                table = engine.kv_manager.get_block_table(live[0])[:2]
                refs.append([engine.kv_manager.block_pool.blocks[b].ref_cnt for b in table])
            engine.kv_manager.check_integrity()
        return [toks[i] for i in ids], refs, copies, prompt_computed

    a, refs, copies, prompt_computed = go()
    assert prompt_computed == 40  # prefilled once
    assert refs and all(r == [4, 4] for r in refs)
    assert len(copies) == 3  # the last sibling to append owns the partial block outright
    assert all(len(t) == 12 for t in a) and len({tuple(t) for t in a}) >= 3
    engine.reset_prefix_cache()
    b, _, _, _ = go()
    assert a == b
    assert engine.kv_manager.num_used_blocks == 0
    assert all(blk.ref_cnt == 0 for blk in engine.kv_manager.block_pool.blocks)


def test_lru_eviction_order_under_a_small_pool():
    """Cached free blocks are evicted LRU, a chain's tail before its head, only when a new block
    is needed; blocks in use are never evicted."""
    m = KVCacheManager(num_blocks=9, block_size=2, enable_caching=True, prefix_cache_seed=0)
    a, b = [1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15]

    def admit(rid, toks):
        n, blocks = m.get_computed_blocks(rid, toks, len(toks))
        assert m.allocate_slots(rid, len(toks), n, blocks) is not None
        m.cache_blocks(rid, toks, len(toks))
        return n

    admit("a", a)  # blocks 1-4 (3 full + 1 partial)
    admit("b", b)  # blocks 5-7
    m.free("a")
    m.free("b")
    order = [blk.block_id for blk in m.block_pool.free_block_queue.get_all_free_blocks()]
    assert order == [7, 4, 8, 3, 2, 1, 6, 5]  # unhashed blocks first, then a's chain tail-first, then b's
    assert admit("a2", a) == 6  # hit on a's 3 full blocks (not the last token's block); + new block 7
    assert m.get_block_table("a2") == [1, 2, 3, 7]
    assert m.allocate_slots("x", 2 * 3) is not None  # 3 blocks: 4, 8 (unhashed), then 6 (b's tail)
    assert m.get_block_table("x") == [4, 8, 6]
    assert m.block_pool.num_evictions == 1 and m.get_block_table("a2")[:3] == [1, 2, 3]
    m.free("x")
    assert admit("b2", b) == 2  # b's head survived; its tail was evicted
    m.check_integrity()


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "grow", "fork", "free", "reset"]), st.integers(0, 5),
                              st.integers(1, 30)), min_size=1, max_size=40))
def test_hypothesis_hits_evictions_forks_aborts(ops):
    """Random admissions with shared prefixes (cache hits), growth, forks, aborts and resets on a
    tiny pool: check_integrity after every operation; all blocks free at the end."""
    m = KVCacheManager(num_blocks=24, block_size=4, enable_caching=True, prefix_cache_seed=0)
    toks: dict[str, list[int]] = {}
    counter = 0
    for op, k, n in ops:
        live = sorted(toks)
        if op == "new":
            rid, seq = f"r{counter}", [k % 3] * 8 + list(range(n))  # 3 shared prefixes
            counter += 1
            hit, blocks = m.get_computed_blocks(rid, seq, len(seq))
            assert hit % 4 == 0 and hit < len(seq)
            if m.allocate_slots(rid, len(seq), hit, blocks) is not None:
                m.cache_blocks(rid, seq, len(seq))
                toks[rid] = seq
            else:
                assert rid not in m.req_to_blocks
        elif op == "grow" and live:
            rid = live[k % len(live)]
            seq = toks[rid] + [n] * (n % 5 + 1)
            if m.allocate_slots(rid, len(seq), len(toks[rid])) is not None:
                m.cache_blocks(rid, seq, len(seq))
                toks[rid] = seq
        elif op == "fork" and live:
            parent, child = live[k % len(live)], f"r{counter}"
            counter += 1
            m.fork(parent, child)
            toks[child] = list(toks[parent])
        elif op == "free" and live:
            rid = live[k % len(live)]
            m.free(rid)
            del toks[rid]
        elif op == "reset":
            m.reset_prefix_cache()
        m.take_pending_copies()
        m.check_integrity()
        for rid, seq in toks.items():
            assert len(m.get_block_table(rid)) == -(-len(seq) // 4)
    for rid in list(toks):
        m.free(rid)
    m.check_integrity()
    assert m.num_free_blocks == m.num_usable_blocks
