"""``llmd bench startup``'s timing harness against a stand-in daemon (no model): it waits for the
first /health 200 on the default socket of its own $XDG_RUNTIME_DIR, reads the process's CPU
seconds then, stops it with SIGTERM; and the report's medians and ratios."""

from __future__ import annotations

import sys

import pytest

from llmd.daemon.bench import startup

#: answers /health 503 for 0.3 s, then 200, on $XDG_RUNTIME_DIR/llmd/llmd.sock; burns ~0.2 s of CPU first
FAKE_SERVE = r"""
import os, socket, sys, time
t0 = time.process_time()
while time.process_time() - t0 < 0.2:
    pass
d = os.path.join(os.environ["XDG_RUNTIME_DIR"], "llmd")
os.makedirs(d)
s = socket.socket(socket.AF_UNIX)
s.bind(os.path.join(d, "llmd.sock"))
s.listen()
start = time.monotonic()
open(os.path.join(os.environ["OUT"], "argv"), "w").write(" ".join(sys.argv[1:]))
while True:
    c, _ = s.accept()
    c.recv(1000)
    c.sendall(b"HTTP/1.1 " + (b"200 OK" if time.monotonic() - start > 0.3 else b"503 x") + b"\r\n\r\n")
    c.close()
"""


def test_time_serve_waits_for_a_200_and_stops_the_daemon(tmp_path, monkeypatch):
    monkeypatch.setattr(startup, "CLI", [sys.executable, "-c", FAKE_SERVE])
    wall, cpu = startup.time_serve(["--model", "m.gguf"], {"OUT": str(tmp_path), "PATH": ""}, timeout=30)
    assert 0.5 < wall < 20 and 0.15 < cpu < wall
    assert (tmp_path / "argv").read_text() == "serve --model m.gguf"
    monkeypatch.setattr(startup, "CLI", [sys.executable, "-c", "import sys; print('boom', file=sys.stderr)"])
    with pytest.raises(RuntimeError, match="did not become ready: boom"):
        startup.time_serve([], {}, timeout=30)


def test_time_command_counts_the_childs_cpu(monkeypatch):
    monkeypatch.setattr(startup, "CLI", [sys.executable, "-c", "import time\nt = time.process_time()\n"
                                         "while time.process_time() - t < 0.2: pass"])
    wall, cpu = startup.time_command([], {})
    assert 0.15 < cpu <= wall + 0.05
    monkeypatch.setattr(startup, "CLI", [sys.executable, "-c", "raise SystemExit('bad option')"])
    with pytest.raises(RuntimeError, match="bad option"):
        startup.time_command(["kv-size"], {})


def test_report_medians_and_ratio_to_warm():
    rows = [startup.Timings("cold", [30.0, 10.0, 20.0], [9.0, 8.0, 7.0]), startup.Timings("warm", [2.0, 4.0, 3.0],
                                                                                        [1.0, 2.0, 1.5])]
    lines = startup.report(rows)
    assert lines[1].split() == ["cold", "20.00", "[10.00-30.00]", "8.00", "[7.00-9.00]", "6.67x"]
    assert lines[2].split() == ["warm", "3.00", "[2.00-4.00]", "1.50", "[1.00-2.00]", "1.00x"]
