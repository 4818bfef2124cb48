"""`llmd chat` outlives its daemon (issue 17): in a pseudo-terminal, the chat starts a daemon,
answers, the daemon is stopped with `llmd stop`, and the next message starts a daemon again
with the conversation kept. Also what that daemon looks like from outside: `llmd serve ...` in
ps, and no ``.lock`` / ``.spawn.lock`` left once it stops.

One SmolLM2 daemon at a time (float32, one thread, a 512-token context and a 16 MiB pool, so
each start is mostly the GGUF read); its socket is under a fresh ``/tmp/llmdXXXX``.
"""

from __future__ import annotations

import fcntl
import os
import select
import shutil
import subprocess
import sys
import tempfile
import termios
import time

from daemon_harness import DAEMON_ENV

from llmd.daemon.client.client import Client

CLI = [sys.executable, "-c", "from llmd.daemon.cli.main import main; main()"]
ENGINE = ["--max-model-len", "512", "--kv-cache-memory", "16MiB", "--dtype", "float32", "--threads", "1"]


def read_until(fd: int, needle: bytes, timeout: float, buf: bytearray) -> bytes:
    """Read the pty until ``needle``; returns what came up to and including it (kept out of ``buf``)."""
    deadline = time.monotonic() + timeout
    while needle not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} within {timeout} s; got {bytes(buf[-2000:])!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                buf += os.read(fd, 4096)
            except OSError:  # the chat exited
                break
    i = buf.index(needle) + len(needle)
    out = bytes(buf[:i])
    del buf[:i]
    return out


def test_chat_restarts_a_stopped_daemon_and_keeps_the_history():
    tmp = tempfile.mkdtemp(prefix="llmd", dir="/tmp")
    sock, log = os.path.join(tmp, "c.sock"), os.path.join(tmp, "daemon.log")
    master, slave = os.openpty()

    def ctty():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(CLI + ["chat", "--socket", sock, "--daemon-log", log, "--temperature", "0",
                                   "--max-tokens", "24", "--verbose", *ENGINE],
                            stdin=slave, stdout=slave, stderr=slave, preexec_fn=ctty, cwd="/", close_fds=True,
                            env=DAEMON_ENV)
    os.close(slave)
    buf, client = bytearray(), Client(sock, timeout=30)
    try:
        read_until(master, b">>> ", 240, buf)  # the chat started a daemon
        assert not os.path.exists(sock + ".spawn.lock")  # removed once the daemon answered
        pid1 = client.health()["pid"]
        with open(f"/proc/{pid1}/cmdline", "rb") as f:
            title = f.read().replace(b"\0", b" ").decode()
        assert title.startswith(f"llmd serve --socket {sock} ") and " --model smollm2-135m " in title, title
        os.write(master, b"What is the capital of France?\r")
        answer = read_until(master, b">>> ", 120, buf)
        assert b"Paris" in answer and b" tokens/s" in answer, answer  # --verbose: a timing line per reply
        first = client.stats()["counters"]
        stop = subprocess.run(CLI + ["stop", "--socket", sock], capture_output=True, text=True, timeout=60,
                              env=DAEMON_ENV)
        assert stop.returncode == 0 and "daemon stopped" in stop.stdout, stop.stderr
        assert not os.path.exists(sock) and not os.path.exists(sock + ".lock")  # nothing left behind
        os.write(master, b"And what is the capital of Italy?\r")
        again = read_until(master, b">>> ", 240, buf)
        assert b"reconnecting" in again and b"daemon ready" in again and b"Rome" in again, again
        health = client.health()
        assert health["pid"] != pid1
        # the second daemon was sent the whole conversation: the first turn's prompt and reply and more
        second = client.stats()["counters"]
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["generation_tokens"], (first, second)
        os.write(master, b"\x04")  # Ctrl-D exits
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
        subprocess.run(CLI + ["stop", "--socket", sock], capture_output=True, timeout=60, env=DAEMON_ENV)
        shutil.rmtree(tmp, ignore_errors=True)
