"""``llmd chat``: a streaming REPL over the daemon (or an in-process engine).

A backend streams replies (``stream_chat``) and answers ``/stats`` (``stats_line``):
:class:`DaemonBackend` talks to a daemon that :func:`llmd.daemon.client.spawn.ensure_daemon`
found or started; ``llmd chat --no-daemon`` brings its own over an in-process engine
(``llmd.daemon.cli.chat``). Both format ``/stats`` with :func:`stats_line`.

REPL: ``/reset``, ``/system TEXT`` (no text clears it), ``/stats``, ``/exit``; a message
starting with ``/`` is a command, its first whitespace-separated word: an unknown word, or an
argument to a command that takes none, prints one line and sends nothing (``//`` sends a
literal ``/``); a line ending in ``\\`` continues on the next line; Ctrl-C cancels the reply
being streamed (closing the connection makes the daemon abort it) and returns to the prompt;
Ctrl-D exits.

The daemon may go away mid-session (``llmd stop``, a crash): the next message waits for the
old process to exit and starts or finds a daemon again (the backend's ``reconnect``), with the
conversation kept; a reply cut by a lost connection is dropped like a cancelled one. A reply
that reaches its token cap ends with a dim ``[stopped at N tokens]`` on stderr; ``verbose``
adds a dim line of tokens, seconds and tokens/s per reply (Ollama's ``--verbose``).
"""

from __future__ import annotations

import http.client
import signal
import sys
import threading
import time
from typing import Callable, Iterator

import click

from llmd.daemon.client.client import ApiResponseError, Client, DaemonUnavailable
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.protocol import DRAINING_CODE

REPL_COMMANDS = ("/reset", "/system TEXT", "/stats", "/exit")
#: the REPL's command words (``/quit``: ``/exit``); only ``/system`` takes an argument (none clears it)
COMMANDS = ("/reset", "/system", "/stats", "/exit", "/quit")
#: ``llmd chat``'s sampling defaults (the API keeps OpenAI's), Ollama's: of the candidates measured
#: on SmolLM2-135M over ten everyday prompts, seeded 0..9, the only one whose ten replies all end
#: with ``stop`` within 512 tokens (README "`llmd chat`'s defaults"; ``tests/client/test_chat_defaults.py``)
CHAT_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 512}


class ReplyLost(LlmdError):
    """The connection to the daemon broke while a reply streamed (the daemon stopped or crashed)."""


def stats_line(stats: dict) -> str:
    """``/stats``: one line of a ``/v1/stats`` payload (KV usage, prefix-cache hits, queue, aborts)."""
    kv, pc, sc = stats["kv_cache"], stats["prefix_cache"], stats["scheduler"]
    return (f"KV {kv['usage']:.1%} ({kv['used']}/{kv['total']} blocks), prefix cache hits {pc['hits']}/{pc['queries']} "
            f"tokens, {sc['running']} running, {sc['waiting']} waiting, "
            f"aborted {stats['counters']['requests_finished']['abort']}")


class DaemonBackend:
    """Streams chat replies from the daemon.

    After each reply ``finish_reason`` and ``completion_tokens`` hold the stream's last
    values (None when it sent none). ``reconnect``: returns a client of a daemon on the same
    socket, started if need be (``llmd chat`` passes ``spawn.reconnect``); without it a gone
    daemon is an error.

    Raises (from ``stream_chat``):
        DaemonUnavailable: no daemon answers and there is no ``reconnect``.
        ReplyLost: the connection broke mid-reply.
        ApiResponseError: the daemon refused the request (4xx/5xx).
    """

    def __init__(self, client: Client, reconnect: Callable[[], Client] | None = None):
        self.client, self.reconnect = client, reconnect
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None

    def stream_chat(self, messages: list[dict], params: dict) -> Iterator[str]:
        body = {"messages": messages, **{k: v for k, v in params.items() if v is not None},
                "stream_options": {"include_usage": True}}
        self.finish_reason = self.completion_tokens = None
        try:
            chunks = self.client.stream("/v1/chat/completions", body)
            first = next(chunks, None)
        except (DaemonUnavailable, ApiResponseError) as e:
            draining = isinstance(e, ApiResponseError) and e.status == 503 and e.code == DRAINING_CODE
            if self.reconnect is None or (isinstance(e, ApiResponseError) and not draining):
                raise
            click.echo("llmd: the daemon is shutting down; reconnecting once it exits ..." if draining
                       else "llmd: the daemon is gone (stopped or crashed); reconnecting ...", err=True)
            self.client = self.reconnect()
            chunks = self.client.stream("/v1/chat/completions", body)
            first = next(chunks, None)
        try:
            if first is not None:
                yield from self._texts(first)
                for chunk in chunks:
                    yield from self._texts(chunk)
        except (ConnectionError, http.client.HTTPException) as e:
            raise ReplyLost(f"the connection to the daemon broke mid-reply ({type(e).__name__})") from None

    def _texts(self, chunk: dict) -> Iterator[str]:
        if chunk.get("usage"):
            self.completion_tokens = chunk["usage"].get("completion_tokens")
        for choice in chunk.get("choices", []):
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
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


