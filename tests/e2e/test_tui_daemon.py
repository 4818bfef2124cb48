"""``llmd top`` against a real daemon in a subprocess (``tests/fixtures/daemon_harness.py``), and run
from a regular (non-editable) install of a freshly built wheel."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import sysconfig
import termios
import threading
import time
import zipfile
from pathlib import Path

from stats_payloads import load

from llmd.daemon.client.client import ApiResponseError, Client
from llmd.tui.app import TopApp
from llmd.tui.request_table import RequestTable

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Write a long story about a lighthouse keeper.", "Explain how bread is made, step by step.",
           "List every country in Europe with its capital."]


def assert_keys_subset(recorded, live, path="stats") -> None:
    """Every key of the recorded payload (recursively) is in the live one: a rename or removal
    in the daemon's schema breaks this, so the recorded payloads must be re-recorded."""
    if isinstance(recorded, dict):
        assert isinstance(live, dict), path
        for k, v in recorded.items():
            assert k in live, f"{path}.{k} is in tests/fixtures/data but no longer sent by the daemon"
            assert_keys_subset(v, live[k], f"{path}.{k}")
    elif isinstance(recorded, list) and recorded and isinstance(recorded[0], dict) and live:
        assert_keys_subset(recorded[0], live[0], f"{path}[0]")


def test_top_shows_and_aborts_requests_of_a_real_daemon(llmd_daemon, request):
    d = llmd_daemon  # the small daemon is stopped by test_server_load's SIGTERM test
    d.wait_idle(60)
    results: dict = {}  # request id → (finish_reason, completion_tokens)
    threads = [threading.Thread(target=_stream, args=(d, p, results)) for p in PROMPTS]

    def cleanup():
        c = d.client(timeout=10)
        for r in c.stats()["requests"]:
            try:
                c.abort(r["id"])
            except ApiResponseError:
                pass  # finished meanwhile
        for t in threads:
            t.join(30)
        d.wait_idle(30)

    request.addfinalizer(cleanup)
    for t in threads:
        t.start()

    async def go():
        app = TopApp(Client(d.path, timeout=10), interval=1000)
        async with app.run_test(size=(80, 24)) as pilot:
            await app.workers.wait_for_complete()
            table = app.main.query_one(RequestTable)
            deadline = time.monotonic() + 30
            while len(table.row_ids) < len(PROMPTS):
                assert time.monotonic() < deadline, f"requests never showed up: {table.row_ids}"
                await asyncio.sleep(0.2)
                await app.poll_now()
                await pilot.pause()
            live = d.client().stats()
            assert_keys_subset(load("busy"), live)
            assert_keys_subset(load("idle"), live)
            table.move_cursor(row=1)
            await pilot.pause()
            victim = table.selected_id
            await pilot.press("a")
            await app.workers.wait_for_complete()
            assert app.messages[-1].endswith("done"), app.messages
            assert victim not in [r["id"] for r in d.client().stats()["requests"]]
            assert victim not in table.row_ids and len(table.row_ids) == len(PROMPTS) - 1
            await pilot.press("c", "y")  # the route may not exist yet: a clear message, never a crash
            await app.workers.wait_for_complete()
            assert ": done" in app.messages[-1] or "failed: 404" in app.messages[-1], app.messages
            assert app.kind == "live"
            return victim

    victim = asyncio.run(go())
    deadline = time.monotonic() + 20
    while victim not in results and time.monotonic() < deadline:
        time.sleep(0.1)
    finish_reason, tokens = results[victim]
    assert finish_reason == "abort" and tokens < 200, results


def _stream(d, prompt, results: dict) -> None:
    """Stream one 200-token completion; record its finish reason and token count by request id."""
    rid, finish, tokens = None, None, 0
    try:
        for ev in d.client(timeout=120).stream("/v1/completions", {
                "prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}):
            rid = rid or f"{ev['id']}-0"
            for ch in ev.get("choices") or []:
                finish = ch.get("finish_reason") or finish
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
    finally:
        if rid:
            results[rid] = (finish, tokens)


def test_llmd_top_runs_from_a_regular_install(tmp_path):
    """Build a wheel, unpack it, run ``llmd top`` from it in a pseudo-terminal (no daemon: it
    must say so and keep running), press q."""
    try:
        import tomllib

        setuptools_cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
        folders = set(setuptools_cfg["package-dir"].values())
    except ImportError:  # Python 3.10
        folders = {"daemon", "models", "kernels", "quant", "tui"}
    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    for folder in folders:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src)]
    if subprocess.run(wheel + ["--no-build-isolation"], timeout=180, capture_output=True).returncode:
        subprocess.run(wheel, check=True, timeout=300, capture_output=True)  # no setuptools in this venv
    site = tmp_path / "site"
    with zipfile.ZipFile(next((tmp_path / "dist").glob("llmd-*.whl"))) as whl:
        assert "llmd/tui/llmd.tcss" in whl.namelist()
        whl.extractall(site)
    # -S: no .pth files, so an editable install's finder cannot serve llmd from the repo
    script = (f"import sys; sys.path[:0] = [{str(site)!r}, {sysconfig.get_paths()['purelib']!r}]\n"
              f"import llmd.tui.app; assert llmd.tui.app.__file__.startswith({str(site)!r}), llmd.tui.app.__file__\n"
              "from llmd.daemon.cli.main import main; sys.argv = ['llmd', 'top', '--socket', sys.argv[1]]; main()\n")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = dict(os.environ, TERM="xterm-256color", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-S", "-c", script, str(tmp_path / "none.sock")], stdin=slave,
                            stdout=slave, stderr=slave, cwd=tmp_path, env=env, close_fds=True)
    os.close(slave)
    seen, deadline = b"", time.monotonic() + 60
    try:
        while b"no llmd daemon on" not in re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", seen):
            assert proc.poll() is None and time.monotonic() < deadline, seen[-2000:]
            if select.select([master], [], [], 0.5)[0]:
                seen += os.read(master, 65536)
        os.write(master, b"q")
        end = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < end:  # keep draining so it never blocks on output
            if select.select([master], [], [], 0.2)[0]:
                try:
                    os.read(master, 65536)
                except OSError:
                    break
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
