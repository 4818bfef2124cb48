"""A draining daemon stays reachable, and a second signal ends the drain (a real daemon process
over the tiny engine, ``tiny_daemon.py``, drain timeout 30 s; ``hang`` holds a stream in flight).

After the first SIGTERM the listeners stay open: ``/health`` answers 200 ``draining``, a new
completion gets 503 "the daemon is shutting down", ``llmd status`` says so, ``llmd stop``
waits without sending another shutdown; the stream in flight goes on. A second SIGTERM (a
second Ctrl-C) aborts it at once (``finish_reason: "abort"``, ``[DONE]``) instead of waiting
out the 30 s, and the process exits 0 with its socket removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from tiny_daemon import running

from llmd.daemon.cli.main import main
from llmd.daemon.client.client import ApiResponseError, Client

SEED = 4242  # the streamed request's: its step hangs 4 s at its 2nd token


@pytest.fixture
def daemon():
    with running("d", dict(TINY_DAEMON_DRAIN="30", LLMD_FAULT_INJECT=f"hang:{SEED}@2=4")) as d:
        yield d


def test_a_draining_daemon_answers_and_a_second_signal_aborts(daemon):
    sock, log, proc = daemon
    c = Client(sock, timeout=30)
    deadline = time.monotonic() + 60
    while c.health() is None:
        assert proc.poll() is None and time.monotonic() < deadline, open(log).read()
        time.sleep(0.05)
    stream = c.stream("/v1/completions", {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "seed": SEED,
                                          "temperature": 0.5})
    chunks = [next(stream)]  # the 1st token; the step of the 2nd hangs 4 s
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 3
    while (health := c.health()) is None or health["status"] != "draining":
        assert time.monotonic() < deadline, f"no 'draining' from /health: {health}"
        time.sleep(0.05)
    with pytest.raises(ApiResponseError) as refused:
        c.completion(prompt="hi", max_tokens=2)
    assert refused.value.status == 503 and "shutting down" in str(refused.value.body), refused.value.body
    assert refused.value.code == "shutting_down", refused.value.body
    status = CliRunner().invoke(main, ["status", "--socket", sock])
    assert status.exit_code == 0 and "shutting down: in-flight requests finish" in status.output, status.output
    stopper = subprocess.Popen([sys.executable, "-c", "from llmd.daemon.cli.main import main; main()", "stop",
                                "--socket", sock], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(0.5)  # `llmd stop` sees "draining": it waits, sending nothing
    assert stopper.poll() is None
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)  # the second signal
    chunks += list(stream)  # ends at [DONE]
    out, _ = stopper.communicate(timeout=30)
    assert stopper.returncode == 0 and "is already shutting down; waiting for it to exit" in out, out
    assert out.strip().splitlines()[-1] == "llmd: daemon stopped", out
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort", chunks[-1]
    assert proc.wait(15) == 0 and time.monotonic() - t0 < 15, open(log).read()  # not the 30 s drain
    assert not os.path.exists(sock)
    text = open(log).read()
    assert "second signal: aborting the requests in flight now" in text
    assert "llmd: second signal: aborting 1 sequence in flight" in text, text  # what the drain's end did
