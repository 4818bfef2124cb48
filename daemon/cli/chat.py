"""``llmd chat``: the REPL (:mod:`llmd.daemon.client.chat`) against a daemon, found or started
(:mod:`llmd.daemon.client.spawn`), or against an engine in this process (``--no-daemon``)."""

from __future__ import annotations

from typing import Iterator

import click
from click.core import ParameterSource

from llmd.daemon.cli.common import (
    build_engine,
    client_for,
    engine_options,
    one_line_errors,
    prompt_text,
    socket_option,
    socket_path_of,
)
from llmd.daemon.client.chat import CHAT_DEFAULTS
from llmd.daemon.core.errors import LlmdError


class LocalBackend:
    """Runs the engine in this process (``--no-daemon``); ``/stats`` from the engine's own stats."""

    def __init__(self, engine):
        self.engine = engine

    finish_reason: str | None = None
    completion_tokens: int | None = None

    def stream_chat(self, messages: list[dict], params: dict) -> Iterator[str]:
        from llmd.daemon.core.request import SamplingParams

        eng = self.engine
        rid = eng.add_request(messages, SamplingParams(**params))
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    self.finish_reason, self.completion_tokens = out.finish_reason, out.num_output_tokens
                    if out.new_text:
                        yield out.new_text
        finally:
            eng.abort(rid)

    def stats_line(self) -> str:
        from llmd.daemon.client.chat import stats_line

        return stats_line(self.engine.make_stats().to_dict("", 0.0)) + " (in-process engine)"


def check_params(params: dict) -> None:
    """The sampling options' ranges (``SamplingParams.validate``'s), checked in this process
    before a daemon is started or found, without importing the engine (torch).

    Raises:
        LlmdError: one naming the option, e.g. ``--max-tokens must be >= 1, got 0``.
    """
    checks = (("max_tokens", params["max_tokens"] >= 1, ">= 1"),
              ("temperature", 0 <= params["temperature"] <= 2, "in [0, 2] (the API's range)"),
              ("top_k", params["top_k"] >= 0, ">= 0 (0 = off)"), ("top_p", 0 < params["top_p"] <= 1, "in (0, 1]"),
              ("repetition_penalty", params["repetition_penalty"] > 0, "> 0"))
    for name, ok, rule in checks:
        if not ok:
            raise LlmdError(f"--{name.replace('_', '-')} must be {rule}, got {params[name]}")


def check_chat_template(model: str) -> None:
    """Before a daemon is started for ``model`` or its weights load: it must have a chat
    template. Reads the GGUF header through ``models.header_cache`` (milliseconds once cached,
    no torch import); a ``random:`` preset is not checked.

    Raises:
        LlmdError: no chat template (a base model), or the model cannot be resolved.
    """
    if model.startswith("random:"):
        return
    from llmd.models.header_cache import load_config
    from llmd.models.registry import resolve_model

    if not load_config(resolve_model(model)).chat_template:
        raise LlmdError(f"model {model} has no chat template (a base model), so it cannot chat; "
                        "use `llmd generate` for plain completions")


@click.command()
@socket_option
@click.option("-p", "--prompt", default=None, help="Answer this one question and exit (- reads it from stdin).")
@click.option("--system", default=None, help="System prompt.")
@click.option("--temperature", default=CHAT_DEFAULTS["temperature"], show_default=True, type=float,
              help="0 = greedy. The chat defaults (README \"Chat defaults\") are measured on SmolLM2-135M; "
                   "the HTTP API keeps OpenAI's.")
@click.option("--top-k", default=CHAT_DEFAULTS["top_k"], show_default=True, type=int, help="0 = off.")
@click.option("--top-p", default=CHAT_DEFAULTS["top_p"], show_default=True, type=float)
@click.option("--repetition-penalty", default=CHAT_DEFAULTS["repetition_penalty"], show_default=True, type=float,
              help="HF-style penalty on tokens of the prompt and reply (1 = off).")
@click.option("--max-tokens", default=CHAT_DEFAULTS["max_tokens"], show_default=True, type=int,
              help="New tokens per reply at most; a reply cut there ends with [stopped at N tokens].")
@click.option("--seed", default=None, type=int, help="Sampling seed of every reply (default: random).")
@click.option("--verbose", "-v", is_flag=True, help="After each reply: its tokens, seconds and tokens/s.")
@click.option("--no-daemon", is_flag=True, help="Run the engine in this process instead of talking to a daemon.")
@click.option("--daemon-log", default=None,
              help="Log file of an auto-started daemon (default: ~/.cache/llmd/daemon.log).")
@engine_options
@one_line_errors
def chat(socket_path, prompt, system, temperature, top_k, top_p, repetition_penalty, max_tokens, seed, verbose,
         no_daemon, daemon_log, **engine_kw):
    """Chat with the model; starts a background daemon if none runs (it keeps running: `llmd stop`)."""
    from llmd.daemon.cli.common import served_id
    from llmd.daemon.client import chat as repl
    from llmd.daemon.client import spawn

    params = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "repetition_penalty": repetition_penalty,
              "max_tokens": max_tokens, "seed": seed, "context_overflow": "shift"}  # a reply may cross the context
    check_params(params)  # before any daemon starts or weights load
    prompt = prompt_text(prompt, "--prompt")
    if no_daemon:
        check_chat_template(engine_kw["model"])
        backend = LocalBackend(build_engine(**engine_kw))
    else:
        path, serve_args = socket_path_of(socket_path), spawn.engine_args(engine_kw)
        # the one /health asked at start: 200 ok / draining, 503 loading / dead / stalled, None (nothing answers);
        # a serving answer is handed on, so ensure_daemon and check_running_daemon do not ask again
        health = client_for(socket_path).health(ready_only=False)
        serving = spawn.serving_body(health)
        # a daemon of its own options: one that serves, loads, or is still starting (a draining one is waited out)
        already = serving is not None or (health or {}).get("status") == "loading" or \
            spawn.starting_pid(path) is not None
        if not already:  # a daemon would be started for this model
            check_chat_template(engine_kw["model"])
        client = spawn.ensure_daemon(path, serve_args, daemon_log, ready_health=serving)
        if already:
            ctx = click.get_current_context()
            given = [k for k in engine_kw if ctx.get_parameter_source(k) in (ParameterSource.COMMANDLINE,
                                                                               ParameterSource.ENVIRONMENT)]
            spawn.check_running_daemon(client, served_id(engine_kw["model"]) if "model" in given else None,
                                       ["--" + k.replace("_", "-") for k in given if k != "model"], health=serving)
        backend = repl.DaemonBackend(client, reconnect=lambda: spawn.reconnect(path, serve_args, daemon_log))
    repl.run_chat(backend, params, system=system, prompt=prompt, verbose=verbose)
