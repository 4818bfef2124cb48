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
    socket_option,
    socket_path_of,
)


class LocalBackend:
    """Runs the engine in this process (``--no-daemon``); ``/stats`` from the engine's own stats."""

    def __init__(self, engine):
        self.engine = engine

    def stream_chat(self, messages: list[dict], params: dict) -> Iterator[str]:
        from llmd.daemon.core.request import SamplingParams

        eng = self.engine
        rid = eng.add_request(messages, SamplingParams(**params))
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.new_text:
                        yield out.new_text
        finally:
            eng.abort(rid)

    def stats_line(self) -> str:
        from llmd.daemon.client.chat import stats_line

        return stats_line(self.engine.make_stats().to_dict("", 0.0)) + " (in-process engine)"


@click.command()
@socket_option
@click.option("-p", "--prompt", default=None, help="Answer this one question and exit.")
@click.option("--system", default=None, help="System prompt.")
@click.option("--temperature", default=0.0, show_default=True, type=float,
              help="0 = greedy (the default: small models answer best greedy); e.g. 0.7 for varied replies.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--max-tokens", default=None, type=int,
              help="New tokens per reply at most (default: the remaining context).")
@click.option("--seed", default=None, type=int)
@click.option("--no-daemon", is_flag=True, help="Run the engine in this process instead of talking to a daemon.")
@click.option("--daemon-log", default=None,
              help="Log file of an auto-started daemon (default: ~/.cache/llmd/daemon.log).")
@engine_options
@one_line_errors
def chat(socket_path, prompt, system, temperature, top_p, max_tokens, seed, no_daemon, daemon_log, **engine_kw):
    """Chat with the model; starts a background daemon if none runs (it keeps running: `llmd stop`)."""
    from llmd.daemon.client import chat as repl
    from llmd.daemon.client import spawn

    params = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "seed": seed}
    if no_daemon:
        backend = LocalBackend(build_engine(**engine_kw))
    else:
        already = client_for(socket_path).health() is not None
        client = spawn.ensure_daemon(socket_path_of(socket_path), spawn.engine_args(engine_kw), daemon_log)
        if already:
            ctx = click.get_current_context()
            given = [k for k in engine_kw if ctx.get_parameter_source(k) in (ParameterSource.COMMANDLINE,
                                                                               ParameterSource.ENVIRONMENT)]
            spawn.check_running_daemon(client, engine_kw["model"] if "model" in given else None,
                                       ["--" + k.replace("_", "-") for k in given if k != "model"])
        backend = repl.DaemonBackend(client)
    repl.run_chat(backend, params, system=system, prompt=prompt)
