"""Prefill/decode disaggregation when things go wrong (issue 21), on tiny engines in-process:
the producer dying mid-pull, a pull that times out, pins that expired, a consumer aborted
mid-pull, KV of another layout or prompt. Every time the consumer either decodes from its own
prefill (the reply equals a single engine's, the reason counted in ``/v1/stats``) or is gone,
and neither pool keeps a block (``check_integrity()`` and zero blocks in use on both sides).
Faults come from the producer's test hooks (``LLMD_FAULT_INJECT`` kinds ``kv_pull_cut``,
``kv_pull_stall``, ``kv_expire``, armed in-process), not from killed processes. Then the 400s."""

from __future__ import annotations

import asyncio

import pytest
from app_harness import run_app, start_loop
from kv_pair import AUTH, ROUTER_PREFILL, audit, decode, kv_pair, prefill

from llmd.daemon.core.faults import FaultInjector
from llmd.daemon.serving.kv_transfer.tcp import PULL_PATH

PROMPT = "a prompt of a few blocks, long enough to span four or five of them: 0123456789"


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    pair = start_loop(tmp_path_factory), start_loop(tmp_path_factory)
    yield pair
    for lp in pair:
        lp.stop()


def _body(seed: int, **kw) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "seed": seed, **kw}


async def _reference(c, body: dict) -> str:
    resp = await c.post("/v1/completions", json=body, headers=AUTH)
    return (await resp.json())["choices"][0]["text"]


def _arm(loop, spec: str) -> FaultInjector:
    injector = FaultInjector.parse(spec)
    loop.engine.faults = injector  # the kv_* hooks are asked at the pull (no sampler wrapper needed)
    return injector


def _recomputed(stats: dict, kind: str) -> int:
    return stats["kv_transfer"][f"recomputed_{kind}"]


@pytest.mark.parametrize("fault,kind", [("kv_pull_cut:11", "pull_failed"), ("kv_pull_stall:12=1.5", "pull_failed"),
                                        ("kv_expire:13", "pull_failed")])
def test_a_failed_pull_recomputes_and_leaks_nothing(loops, fault, kind):
    seed = int(fault.split(":")[1].split("=")[0])
    body = _body(seed)

    async def scenario():
        async with kv_pair(*loops, pull_timeout=0.5) as (p, c):
            ref = await _reference(c, body)
            before = _recomputed(await audit(c), kind)
            injector = _arm(loops[0], fault)
            pre = await prefill(p, body)
            out = await decode(c, body, pre["kv_transfer_params"])
            assert out["choices"][0]["text"] == ref
            assert injector.fired[fault.split(":")[0]] == 1
            assert _recomputed(await audit(c), kind) == before + 1
            await asyncio.sleep(1.6 if "stall" in fault else 0)  # the stalled handler finishes writing
            assert (await audit(p))["kv_transfer"]["pins_live"] == 0

    try:
        run_app(loops[0], lambda _client: scenario(), timeout=60)
    finally:
        loops[0].engine.faults = None


def test_pins_expire_and_the_late_consumer_recomputes(loops):
    body = _body(21)

    async def scenario():
        async with kv_pair(*loops, pin_timeout=0.3) as (p, c):
            ref = await _reference(c, body)
            pre = await prefill(p, body)
            for _ in range(40):  # the engine loop checks deadlines at least every 0.5 s while idle
                await asyncio.sleep(0.1)
                stats = await audit(p) if not loops[0].engine.kv_exchange.pins else None
                if stats is not None:
                    break
            assert stats is not None and stats["kv_transfer"]["expired"] >= 1
            out = await decode(c, body, pre["kv_transfer_params"])  # the producer answers 404 now
            assert out["choices"][0]["text"] == ref
            await audit(c)

    run_app(loops[0], lambda _client: scenario(), timeout=60)


def test_consumer_aborted_mid_pull_leaks_nothing(loops):
    body = _body(31)

    async def scenario():
        async with kv_pair(*loops) as (p, c):
            _arm(loops[0], "kv_pull_stall:31=1.2")
            pre = await prefill(p, body)
            before = await audit(c)
            seen, seen_imported = before["counters"]["requests_finished"], before["kv_transfer"]["imported"]
            task = asyncio.ensure_future(c.post("/v1/completions", headers=AUTH,
                                                json={**body, "kv_transfer_params": pre["kv_transfer_params"]}))
            await asyncio.sleep(0.5)  # the consumer is inside its pull: the producer stalls
            assert not task.done()
            task.cancel()  # the client goes away: the handler, and its pull, are cancelled
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(1.2)  # past the stall: a pull still running would have finished by now
            stats = await audit(c)
            assert stats["counters"]["requests_finished"] == seen  # the engine never got the request
            assert stats["kv_transfer"]["imported"] == seen_imported and loops[1].num_live == 0
            await audit(p)

    try:
        run_app(loops[0], lambda _client: scenario(), timeout=60)
    finally:
        loops[0].engine.faults = None


