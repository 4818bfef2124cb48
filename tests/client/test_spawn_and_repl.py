"""The client side of the daemon: waiting for a daemon to exit (its lock released, its process
gone: what ``llmd stop`` waits for) and the ``llmd chat`` REPL's commands, without a daemon."""

import subprocess
import sys

import pytest


def type_lines(monkeypatch, lines, on_line=None) -> None:
    """``input()`` returns ``lines`` one by one (``on_line(line)`` first, when given), then raises
    EOFError (Ctrl-D): what a user types at the REPL."""
    it = iter(lines)

    def fake_input(prompt):
        try:
            line = next(it)
        except StopIteration:
            raise EOFError from None
        if on_line is not None:
            on_line(line)
        return line

    monkeypatch.setattr("builtins.input", fake_input)


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

    type_lines(monkeypatch, ["/bogus", "//etc is a folder", "/reset", "hello"])
    chat.run_chat(Backend(), {}, system="be brief")
    assert sent == [["be brief", "/etc is a folder"], ["be brief", "hello"]]
    assert "unknown command /bogus" in capsys.readouterr().err


def test_repl_commands_are_their_first_word(monkeypatch, capsys):
    """A ``/`` message is a command named by its first word: an unknown word (``/systemfoo``, a
    typo ``/sytem You are...``, ``/etc/hosts is...``) and an argument to a command that takes
    none (``/reset extra``, ``/stats now``, ``/exit now``) print one line each and reach neither
    the model nor the system prompt; ``/system`` alone clears the prompt and says so."""
    from llmd.daemon.client import chat

    sent = []

    class Backend:
        def stream_chat(self, messages, params):
            sent.append([(m["role"], m["content"]) for m in messages])
            yield "ok"

        def stats_line(self):
            return "KV 0.0%"

    type_lines(monkeypatch, ["/systemfoo", "/sytem You are a pirate.", "/etc/hosts is a file?", "/reset extra",
                             "/stats now", "/exit now", "/quit please", "hi", "/system", "again",
                             "/system  Be  brief.", "/stats", "three", "/exit"])
    chat.run_chat(Backend(), {}, system="be kind")
    out = capsys.readouterr()
    assert sent == [[("system", "be kind"), ("user", "hi")],
                    [("user", "hi"), ("assistant", "ok"), ("user", "again")],
                    [("system", "Be  brief."), ("user", "hi"), ("assistant", "ok"), ("user", "again"),
                     ("assistant", "ok"), ("user", "three")]]
    err = out.err.splitlines()
    for word in ("/systemfoo", "/sytem", "/etc/hosts"):
        assert sum(line.startswith(f"unknown command {word} (commands:") for line in err) == 1, out.err
    for word in ("/reset", "/stats", "/exit", "/quit"):
        assert f"{word} takes no argument (usage: {word}); nothing was sent" in err, out.err
    assert out.out.splitlines() == ["ok", "(system prompt cleared)", "ok", "(system prompt set)", "KV 0.0%", "ok"]


def test_repl_notes_a_capped_reply_and_survives_a_failed_one(monkeypatch, capsys):
    """A reply that hit its cap ends with ``[stopped at N tokens]``; ``verbose`` adds tokens/s;
    a refused request (here a 400) prints one line and the REPL goes on without that turn."""
    from llmd.daemon.client import chat
    from llmd.daemon.client.client import ApiResponseError

    sent = []

    class Backend:
        finish_reason, completion_tokens = None, None

        def stream_chat(self, messages, params):
            sent.append([m["content"] for m in messages])
            if messages[-1]["content"] == "too long":
                raise ApiResponseError(400, {"error": {"message": "prompt has 9000 tokens"}})
            self.finish_reason, self.completion_tokens = "length", 7
            yield "la la"

    type_lines(monkeypatch, ["sing", "too long", "again"])
    chat.run_chat(Backend(), {"max_tokens": 7}, verbose=True)
    err = capsys.readouterr().err
    assert err.count("[stopped at 7 tokens]") == 2 and "7 tokens in " in err and " tokens/s" in err, err
    assert "llmd: error: daemon answered 400: prompt has 9000 tokens" in err
    assert sent[-1] == ["sing", "la la", "again"]  # the failed turn left no trace


