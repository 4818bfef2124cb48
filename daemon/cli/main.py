"""``llmd``: the click group (the console script's entry point) and its one-line usage errors.

Commands live one family per module: :mod:`.generate` (generate, kv-size), :mod:`.daemon`
(serve, ps, status, stop), :mod:`.chat`, :mod:`.top`, :mod:`.bench` (``llmd bench ...``);
what they share is in :mod:`.common`. User errors (:class:`LlmdError`) print one line
``llmd: error: ...`` and exit 1, never a traceback.

A command's module is imported when that command runs (click's documented lazy-loading
pattern, :class:`LazyCommands`), so ``llmd kv-size`` or ``llmd serve`` do not import the chat
client, the TUI or the benchmarks first (~0.1 s); ``llmd --help`` imports them all.
"""

from __future__ import annotations

import importlib
import os
import sys

from llmd.daemon.cli.startup_interrupt import HeldInterrupt, exit_interrupted

#: a Ctrl-C while this module imports click (~20 ms of every start) is kept for ``main`` (below)
IMPORTING = HeldInterrupt()
with IMPORTING:
    import click

#: command name → ``module:attribute`` of its click command
COMMANDS = {
    "generate": "llmd.daemon.cli.generate:generate",
    "kv-size": "llmd.daemon.cli.generate:kv_size",
    "bench": "llmd.daemon.cli.bench:bench",
    "serve": "llmd.daemon.cli.daemon:serve",
    "chat": "llmd.daemon.cli.chat:chat",
    "ps": "llmd.daemon.cli.daemon:ps",
    "status": "llmd.daemon.cli.daemon:status",
    "stop": "llmd.daemon.cli.daemon:stop",
    "top": "llmd.daemon.cli.top:top",
}


class LazyCommands(click.Group):
    """A group whose commands (:data:`COMMANDS`) are imported on first use
    (https://click.palletsprojects.com/en/stable/complex/#lazily-loading-subcommands)."""

    def list_commands(self, ctx):
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx, cmd_name):
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            module, attr = COMMANDS[cmd_name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)


class OneLineUsageErrors(LazyCommands):
    """click's usage errors (bad option values, unknown options) as one line
    ``llmd: error: ...`` with click's exit code 2, instead of usage + hint + error.

    A Ctrl-C before a command's body runs (while this module imported click, while click parses
    the arguments or imports the command's module) ends as one in the body does: ``llmd:
    interrupted``, exit 130, no traceback (it was a traceback and exit -2, or ``llmd: aborted``
    and exit 1)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if IMPORTING.take():  # a Ctrl-C while click was imported: act on it now
            if not standalone_mode:
                raise KeyboardInterrupt
            exit_interrupted()
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
        except click.Abort as e:
            if isinstance(e.__cause__, KeyboardInterrupt):  # click's word for a Ctrl-C outside the command
                exit_interrupted()
            click.echo("llmd: aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=OneLineUsageErrors, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """llmd: a local LLM inference daemon (continuous batching over a paged KV cache)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


if __name__ == "__main__":
    main()