def test_kv_of_another_layout_or_prompt_is_never_used(loops, tmp_path_factory):
    int8 = start_loop(tmp_path_factory, kv_cache_dtype="int8")
    body = _body(41)
    other = _body(41, prompt=PROMPT.replace("prompt", "promptly"))

    async def scenario():
        async with kv_pair(loops[0], int8, pin_timeout=1.0) as (p, c):  # an int8 consumer, an auto producer
            ref = await _reference(c, body)
            pre = await prefill(p, body)
            assert (await decode(c, body, pre["kv_transfer_params"]))["choices"][0]["text"] == ref
            stats = await audit(c)
            assert _recomputed(stats, "mismatch") == 1 and stats["kv_transfer"]["imported"] == 0
        async with kv_pair(*loops) as (p, c):  # the params of one prompt on a request of another
            ref = await _reference(c, other)
            pre = await prefill(p, body)
            assert (await decode(c, other, pre["kv_transfer_params"]))["choices"][0]["text"] == ref
            assert _recomputed(await audit(c), "mismatch") >= 1
            for _ in range(30):  # the int8 consumer never pulled: that pin expires on its own
                if not loops[0].engine.kv_exchange.pins:
                    break
                await asyncio.sleep(0.1)
            await audit(p)

    try:
        run_app(loops[0], lambda _client: scenario(), timeout=60)
    finally:
        int8.stop()


def test_fingerprint_names_the_kv_scheme(tmp_path):
    """The fingerprint carries what the block bytes mean (int4: KIVI, K per channel over blocks
    of 16), so a consumer of another scheme names it and computes the prefill itself."""
    from tiny_engine import tiny_engine

    from llmd.daemon.core.kv_transfer import fingerprint_mismatch, kv_fingerprint

    int4 = kv_fingerprint(tiny_engine(tmp_path / "a.gguf", kv_cache_dtype="int4"))
    auto = kv_fingerprint(tiny_engine(tmp_path / "b.gguf"))
    assert int4["kv_scheme"] == "int4-kivi16" and auto["kv_scheme"] == "auto"
    assert "kv_scheme 'int4-kivi16' (producer) vs 'auto' (here)" in fingerprint_mismatch(auto, int4)


def test_fingerprint_tells_auto_from_plain_gguf(tmp_path):
    """``--weight-quant auto`` in bfloat16 serves large steps (a prefill) on the dense weights and
    small ones on the GGUF packs; plain ``gguf`` serves every step on the packs. Their KV differ,
    so their fingerprints do ("gguf+dense" vs "gguf"); auto resolved to "none" is plain "none"."""
    from tiny_engine import tiny_engine

    from llmd.daemon.core.kv_transfer import fingerprint_mismatch, kv_fingerprint

    auto = kv_fingerprint(tiny_engine(tmp_path / "a.gguf", dtype="bfloat16"))
    gguf = kv_fingerprint(tiny_engine(tmp_path / "b.gguf", dtype="bfloat16", weight_quant="gguf"))
    assert auto["weight_quant"] == "gguf+dense" and gguf["weight_quant"] == "gguf"
    same_name = {"model": "m|llama"}  # the tiny GGUFs are named after their files
    assert (fingerprint_mismatch({**auto, **same_name}, {**gguf, **same_name})
            == "weight_quant 'gguf' (producer) vs 'gguf+dense' (here)")
    assert kv_fingerprint(tiny_engine(tmp_path / "c.gguf"))["weight_quant"] == "none"  # float32: auto is none


