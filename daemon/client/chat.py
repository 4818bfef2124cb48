"""``llmd chat``: a streaming REPL over the daemon (or an in-process engine).

A backend streams replies (``stream_chat``) and answers ``/stats`` (``stats_line``):
:class:`DaemonBackend` talks to a daemon that :func:`llmd.daemon.client.spawn.ensure_daemon`
found or started; ``llmd chat --no-daemon`` brings its own over an in-process engine
(``llmd.daemon.cli.chat``). Both format ``/stats`` with :func:`stats_line`.

REPL: ``/reset``, ``/system TEXT``, ``/stats``, ``/exit``; a line ending in ``\\`` continues
on the next line; Ctrl-C cancels the reply being streamed (closing the connection makes
the daemon abort it) and returns to the prompt; Ctrl-D exits.
"""

from __future__ import annotations

import sys
from typing import Iterator

import click

from llmd.daemon.client.client import Client

REPL_COMMANDS = ("/reset", "/system TEXT", "/stats", "/exit")


def stats_line(stats: dict) -> str:
    """``/stats``: one line of a ``/v1/stats`` payload (KV usage, prefix-cache hits, queue, aborts)."""
    kv, pc, sc = stats["kv_cache"], stats["prefix_cache"], stats["scheduler"]
    return (f"KV {kv['usage']:.1%} ({kv['used']}/{kv['total']} blocks), prefix cache hits {pc['hits']}/{pc['queries']} "
            f"tokens, {sc['running']} running, {sc['waiting']} waiting, "
            f"aborted {stats['counters']['requests_finished']['abort']}")


class DaemonBackend:
    """Streams chat replies from the daemon."""

    def __init__(self, client: Client):
        self.client = client

    def stream_chat(self, messages: list[dict], params: dict) -> Iterator[str]:
        body = {"messages": messages, **{k: v for k, v in params.items() if v is not None}}
        for chunk in self.client.stream("/v1/chat/completions", body):
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    yield text

    def stats_line(self) -> str:
        return stats_line(self.client.stats())


def _read_message() -> str:
    lines = [input(">>> ")]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(input("... "))
    return "\n".join(lines).strip()


def _reply(backend, messages: list[dict], params: dict) -> str | None:
    """Stream one reply to stdout; None if cancelled with Ctrl-C."""
    parts = []
    try:
        for text in backend.stream_chat(messages, params):
            parts.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write("\n[cancelled]\n")
        sys.stdout.flush()
        return None
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts)


def run_chat(backend, params: dict, system: str | None = None, prompt: str | None = None) -> None:
    """One answer for ``prompt``, else the REPL until Ctrl-D or ``/exit``."""
    base = [{"role": "system", "content": system}] if system else []
    if prompt is not None:
        if _reply(backend, base + [{"role": "user", "content": prompt}], params) is None:
            raise KeyboardInterrupt
        return
    messages = list(base)
    click.echo(f"llmd chat: {', '.join(REPL_COMMANDS)}; end a line with \\ to continue; Ctrl-C cancels a reply, "
               "Ctrl-D exits", err=True)
    while True:
        try:
            text = _read_message()
        except EOFError:
            click.echo("", err=True)
            return
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            continue
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            messages = list(base)
            click.echo("(conversation cleared)")
            continue
        if text.startswith("/system"):
            base = [{"role": "system", "content": text[len("/system"):].strip()}] if text[7:].strip() else []
            messages = base + [m for m in messages if m["role"] != "system"]
            click.echo("(system prompt set)")
            continue
        if text == "/stats":
            click.echo(backend.stats_line())
            continue
        if text.startswith("/") and not text.startswith("//") and " " not in text.split("\n")[0]:
            click.echo(f"unknown command {text.split()[0]} (commands: {', '.join(REPL_COMMANDS)}; "
                       f"start a message with // to send a literal /)", err=True)
            continue
        if text.startswith("//"):
            text = text[1:]
        messages.append({"role": "user", "content": text})
        reply = _reply(backend, messages, params)
        if reply is None:
            messages.pop()  # a cancelled turn leaves no trace in the conversation
        else:
            messages.append({"role": "assistant", "content": reply})
