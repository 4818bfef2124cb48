"""``llmd``: the click group (the console script's entry point) and its one-line usage errors.

Commands live one family per module: :mod:`.generate` (generate, kv-size), :mod:`.daemon`
(serve, ps, status, stop), :mod:`.chat`, :mod:`.top`, :mod:`.bench` (``llmd bench ...``);
what they share is in :mod:`.common`. User errors (:class:`LlmdError`) print one line
``llmd: error: ...`` and exit 1, never a traceback.
"""

from __future__ import annotations

import os
import sys

import click

from llmd.daemon.cli.bench import bench
from llmd.daemon.cli.chat import chat
from llmd.daemon.cli.daemon import ps, serve, status, stop
from llmd.daemon.cli.generate import generate, kv_size
from llmd.daemon.cli.top import top


class OneLineUsageErrors(click.Group):
    """click's usage errors (bad option values, unknown options) as one line
    ``llmd: error: ...`` with click's exit code 2, instead of usage + hint + error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as e:
            ctx = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            click.echo(f"llmd: error: {e.format_message()}{ctx}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("llmd: aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=OneLineUsageErrors, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """llmd: a local LLM inference daemon (continuous batching over a paged KV cache)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


for command in (generate, kv_size, bench, serve, chat, ps, status, stop, top):
    main.add_command(command)

if __name__ == "__main__":
    main()
