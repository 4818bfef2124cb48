"""Prefill/decode disaggregation on real models (issue 21): a producer and a consumer app
in-process on loopback TCP (``tests/fixtures/kv_pair.py``), each with its own engine loop over the
session's already-loaded model.

For SmolLM2 and Gemma 3 (a prompt longer than its 512-token window, so the sliding groups send
only their window), auto, int8 and int4 caches: the consumer's greedy tokens equal a single
engine's, the consumer computed exactly one prompt token (int4: the last block's tokens, its
open-block residual does not travel; ``imported_tokens``) (its ``/v1/stats`` counters) and
imported the rest, and both pools are back to zero blocks (and residual slots) with the KV
audit holding. Poisoning the
producer's pinned KV before the pull changes the consumer's reply (so the pulled KV is what
it decodes from), and the handshake runs exactly as vllm-router sends it, chat and streaming
included.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from app_harness import sse_events
from kv_pair import AUTH, audit, decode, kv_pair, prefill

from llmd.daemon.kv.transfer import imported_tokens
from llmd.daemon.serving.engine_loop import EngineLoop

SMOL_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
               "combined movable metal type, oil-based inks and a screw press. Within decades, presses spread "
               "across Europe and books became cheaper. Summarize this in one sentence:")


def _loops(make, kv_cache_dtype: str):
    kw = dict(kv_cache_dtype=kv_cache_dtype, kv_cache_memory=24 * 2**20, max_num_seqs=4, prefix_cache_seed=0)
    return EngineLoop(make(**kw), "m").start(), EngineLoop(make(**kw), "m").start()


@pytest.fixture(scope="module", params=["auto", "int8", "int4"])
def smol_pair(request, make_engine):
    loops = _loops(make_engine, request.param)
    yield loops
    for lp in loops:
        lp.stop()


async def _reference(consumer, body: dict) -> dict:
    """A single engine's answer (the consumer without params), then its prefix cache dropped so
    the disaggregated run cannot lean on it."""
    resp = await consumer.post("/v1/completions", json=body, headers=AUTH)
    out = await resp.json()
    assert resp.status == 200, out
    await consumer.post("/v1/cache/reset", json={}, headers=AUTH)
    return out


def _tokens(out: dict) -> list[str]:
    return out["choices"][0]["logprobs"]["tokens"]


async def _disaggregated(p, c, body: dict, path: str = "/v1/completions") -> tuple[dict, dict, dict]:
    before = (await (await c.get("/v1/stats", headers=AUTH)).json())["counters"]["prompt_tokens"]
    pre = await prefill(p, body, path)
    params = pre["kv_transfer_params"]
    assert params["do_remote_prefill"] and not params["do_remote_decode"] and len(params["llmd_transfer_id"]) >= 40
    out = await decode(c, body, params, path)
    cstats, pstats = await audit(c), await audit(p)
    cstats["computed_prompt_tokens"] = cstats["counters"]["prompt_tokens"] - before
    return out, cstats, pstats


def _imported(loop, n_prompt: int) -> int:
    """Prompt tokens the consumer imports: ``P - 1``, int4 only its full blocks'."""
    eng = loop.engine
    return imported_tokens(n_prompt, eng.config.block_size, eng.config.kv_cache_dtype == "int4")


def _residual_free(*loops) -> None:
    for lp in loops:
        kv = lp.engine.kv_manager
        assert not kv.req_residual and len(kv.free_residual_slots) == kv.num_residual_slots


def test_smollm2_consumer_equals_one_engine_and_computes_one_prompt_token(smol_pair):
    body = {"model": "m", "prompt": SMOL_PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True}

    async def scenario():
        async with kv_pair(*smol_pair, model_id="m") as (p, c):
            ref = await _reference(c, body)
            out, cstats, pstats = await _disaggregated(p, c, body)
            n_prompt = out["usage"]["prompt_tokens"]
            n_imported = _imported(smol_pair[1], n_prompt)
            assert _tokens(out) == _tokens(ref)
            assert cstats["computed_prompt_tokens"] == n_prompt - n_imported
            kv = cstats["kv_transfer"]
            assert kv["imported"] == 1 and kv["imported_tokens"] == n_imported
            assert kv["recomputed_mismatch"] == kv["recomputed_pull_failed"] == 0
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n_imported
            assert pstats["kv_transfer"]["pulled"] == 1 and pstats["kv_transfer"]["pins_live"] == 0
            _residual_free(*smol_pair)

    asyncio.run(scenario())


