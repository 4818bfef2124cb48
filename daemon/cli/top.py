"""``llmd top``: the live dashboard of a running daemon (the Textual app lives in ``tui/``).

Textual is imported only when the command runs, so other commands start as fast as before.
It needs a terminal: with stdout not a TTY (a pipe, a file) it refuses in one line instead of
drawing escape codes into the file and retrying forever.
"""

from __future__ import annotations

import sys

import click

from llmd.daemon.cli.common import one_line_errors, socket_option, socket_path_of
from llmd.daemon.core.errors import LlmdError


@click.command()
@socket_option
@click.option("--interval", default=1.0, show_default=True, type=float, help="Seconds between stats polls.")
@one_line_errors
def top(socket_path, interval):
    """Live dashboard: KV block map, prefix-cache hit rate, throughput, requests (q quits)."""
    from llmd.daemon.client.client import Client

    # a path over the AF_UNIX limit: one line (the client checks it)
    client = Client(socket_path_of(socket_path), timeout=max(5.0, 3 * interval))
    if not 0.05 <= interval <= 3600:
        raise LlmdError(f"--interval must be in [0.05, 3600] seconds, got {interval:g}")
    if not sys.stdout.isatty():
        raise LlmdError("llmd top needs a terminal (stdout is not a TTY); use `llmd status` or `llmd ps` for text")
    from llmd.tui.app import TopApp

    TopApp(client, interval=interval).run()
