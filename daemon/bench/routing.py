"""``llmd bench routing``: llmd replicas behind vllm-router on one machine (loopback TCP), the
prefix-cache hit rate with ``cache_aware`` vs ``round_robin`` routing on the same workload, in
one run.

What runs: ``replicas`` ``llmd serve`` processes (``--threads 1`` each, their own Unix socket
in a temporary directory, a TCP listener on a free 127.0.0.1 port, one random API key in
``$LLMD_API_KEY``), then per policy a fresh ``vllm-router`` (``--api-key`` the same key) in
front of all of them; before each phase every replica's prefix cache is reset
(``POST /v1/cache/reset``) and a ``/v1/stats`` snapshot taken, after it another. The workload
(:mod:`.routing_workload`) runs through the router: ``users`` chats at once, each its own
document plus a growing history, ``turns`` turns each (a turn waits for the previous reply;
greedy, ``max_tokens`` new tokens), so both phases send the same prompts and get the same
replies. Printed: requests per replica, prompt tokens queried / hit / computed, the hit rate
and the ratio; throughput and TTFT are not (noise on a shared 2-core machine). The routers log
at ``$LLMD_ROUTER_LOG_LEVEL`` (default ``warning``); a failed request quotes its router's log.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from llmd.daemon.bench.routing_workload import PhaseResult, document, replica_delta, report, turn_messages
from llmd.daemon.core.errors import LlmdError

ROUTER_VERSION = "0.1.17"  # the version llmd's tests and this benchmark ran (pyproject's cluster extra)
POLICIES = ("round_robin", "cache_aware")
SERVE = [sys.executable, "-c", "from llmd.daemon.cli.main import main; main()", "serve"]


def find_router() -> str:
    """The ``vllm-router`` executable (PATH, else beside this Python).

    Raises:
        LlmdError: not installed.
    """
    path = shutil.which("vllm-router") or shutil.which("vllm-router", path=os.path.dirname(sys.executable))
    if path is None:
        raise LlmdError(f"vllm-router is not installed: pip install 'llmd[cluster]' (vllm-router=={ROUTER_VERSION})")
    return path


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that nothing listens on now, for servers started
    next. Drawn below the kernel's ephemeral range (``ip_local_port_range``, 32768 by default)
    when it leaves room, so no outgoing connection's source port takes one between this pick and
    the server's bind (a router connects to its workers before it binds its metrics port: that
    raced once as "Address already in use"); all ``n`` sockets are held until every port is
    drawn, so the ports differ. Else the kernel's own pick (``bind`` to port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng, held, ports = random.Random(), [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            held.append(s)
            try:
                s.bind(("127.0.0.1", rng.randrange(20000, low) if low > 21000 else 0))
            except OSError:  # taken: draw again
                continue
            ports.append(s.getsockname()[1])
    finally:
        for s in held:
            s.close()
    return ports


def free_port() -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1)[0]


def start_replicas(n: int, serve_args: list[str], key: str, workdir: str) -> list[tuple[subprocess.Popen, str, str]]:
    """``n`` ``llmd serve`` processes; (process, base URL, log path) each."""
    env = dict(os.environ, LLMD_API_KEY=key, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = []
    for i, port in enumerate(free_ports(n)):
        log = os.path.join(workdir, f"replica{i}.log")
        args = [*SERVE, "--socket", os.path.join(workdir, f"r{i}.sock"), "--host", "127.0.0.1", "--port", str(port),
                "--threads", "1", *serve_args]
        with open(log, "wb") as f:
            proc = subprocess.Popen(args, stdout=f, stderr=f, stdin=subprocess.DEVNULL, env=env)
        out.append((proc, f"http://127.0.0.1:{port}", log))
    return out


def start_router(router: str, urls: list[str], policy: str, key: str, workdir: str):
    """A ``vllm-router`` with ``policy`` in front of ``urls``: (process, base URL, log path)."""
    (port, metrics_port), log = free_ports(2), os.path.join(workdir, f"router-{policy}.log")
    args = [router, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
            "--api-key", key, "--prometheus-port", str(metrics_port), "--worker-startup-check-interval", "1",
            "--log-level", os.environ.get("LLMD_ROUTER_LOG_LEVEL", "warning")]
    with open(log, "wb") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=f, stdin=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}", log


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM (llmd drains), then SIGKILL after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-1500:]


async def wait_healthy(session, url: str, proc: subprocess.Popen, log: str, timeout: float) -> None:
    """Poll ``url``/health until 200.

    Raises:
        LlmdError: the process exited, or ``timeout`` seconds passed (the log's tail quoted).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LlmdError(f"{url} exited (code {proc.returncode}); its log ends:\n{_tail(log)}")
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise LlmdError(f"{url} did not answer /health within {timeout:.0f} s; its log ends:\n{_tail(log)}")


async def _json(session, method: str, url: str, key: str, body=None):
    """The decoded JSON answer of one request.

    Raises:
        LlmdError: a status other than 200 (its body quoted).
    """
    async with session.request(method, url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status != 200:
            raise LlmdError(f"{method} {url}: HTTP {r.status}: {(await r.text())[:500]}")
        return await r.json()


async def run_users(session, url: str, key: str, users: int, turns: int, max_tokens: int,
                    doc_words: int | None = None) -> list[list[str]]:
    """The workload through ``url`` (the router); every user's replies, per turn."""
    async def user(u: int) -> list[str]:
        doc, history, replies = document(u, doc_words), [], []
        for t in range(turns):
            messages = turn_messages(doc, history, t)
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
            reply = (await _json(session, "POST", url + "/v1/chat/completions", key, body))["choices"][0]
            text = reply["message"]["content"]
            replies.append(text)
            history += [messages[-1], {"role": "assistant", "content": text or "(no answer)"}]
        return replies

    return list(await asyncio.gather(*(user(u) for u in range(users))))


async def settled_stats(session, urls: list[str], key: str, before: list[dict], requests: int,
                        timeout: float = 10.0) -> list[dict]:
    """The replicas' ``/v1/stats`` once they count ``requests`` more finished requests than
    ``before`` (a snapshot is published after the step that finished a request, which may
    follow its reply by a step), or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        after = [await _json(session, "GET", u + "/v1/stats", key) for u in urls]
        done = sum(replica_delta(b, a).requests for b, a in zip(before, after))
        if done >= requests or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.05)


async def run_phase(session, router: str, urls: list[str], policy: str, key: str, workdir: str, users: int,
                    turns: int, max_tokens: int, doc_words: int | None = None) -> PhaseResult:
    """One policy: a fresh router, reset replica caches, the workload, the stats deltas."""
    proc, url, log = start_router(router, urls, policy, key, workdir)
    try:
        await wait_healthy(session, url, proc, log, 60)
        for u in urls:
            await _json(session, "POST", u + "/v1/cache/reset", key, {})
        before = [await _json(session, "GET", u + "/v1/stats", key) for u in urls]
        t0 = time.monotonic()
        try:
            replies = await run_users(session, url, key, users, turns, max_tokens, doc_words)
        except LlmdError as e:
            raise LlmdError(f"{e}\n{policy} router's log ends:\n{_tail(log)}") from None
        wall = time.monotonic() - t0
        after = await settled_stats(session, urls, key, before, users * turns)
    finally:
        stop(proc, 10)
    return PhaseResult(policy, [replica_delta(b, a) for b, a in zip(before, after)], wall, replies)


async def _bench(replicas, urls, key, workdir, users, turns, max_tokens, doc_words,
                 echo) -> tuple[list[PhaseResult], int]:
    """Both phases once the replicas answer; also the tokens of user 0's first prompt."""
    import aiohttp

    router = find_router()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        t0 = time.monotonic()
        for proc, url, log in replicas:
            await wait_healthy(s, url, proc, log, 900)
        echo(f"{len(urls)} replicas up in {time.monotonic() - t0:.0f} s")
        for u in urls:  # warm-up outside the phases (first-step costs), then the caches are reset
            await _json(s, "POST", u + "/v1/chat/completions", key,
                        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0})
        doc_tokens = (await _json(s, "POST", urls[0] + "/tokenize", key,
                                  {"messages": turn_messages(document(0, doc_words), [], 0)}))["count"]
        phases = []
        for policy in POLICIES:
            phases.append(await run_phase(s, router, urls, policy, key, workdir, users, turns, max_tokens,
                                          doc_words))
            echo(f"{policy}: done in {phases[-1].wall_s:.0f} s")
    return phases, doc_tokens


def run_routing_bench(replicas: int, users: int, turns: int, max_tokens: int, serve_args: list[str],
                      doc_words: int | None = None, echo: Callable[[str], None] = print) -> list[PhaseResult]:
    """Start the replicas, run both phases, print :func:`~.routing_workload.report`; the replicas
    are stopped (SIGTERM) and the temporary directory removed whatever happens.

    Raises:
        LlmdError: the router is missing, a replica or router did not come up, a request failed.
    """
    if min(replicas, users, turns, max_tokens, 1 if doc_words is None else doc_words) < 1:
        raise LlmdError("--replicas, --users, --turns, --max-tokens and --doc-words must be >= 1")
    find_router()
    key = os.urandom(18).hex()
    workdir = tempfile.mkdtemp(prefix="llmdr", dir="/tmp")  # short socket paths (AF_UNIX: 107 bytes)
    procs = start_replicas(replicas, serve_args, key, workdir)
    try:
        phases, doc_tokens = asyncio.run(_bench(procs, [u for _, u, _ in procs], key, workdir, users, turns,
                                                max_tokens, doc_words, echo))
    finally:
        for proc, _, _ in procs:
            stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)
    shape = (f"workload: {users} users at once x {turns} turns (a turn waits for its reply), each user's own "
             f"document ({doc_tokens} tokens with the template's first turn) + its growing history; "
             f"{max_tokens} new tokens per reply, greedy; {replicas} llmd replicas (--threads 1 {' '.join(serve_args)})"
             f" behind vllm-router {ROUTER_VERSION}, loopback")
    for line in report(phases, shape):
        echo(line)
    return phases
