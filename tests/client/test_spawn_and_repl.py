"""The client side of the daemon: waiting for a daemon to exit (its lock released, its process
gone: what ``llmd stop`` waits for) and the ``llmd chat`` REPL's commands, without a daemon."""

import subprocess
import sys


def test_stop_waits_for_the_daemon_process_to_exit(tmp_path):
    """`llmd stop` returns only once the daemon's lock is released (process exit), not when its
    socket file disappears (the daemon removes it first): `llmd serve` can reclaim the path at
    once. A stand-in process holds ``<socket>.lock`` for 1.5 s after the socket file is gone."""
    from llmd.daemon.client.spawn import lock_held, pid_running, wait_for_daemon_exit

    sock = str(tmp_path / "s.sock")
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, sys, time
fd = os.open({sock + '.lock'!r}, os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(1.5)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert lock_held(sock + ".lock")
        assert not wait_for_daemon_exit(sock, 0.3)  # still running
        assert wait_for_daemon_exit(sock, 10, holder.pid)  # lock released and the process gone
        assert not lock_held(sock + ".lock") and not pid_running(holder.pid)
    finally:
        holder.kill()
        holder.wait()


def test_repl_unknown_command_is_not_sent_to_the_model(monkeypatch, capsys):
    """``/bogus`` prints the command list; ``//text`` sends ``/text``; ``/reset`` keeps the
    system prompt."""
    from llmd.daemon.client import chat

    sent = []

    class Backend:
        def stream_chat(self, messages, params):
            sent.append([m["content"] for m in messages])
            yield "ok"

    lines = iter(["/bogus", "//etc is a folder", "/reset", "hello"])

    def fake_input(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    chat.run_chat(Backend(), {}, system="be brief")
    assert sent == [["be brief", "/etc is a folder"], ["be brief", "hello"]]
    assert "unknown command /bogus" in capsys.readouterr().err