def test_repl_says_a_full_context_in_its_own_words(monkeypatch, capsys):
    """A conversation past the context gets the REPL's remedy (/reset), not the API's
    (truncate_prompt_tokens, llmd generate's flag); other 400s keep the daemon's words."""
    from llmd.daemon.client import chat
    from llmd.daemon.client.client import ApiResponseError

    class Backend:
        def stream_chat(self, messages, params):
            raise ApiResponseError(400, {"error": {"param": "messages", "message": (
                "prompt has 431 tokens but the context is 256 tokens (max-model-len), leaving no room to generate "
                "(truncate_prompt_tokens, llmd generate --truncate-prompt-tokens, keeps its end)")}})
            yield ""

    type_lines(monkeypatch, ["hello"])
    chat.run_chat(Backend(), {})
    err = capsys.readouterr().err
    assert ("llmd: error: the conversation has 431 tokens but the context is 256 tokens (max-model-len), "
            "leaving no room to generate; /reset starts a new one") in err, err
    assert "truncate" not in err


def test_lock_files_are_removed_and_a_lock_on_a_removed_file_is_taken_again(tmp_path):
    """``protocol.lock_file`` / ``unlock_file``: the holder removes the file before letting go;
    a waiter that then wins the lock on the removed file drops it and locks the new file, so two
    holders never coexist (what ``<socket>.lock`` and ``.spawn.lock`` rely on)."""
    import os
    import threading
    import time

    from llmd.daemon.protocol import lock_file, unlock_file

    path = str(tmp_path / "s.sock.lock")
    fd = lock_file(path)
    got = {}

    def waiter():
        got["fd"] = lock_file(path)  # blocks on the first file, then re-locks the new one
        got["ino"] = os.fstat(got["fd"]).st_ino

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.3)
    unlock_file(path, fd)
    t.join(10)
    assert os.path.exists(path) and got["ino"] == os.stat(path).st_ino  # the waiter holds the file at the path
    try:
        lock_file(path, blocking=False)
        raise AssertionError("a second holder got the lock")
    except BlockingIOError:
        pass
    unlock_file(path, got["fd"])
    assert not os.path.exists(path)


def test_daemon_backend_reconnects_once_and_reports_a_cut_reply(monkeypatch, capsys):
    """No daemon on the socket → ``reconnect()`` gives a new client and the message is sent
    again (the whole conversation); a stream that breaks mid-reply (a crash) drops that turn
    with one line, and the REPL keeps the earlier history for the next message."""
    from llmd.daemon.client import chat
    from llmd.daemon.client.client import DaemonUnavailable

    bodies = []

    class GoneClient:
        def stream(self, path, body):
            raise DaemonUnavailable("no llmd daemon on /tmp/x.sock (No such file or directory)")
            yield  # a generator, like Client.stream

    class NewClient:
        def __init__(self):
            self.crash = False

        def stream(self, path, body):
            bodies.append([m["content"] for m in body["messages"]])
            assert body["stream_options"] == {"include_usage": True}
            yield {"choices": [{"index": 0, "delta": {"content": "Pa"}, "finish_reason": None}]}
            if self.crash:
                raise ConnectionResetError(104, "reset")
            yield {"choices": [{"index": 0, "delta": {"content": "ris"}, "finish_reason": "stop"}]}
            yield {"choices": [], "usage": {"completion_tokens": 2}}

    new = NewClient()
    reconnects = []
    backend = chat.DaemonBackend(GoneClient(), reconnect=lambda: reconnects.append(1) or new)
    def crash_on_italy(line):
        new.crash = line == "and Italy?"

    type_lines(monkeypatch, ["capital of France?", "and Italy?", "and Spain?"], crash_on_italy)
    chat.run_chat(backend, {})
    out = capsys.readouterr()
    assert reconnects == [1] and backend.client is new and backend.completion_tokens == 2
    assert "reconnecting" in out.err and "broke mid-reply" in out.err and "this reply is dropped" in out.err
    assert bodies == [["capital of France?"], ["capital of France?", "Paris", "and Italy?"],
                      ["capital of France?", "Paris", "and Spain?"]]


