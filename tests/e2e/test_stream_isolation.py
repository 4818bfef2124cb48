"""A running stream is not slowed by what other clients send (the session's SmolLM2 daemon,
one torch thread, the real tokenizer and chat template): its inter-token p99 over 150 tokens
stays within 2× its own baseline while ~500k-character prompts (tokenized off the engine
thread and the event loop: 241 ms each, GIL released), 20k-message bodies (refused by the
message cap before Jinja would hold the GIL ~135 ms) or 1,000 DELETEs of unknown ids (no
stats rebuild per command) arrive. The baseline (the same stream alone, just before) is measured
once for the module and shared by the two noises (a stream of 150 tokens: ~10 s on one torch
thread); a retry measures both again. One retry: the 2 CI cores are shared."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from llmd.daemon.client.client import ApiResponseError

TOKENS = 150
TOLERANCE = 2.0
BODY = {"prompt": "The history of the Roman Empire", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}


def stream_gaps(client) -> list[float]:
    """Seconds between consecutive content chunks of one stream (the first, TTFT, left out)."""
    times = [time.perf_counter() for ch in client.stream("/v1/completions", BODY) if ch["choices"]]
    assert len(times) >= 140
    return [b - a for a, b in zip(times[1:], times[2:])]


def p99(gaps: list[float]) -> float:
    return sorted(gaps)[int(0.99 * (len(gaps) - 1))]


def with_noise(daemon, noise, base: float | None = None) -> tuple[float, float, int]:
    """(baseline p99, p99 while ``noise(client, stop)`` runs in a thread, noise requests sent);
    ``base``: a baseline p99 measured just before (None: measure it now)."""
    c = daemon.client()
    if base is None:
        base = p99(stream_gaps(c))
    stop, sent = threading.Event(), []
    t = threading.Thread(target=lambda: sent.append(noise(daemon.client(), stop)))
    t.start()
    try:
        loaded = p99(stream_gaps(c))
    finally:
        stop.set()
        t.join()
    return base, loaded, sent[0]


def raw_post(socket_path: str, route: str, data: bytes) -> int:
    """POST pre-encoded JSON over the Unix socket (the test process spends no CPU encoding); the status."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(socket_path)
        s.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    return int(raw.split(b" ", 2)[1])


def big_bodies(client, stop) -> int:
    """Every 50 ms, alternately, a 500k-character prompt (within the character cap of 64 × 8192,
    then too many tokens) and 20k short messages (over the message cap): each a 400."""
    bodies = [("/v1/completions", json.dumps({"prompt": "word " * 100_000, "max_tokens": 1}).encode()),
              ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}] * 20_000}).encode())]
    n = 0
    while not stop.wait(0.05):
        path, data = bodies[n % 2]
        assert raw_post(client.socket_path, path, data) == 400
        n += 1
    return n


def unknown_deletes(client, stop) -> int:
    time.sleep(0.5)
    for i in range(1000):
        with pytest.raises(ApiResponseError):
            client.abort(f"cmpl-unknown-{i}")
    return 1000


@pytest.fixture(scope="module")
def alone_p99(llmd_daemon) -> float:
    """The stream's p99 alone, measured once for both noises (a retry measures its own)."""
    return p99(stream_gaps(llmd_daemon.client()))


@pytest.mark.parametrize("noise", [big_bodies, unknown_deletes])
def test_stream_inter_token_p99_within_2x_while_others_send(llmd_daemon, alone_p99, noise):
    for attempt in range(2):
        base, loaded, sent = with_noise(llmd_daemon, noise, alone_p99 if attempt == 0 else None)
        print(f"{noise.__name__}: p99 {base * 1e3:.1f} ms alone, {loaded * 1e3:.1f} ms with {sent} requests")
        if loaded <= TOLERANCE * base:
            break
    assert sent >= 4 and loaded <= TOLERANCE * base, (base, loaded, sent)
    llmd_daemon.wait_idle()