def test_poisoned_producer_kv_changes_the_consumer_reply(smol_pair):
    body = {"model": "m", "prompt": SMOL_PROMPT, "max_tokens": 8, "temperature": 0}
    producer_loop = smol_pair[0]

    async def scenario():
        async with kv_pair(*smol_pair, model_id="m") as (p, c):
            ref = await _reference(c, body)
            pre = await prefill(p, body)
            ids = torch.tensor(pre["kv_transfer_params"]["remote_block_ids"])
            for cache in producer_loop.engine.runner.caches:  # the engine thread is idle between requests
                cache.data[:, ids] = cache.data[:, ids.flip(0)].clone()  # the prompt's blocks in reverse order
            out = await decode(c, body, pre["kv_transfer_params"])
            assert out["choices"][0]["text"] != ref["choices"][0]["text"]
            await c.post("/v1/cache/reset", json={}, headers=AUTH)  # the poisoned blocks leave the cache
            await audit(c), await audit(p)

    asyncio.run(scenario())


def test_handshake_exactly_as_vllm_router_chat_and_stream(smol_pair):
    """Chat, the router's chat extras, a streamed decode leg: the stream's text is the reference."""
    if smol_pair[0].engine.config.kv_cache_dtype == "int4":
        pytest.skip("the handshake does not depend on the KV dtype (int4's import: the test above)")
    chat = {"model": "m", "messages": [{"role": "user", "content": "Name three primary colours."}],
            "max_tokens": 10, "temperature": 0, "logprobs": False, "continue_final_message": False,
            "separate_reasoning": True, "stream_reasoning": True, "include_reasoning": True}

    async def scenario():
        async with kv_pair(*smol_pair, model_id="m") as (p, c):
            resp = await c.post("/v1/chat/completions", json=chat, headers=AUTH)
            ref = (await resp.json())["choices"][0]["message"]["content"]
            await c.post("/v1/cache/reset", json={}, headers=AUTH)
            pre = await prefill(p, chat, "/v1/chat/completions")
            resp = await c.post("/v1/chat/completions", headers=AUTH,
                                json={**chat, "stream": True, "kv_transfer_params": pre["kv_transfer_params"]})
            events = await sse_events(resp)
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
            assert events[-1] == "[DONE]" and text == ref
            stats = await audit(c)
            assert stats["kv_transfer"]["imported"] >= 1
            await audit(p)

    asyncio.run(scenario())


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_gemma3_sliding_groups_send_only_their_window(make_gemma_engine, gemma3_tokenizer, kv_cache_dtype):
    ids = gemma3_tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60)[:560]
    body = {"model": "m", "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    loops = _loops(make_gemma_engine, kv_cache_dtype)

    async def scenario():
        async with kv_pair(*loops, model_id="m") as (p, c):
            ref = await _reference(c, body)
            out, cstats, pstats = await _disaggregated(p, c, body)
            assert _tokens(out) == _tokens(ref)
            n_imported = _imported(loops[1], 560)  # 559, int4 544
            assert cstats["computed_prompt_tokens"] == 560 - n_imported
            eng = loops[0].engine
            full = -(-560 // eng.config.block_size)
            first = (n_imported - 512 + 1) // eng.config.block_size  # what the first computed query sees
            n_groups = len(eng.kv_cache_groups)
            assert cstats["kv_transfer"]["imported_blocks"] == full + (n_groups - 1) * (full - first)
            _residual_free(*loops)

    try:
        asyncio.run(scenario())
    finally:
        for lp in loops:
            lp.stop()