def _dim(text: str) -> None:
    click.echo(click.style(text, dim=True), err=True)


def context_full(e: Exception) -> str | None:
    """The REPL's words for a conversation that fills the model's context (the API's 400 names
    ``messages`` and the API's own remedies), else None."""
    msg = getattr(e, "message", "")
    if getattr(e, "param", None) != "messages" or "leaving no room to generate" not in msg:
        return None
    return msg.split(" (truncate_prompt_tokens")[0].replace("prompt has", "the conversation has", 1) + \
        "; /reset starts a new one"


FULL = object()  # _reply's answer when the conversation fills the context and older turns could go


def _reply(backend, messages: list[dict], params: dict, verbose: bool = False, repl: bool = False,
           can_drop: bool = False):
    """Stream one reply to stdout; None if cancelled with Ctrl-C or, in the ``repl``, failed
    (the error is printed, the REPL goes on); :data:`FULL`, printing nothing, when ``can_drop``
    and the conversation leaves the context no room (the caller drops its oldest turn). Then
    ``[stopped at N tokens]`` when the reply hit its cap, and with ``verbose`` its tokens,
    seconds and tokens/s (wall clock from the request, and decode rate after the first text).

    Raises:
        LlmdError: outside the ``repl``, what the backend raised (no daemon, a refused request).
    """
    parts, t0, t_first = [], time.monotonic(), None
    try:
        for text in backend.stream_chat(messages, params):
            t_first = t_first or time.monotonic()
            parts.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write("\n[cancelled]\n")
        sys.stdout.flush()
        return None
    except LlmdError as e:  # ReplyLost, ApiResponseError, DaemonUnavailable
        if not repl:
            raise
        if can_drop and not parts and context_full(e):
            return FULL
        sys.stdout.write("\n" if parts else "")
        click.echo(f"llmd: error: {context_full(e) or e}" + ("; this reply is dropped" if parts else ""), err=True)
        return None
    sys.stdout.write("\n")
    sys.stdout.flush()
    n = getattr(backend, "completion_tokens", None)
    if getattr(backend, "finish_reason", None) == "length":
        _dim(f"[stopped at {n if n is not None else params.get('max_tokens')} tokens]")
    if verbose and n:
        now = time.monotonic()
        then = f", then {(n - 1) / (now - t_first):.1f} tokens/s" if n > 1 and t_first and now > t_first else ""
        _dim(f"[{n} tokens in {now - t0:.2f} s ({n / (now - t0):.1f} tokens/s); "
             f"first text after {(t_first or now) - t0:.2f} s{then}]")
    return "".join(parts)


def run_chat(backend, params: dict, system: str | None = None, prompt: str | None = None,
             verbose: bool = False) -> None:
    """One answer for ``prompt``, else the REPL until Ctrl-D or ``/exit`` (``verbose``: a
    timing line per reply)."""
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C cancels a reply: Python leaves SIGINT ignored when the parent process ignored it
        # (a shell's background job, a test runner), so the handler is installed explicitly
        signal.signal(signal.SIGINT, signal.default_int_handler)
    base = [{"role": "system", "content": system}] if system else []
    if prompt is not None:
        if _reply(backend, base + [{"role": "user", "content": prompt}], params, verbose) is None:
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
        if text.startswith("/") and not text.startswith("//"):
            word, arg = (text.split(None, 1) + [""])[:2]  # the command is the first whitespace-separated word
            if word not in COMMANDS:
                click.echo(f"unknown command {word} (commands: {', '.join(REPL_COMMANDS)}; "
                           f"start a message with // to send a literal /)", err=True)
                continue
            if arg and word != "/system":
                click.echo(f"{word} takes no argument (usage: {word}); nothing was sent", err=True)
                continue
            if word in ("/exit", "/quit"):
                return
            if word == "/reset":
                messages = list(base)
                click.echo("(conversation cleared)")
            elif word == "/system":
                base = [{"role": "system", "content": arg.strip()}] if arg.strip() else []
                messages = base + [m for m in messages if m["role"] != "system"]
                click.echo("(system prompt set)" if base else "(system prompt cleared)")
            else:  # /stats
                try:
                    click.echo(backend.stats_line())
                except LlmdError as e:
                    click.echo(f"llmd: error: {e}", err=True)
            continue
        if text.startswith("//"):
            text = text[1:]
        messages.append({"role": "user", "content": text})
        # a history past the context (a shifted reply stays in it whole) loses its oldest turns, the
        # system prompt kept (as Ollama's chat), instead of refusing every later message
        while (reply := _reply(backend, messages, params, verbose, repl=True,
                               can_drop=len(messages) > len(base) + 1)) is FULL:
            del messages[len(base)]  # the oldest user message, and the reply to it
            if len(messages) > len(base) + 1 and messages[len(base)]["role"] == "assistant":
                del messages[len(base)]
            _dim("[the conversation is longer than the context: its oldest turn is dropped]")
        if reply is None:
            messages.pop()  # a cancelled or failed turn leaves no trace in the conversation
        else:
            messages.append({"role": "assistant", "content": reply})