def test_bad_params_and_roles_are_400s_naming_the_field(loops):
    async def scenario():
        async with kv_pair(*loops) as (p, c):
            cases = [
                (p, {"kv_transfer_params": "yes"}, "kv_transfer_params"),
                (p, {"kv_transfer_params": {"do_remote_decode": 1}}, "kv_transfer_params.do_remote_decode"),
                (p, {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": True}},
                 "kv_transfer_params"),
                (p, {**ROUTER_PREFILL, "stream": True}, "stream"),
                (p, {**ROUTER_PREFILL, "n": 2}, "n"),
                (p, {"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params.do_remote_prefill"),
                (c, ROUTER_PREFILL, "kv_transfer_params.do_remote_decode"),
                (c, {"kv_transfer_params": {"do_remote_prefill": True, "remote_port": "80"}},
                 "kv_transfer_params.remote_port"),
            ]
            for client, extra, param in cases:
                resp = await client.post("/v1/completions", json={**_body(1), **extra}, headers=AUTH)
                err = (await resp.json())["error"]
                assert resp.status == 400 and err["param"] == param, (extra, err)
            # the pull: only with the key, only a live transfer id
            assert (await p.post(PULL_PATH, json={"transfer_id": "x"})).status == 401
            resp = await p.post(PULL_PATH, json={"transfer_id": "not-a-pin"}, headers=AUTH)
            assert resp.status == 404 and (await resp.json())["error"]["param"] == "transfer_id"
            # a consumer given params without an llmd producer computes (and says why in its stats)
            out = await decode(c, _body(2), {"do_remote_prefill": True, "remote_engine_id": "vllm",
                                            "remote_block_ids": [1], "remote_host": None, "remote_port": None})
            assert out["choices"][0]["text"]
            assert _recomputed(await audit(c), "no_producer") >= 1

    run_app(loops[0], lambda _client: scenario(), timeout=60)


def test_wrongly_typed_producer_fields_are_named_in_json_terms():
    """"must be an integer" / "a string", as every other field's 400 says (it said Python's
    "must be a int" / "must be a str")."""
    from llmd.daemon.serving.kv_transfer.config import KVTransferConfig
    from llmd.daemon.serving.kv_transfer.handshake import _remote
    from llmd.daemon.serving.validation import ApiError

    cfg = KVTransferConfig(role="consumer")
    for kv, text in (({"remote_port": "80"}, 'remote_port must be an integer, got string "80"'),
                     ({"remote_host": 1}, "remote_host must be a string, got number 1"),
                     ({"llmd_transfer_id": []}, "llmd_transfer_id must be a string, got array")):
        with pytest.raises(ApiError) as e:
            _remote(cfg, {"do_remote_prefill": True, **kv})
        assert text in str(e.value), str(e.value)


def test_role_both_ignores_the_params(loops):
    async def scenario(client):
        resp = await client.post("/v1/completions", json={**_body(3), **ROUTER_PREFILL})
        out = await resp.json()
        assert resp.status == 200 and "kv_transfer_params" not in out
        assert not loops[0].engine.kv_exchange.pins

    run_app(loops[0], scenario)


def test_consumer_pulls_only_from_allowed_producers(loops):
    """The pull carries the consumer's key, so params naming a host:port outside ``--kv-producer``
    (without it: outside loopback) are never contacted: the consumer recomputes, counted as
    ``no_producer``. A listener on a port that is not the allowed producer's sees no connection."""
    import socket

    from llmd.daemon.serving.kv_transfer.config import KVTransferConfig

    body = _body(41)
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(1)
    trap.setblocking(False)

    async def scenario():
        async with kv_pair(*loops) as (p, c):
            ref = await _reference(c, body)
            pre = await prefill(p, body)
            c.kv_config.producers = (f"127.0.0.1:{p.server.port}",)
            before = _recomputed(await audit(c), "no_producer")
            params = {**pre["kv_transfer_params"], "remote_port": trap.getsockname()[1]}
            assert (await decode(c, body, params))["choices"][0]["text"] == ref
            for host in ("10.1.2.3", "no-such-host.invalid"):
                c.kv_config.producers = ()
                out = await decode(c, body, {**pre["kv_transfer_params"], "remote_host": host})
                assert out["choices"][0]["text"] == ref
            assert _recomputed(await audit(c), "no_producer") == before + 3
            with pytest.raises(BlockingIOError):
                trap.accept()  # nobody connected
            c.kv_config.producers = (f"127.0.0.1:{p.server.port}",)
            imported = (await audit(c))["kv_transfer"]["imported"]
            assert (await decode(c, body, pre["kv_transfer_params"]))["choices"][0]["text"] == ref
            assert (await audit(c))["kv_transfer"]["imported"] == imported + 1  # the allowed producer's KV
            await audit(p)

    try:
        run_app(loops[0], lambda _client: scenario(), timeout=60)
    finally:
        trap.close()
    assert KVTransferConfig("consumer", producers=("h:1",)).allows("h", 1)
    assert not KVTransferConfig("consumer").allows("10.0.0.1", 80)
    assert KVTransferConfig("consumer").allows("::1", 80) and KVTransferConfig("consumer").allows("localhost", 1)
    with pytest.raises(Exception, match="HOST:PORT"):
        KVTransferConfig("consumer", producers=("nohost",)).check()