def test_a_draining_daemon_is_waited_out_then_replaced(monkeypatch, tmp_path, capsys):
    """A daemon answering ``/health`` 200 ``draining`` (after SIGTERM / `llmd stop`) refuses new
    requests with 503: `llmd chat` waits for it to exit and starts a daemon (``ensure_daemon``),
    and the REPL's next message after a 503 with code ``shutting_down`` reconnects as for a gone daemon
    (both sent their messages to the draining daemon and got the 503); another 503 is raised."""
    from llmd.daemon.client import chat, spawn
    from llmd.daemon.client.client import ApiResponseError

    events = []

    class FakeClient:
        def __init__(self, path, *a, **kw):
            pass

        def health(self, ready_only=True):
            if "exited" not in events:
                return {"status": "draining", "pid": 1}
            return {"status": "ok", "pid": 2} if "spawned" in events else None

    class Proc:
        pid, returncode = 2, None

        def poll(self):
            return None

    monkeypatch.setattr(spawn, "Client", FakeClient)
    monkeypatch.setattr(spawn, "wait_for_daemon_exit", lambda path, timeout, pid: events.append("exited") or True)
    monkeypatch.setattr(spawn.subprocess, "Popen", lambda cmd, **kw: events.append("spawned") or Proc())
    spawn.ensure_daemon(str(tmp_path / "s.sock"), [], str(tmp_path / "d.log"), echo=lambda m, nl=True: events.append(m))
    assert events[0] == f"llmd: the daemon on {tmp_path / 's.sock'} is shutting down; waiting for it to exit"
    assert events[1:3] == ["exited", "spawned"], events

    def refusing(message, code=None):
        class Refusing:
            def stream(self, path, body):
                raise ApiResponseError(503, {"error": {"message": message, "code": code}})
                yield
        return Refusing()

    class NewClient:
        def stream(self, path, body):
            yield {"choices": [{"index": 0, "delta": {"content": "Paris"}, "finish_reason": "stop"}]}

    new = NewClient()
    backend = chat.DaemonBackend(refusing("the daemon is shutting down", "shutting_down"), reconnect=lambda: new)
    assert list(backend.stream_chat([{"role": "user", "content": "hi"}], {})) == ["Paris"]
    assert backend.client is new and "shutting down; reconnecting" in capsys.readouterr().err
    backend = chat.DaemonBackend(refusing("the model is still loading"), reconnect=lambda: new)
    with pytest.raises(ApiResponseError):
        list(backend.stream_chat([{"role": "user", "content": "hi"}], {}))
    # the 503's structured code decides, not its wording
    backend = chat.DaemonBackend(refusing("the daemon is shutting down"), reconnect=lambda: new)
    with pytest.raises(ApiResponseError):
        list(backend.stream_chat([{"role": "user", "content": "hi"}], {}))


def test_a_conversation_past_the_context_drops_its_oldest_turns(monkeypatch, capsys):
    """After a reply that shifted the context, the history no longer fits it: every later message
    was refused until ``/reset``. The REPL now drops the oldest turns (the system prompt kept), one
    dim line each, until the daemon takes the conversation; a lone message that does not fit is
    still the one-line refusal."""
    from llmd.daemon.client import chat
    from llmd.daemon.client.client import ApiResponseError

    sent = []

    class Backend:
        def stream_chat(self, messages, params):
            sent.append([m["content"] for m in messages])
            words = sum(len(m["content"].split()) for m in messages)
            if words > 6:
                raise ApiResponseError(400, {"error": {"param": "messages", "message": (
                    f"prompt has {words} tokens but the context is 6 tokens (max_model_len), leaving no room "
                    "to generate (truncate_prompt_tokens opts in to keeping its end)")}})
            yield "a b"

    type_lines(monkeypatch, ["one", "two", "three", "a b c d e f g", "/exit"])
    chat.run_chat(Backend(), {}, system="sys")
    out = capsys.readouterr()
    assert sent[:3] == [["sys", "one"], ["sys", "one", "a b", "two"], ["sys", "one", "a b", "two", "a b", "three"]]
    assert sent[3] == ["sys", "two", "a b", "three"]  # the oldest turn dropped, then it fits
    assert sent[-1] == ["sys", "a b c d e f g"]  # everything else dropped: the message alone is refused
    assert out.err.count("its oldest turn is dropped") == 1 + 2, out.err
    assert "llmd: error: the conversation has 8 tokens but the context is 6 tokens" in out.err, out.err
