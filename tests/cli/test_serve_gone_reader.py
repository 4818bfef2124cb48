"""``llmd serve 2>&1 | head -1``: once the reader of the daemon's output has gone, its next line
(``llmd: loaded ...``, then ``llmd: serving ...``) raised BrokenPipeError and the daemon died
(exit 1). It now points that stream at /dev/null and keeps serving
(:mod:`llmd.daemon.cli.daemon_output`)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from llmd.daemon.cli.daemon_output import DaemonLogHandler
from llmd.daemon.client.client import Client

SERVE = [sys.executable, "-c", "from llmd.daemon.cli.main import main; main()", "serve"]


def test_serve_keeps_serving_after_its_output_pipe_is_closed():
    tmp = tempfile.mkdtemp(prefix="llmd", dir="/tmp")  # a short socket path
    path = os.path.join(tmp, "d.sock")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(SERVE + ["--socket", path, "--model", "random:qwen3-0.6b:layers=1", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            cwd="/")
    try:
        first = proc.stdout.readline()
        assert first.startswith(b"llmd: loading"), first
        proc.stdout.close()  # `| head -1` has gone: every later write gets EPIPE
        client, deadline, health = Client(path, timeout=10), time.monotonic() + 120, None
        while health is None and proc.poll() is None and time.monotonic() < deadline:
            health = client.health()
            time.sleep(0.1)
        assert health is not None and health["status"] == "ok", (proc.poll(), health)
        proc.send_signal(signal.SIGTERM)  # its "shutting down" and "stopped" lines go nowhere too
        assert proc.wait(60) == 0
        assert not os.path.exists(path) and not os.path.exists(path + ".lock")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_log_write_to_a_gone_reader_drops_the_stream_without_a_report(capsys):
    r, w = os.pipe()
    os.close(r)
    stream = os.fdopen(w, "w")
    try:
        handler = DaemonLogHandler(stream)
        record = logging.LogRecord("llmd.serve", logging.INFO, __file__, 1, "a line", None, None)
        handler.emit(record)  # EPIPE: the descriptor now points at /dev/null
        handler.emit(record)
        assert os.path.samestat(os.fstat(w), os.stat(os.devnull))
        assert "Logging error" not in capsys.readouterr().err
    finally:
        stream.close()


def test_a_full_disk_is_not_a_gone_reader(capsys):
    """ENOSPC (a full disk under ``daemon.log``) keeps the stream: the record gets logging's own
    error report, and the descriptor still points where it did (only a reader that left is dropped)."""
    stream = open("/dev/full", "w")
    try:
        handler = DaemonLogHandler(stream)
        handler.emit(logging.LogRecord("llmd.serve", logging.INFO, __file__, 1, "a line", None, None))
        assert os.path.samestat(os.fstat(stream.fileno()), os.stat("/dev/full"))
        assert "Logging error" in capsys.readouterr().err
    finally:
        try:
            stream.close()
        except OSError:  # its buffered line still fails to flush
            pass
