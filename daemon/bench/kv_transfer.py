"""``llmd bench kv-transfer``: what prefill/decode disaggregation costs on loopback.

One process, two engines over one loaded model (as ``llmd bench prefix``), each behind its own
aiohttp app on a real ``127.0.0.1`` TCP listener with an API key: a producer
(``--kv-role producer``) and a consumer (``--kv-role consumer``). Per prompt length ``P``
(random token ids, a fresh prompt each repeat, prefix caches reset), side by side:

* **colocated**: the consumer alone answers ``max_tokens: 1`` (its TTFT: the whole prefill);
* **disaggregated**: the router's two legs, the producer's prefill (``max_tokens: 1``,
  ``do_remote_decode``) then the consumer's request with the returned params: the pull over TCP
  (timed inside the connector), the import and one computed token.

Printed per ``P`` (medians over ``repeats``): the payload (MB, blocks), the pull's time, its
bandwidth (MB/s, blocks/s), both TTFTs and their ratio, and the TTFT disaggregation adds per
1,000 prompt tokens, taken as the consumer's whole leg (HTTP, pull, import, one computed token)
``/ P * 1000``: an upper bound that, unlike ``TTFT_disagg - TTFT_colocated``, does not drown
in the prefill's run-to-run noise on a shared CPU. With ``compare_gloo``, the same payload
sizes are also sent between two processes with ``torch.distributed`` gloo ``send``/``recv``
(:mod:`.kv_transfer_gloo`) for the transport comparison.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from llmd.daemon.serving.access import AccessPolicy, access_middleware
from llmd.daemon.serving.api import ServerState, make_app
from llmd.daemon.serving.engine_loop import EngineLoop
from llmd.daemon.serving.kv_transfer.config import KVTransferConfig
from llmd.daemon.serving.kv_transfer.tcp import TcpPullConnector

KEY = "llmd-bench-kv-transfer"
HEADERS = {"Authorization": f"Bearer {KEY}"}


class TimedConnector(TcpPullConnector):
    """The TCP pull, recording ``(seconds, bytes, blocks)`` of each successful pull."""

    def __init__(self, api_key: str):
        super().__init__(api_key)
        self.pulls: list[tuple[float, int, int]] = []

    async def pull(self, remote, max_bytes, timeout):
        t0 = time.perf_counter()
        payload = await super().pull(remote, max_bytes, timeout)
        self.pulls.append((time.perf_counter() - t0, payload.nbytes, payload.num_blocks))
        return payload


async def _serve(loop: EngineLoop, kv: KVTransferConfig, model_id: str) -> tuple[web.AppRunner, int]:
    eng = loop.engine
    state = ServerState(engine_loop=loop, model_id=model_id, model_ids=(model_id,),
                        vocab_size=eng.model_config.vocab_size, max_model_len=eng.max_model_len,
                        shutdown=asyncio.Event(), kv_transfer=kv)
    runner = web.AppRunner(make_app(state, access_middleware(AccessPolicy(KEY, True))), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def _post(session, port: int, body: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=HEADERS) as resp:
        out = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {out}")
    return time.perf_counter() - t0, out


async def _measure(producer: EngineLoop, consumer: EngineLoop, lengths: list[int], repeats: int,
                   seed: int) -> list[dict]:
    timed = TimedConnector(KEY)
    pkv = KVTransferConfig("producer", "127.0.0.1", 0, KEY)
    ckv = KVTransferConfig("consumer", api_key=KEY, connector=timed).check()
    (prunner, pport), (crunner, cport) = await _serve(producer, pkv, "m"), await _serve(consumer, ckv, "m")
    pkv.port = pport
    rng = random.Random(seed)
    vocab = producer.engine.model_config.vocab_size
    rows = []
    try:
        async with aiohttp.ClientSession() as s:
            for n in lengths:
                colo, disagg, legs, pulls = [], [], [], []
                for r in range(repeats + 1):  # the first round warms both paths up and is not counted
                    ids = [rng.randrange(100, vocab - 100) for _ in range(n)]
                    body = {"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0}
                    for port in (pport, cport):
                        await s.post(f"http://127.0.0.1:{port}/v1/cache/reset", json={}, headers=HEADERS)
                    t_colo, _ = await _post(s, cport, body)
                    await s.post(f"http://127.0.0.1:{cport}/v1/cache/reset", json={}, headers=HEADERS)
                    t_pre, pre = await _post(s, pport, {**body, "min_tokens": 1,
                                                        "kv_transfer_params": {"do_remote_decode": True}})
                    t_dec, out = await _post(s, cport, {**body, "kv_transfer_params": pre["kv_transfer_params"]})
                    if out["usage"]["prompt_tokens_details"]["cached_tokens"] != n - 1:
                        raise RuntimeError(f"the consumer did not import the KV of a {n}-token prompt: {out['usage']}")
                    if r:
                        colo.append(t_colo)
                        disagg.append(t_pre + t_dec)
                        legs.append(t_dec)
                        pulls.append(timed.pulls[-1])
                secs = statistics.median(p[0] for p in pulls)
                nbytes, blocks = pulls[0][1], pulls[0][2]
                c, d, leg = statistics.median(colo), statistics.median(disagg), statistics.median(legs)
                rows.append({"prompt_tokens": n, "mb": nbytes / 1e6, "blocks": blocks, "pull_ms": secs * 1e3,
                             "mb_per_s": nbytes / 1e6 / secs, "blocks_per_s": blocks / secs,
                             "ttft_colocated_ms": c * 1e3, "ttft_disagg_ms": d * 1e3, "consumer_leg_ms": leg * 1e3,
                             "added_ms_per_1k": leg / n * 1e6})
    finally:
        await prunner.cleanup()
        await crunner.cleanup()
        await timed.close()
    return rows


def run_kv_transfer_bench(make_engine: Callable, lengths: list[int], repeats: int = 3, seed: int = 0,
                          compare_gloo: bool = False, echo=print) -> list[dict]:
    """Measure and print the table (module docstring). ``make_engine(model=None)`` builds an
    engine; called twice, the second time with the first's loaded model. Returns the rows."""
    first = make_engine(None)
    second = make_engine(first)
    producer, consumer = EngineLoop(first, "m").start(), EngineLoop(second, "m").start()
    try:
        rows = asyncio.run(_measure(producer, consumer, lengths, repeats, seed))
    finally:
        producer.stop()
        consumer.stop()
    c = first.config
    echo(f"KV transfer on loopback TCP (llmd's binary pull, authenticated), {first.model_config.name}, "
         f"dtype {c.dtype}, KV {c.kv_cache_dtype}, block {c.block_size}; medians of {repeats}")
    echo(f"{'prompt':>7} {'MB':>7} {'blocks':>7} {'pull ms':>8} {'MB/s':>8} {'blocks/s':>9} "
         f"{'TTFT colo ms':>13} {'TTFT P/D ms':>12} {'P/D / colo':>11} {'consumer leg ms':>16} {'added ms/1k tok':>16}")
    for r in rows:
        echo(f"{r['prompt_tokens']:>7} {r['mb']:>7.2f} {r['blocks']:>7} {r['pull_ms']:>8.1f} {r['mb_per_s']:>8.0f} "
             f"{r['blocks_per_s']:>9.0f} {r['ttft_colocated_ms']:>13.1f} {r['ttft_disagg_ms']:>12.1f} "
             f"{r['ttft_disagg_ms'] / r['ttft_colocated_ms']:>11.2f} {r['consumer_leg_ms']:>16.1f} "
             f"{r['added_ms_per_1k']:>16.1f}")
    echo("added ms/1k tok: the consumer's whole leg (HTTP, pull, import, its one computed token) per 1,000 prompt "
         "tokens, an upper bound (the colocated prefill computes that last token too)")
    if compare_gloo:
        from llmd.daemon.bench.kv_transfer_gloo import gloo_send_recv_seconds

        echo(f"{'prompt':>7} {'MB':>7} {'llmd pull MB/s':>15} {'gloo send/recv MB/s':>20} {'llmd / gloo':>12}")
        for r, secs in zip(rows, gloo_send_recv_seconds([int(r["mb"] * 1e6) for r in rows], repeats)):
            gloo = r["mb"] / secs
            r["gloo_mb_per_s"] = gloo
            echo(f"{r['prompt_tokens']:>7} {r['mb']:>7.2f} {r['mb_per_s']:>15.0f} {gloo:>20.0f} "
                 f"{r['mb_per_s'] / gloo:>12.2f}")
    return rows
