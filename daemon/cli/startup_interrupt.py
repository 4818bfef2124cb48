"""A Ctrl-C while ``llmd`` imports click, before any command runs: kept, then one line and exit 130.

The ``llmd`` script's first step after Python's own start is importing click (:mod:`.main`,
~20 ms); a SIGINT there was a ``KeyboardInterrupt`` traceback and a death by SIGINT (exit -2).
:class:`HeldInterrupt` keeps it instead, and ``OneLineUsageErrors.main`` (:mod:`.main`) then ends
the process as a command's own Ctrl-C does (:func:`llmd.daemon.cli.common.one_line_errors`):
:func:`exit_interrupted`, ``llmd: interrupted``, exit 130. Imported before click, so stdlib only.
"""

from __future__ import annotations

import signal
import sys
from typing import NoReturn

#: ``llmd: interrupted`` exits with this (128 + SIGINT, as a shell reports a Ctrl-C)
INTERRUPTED_EXIT = 130


def exit_interrupted() -> NoReturn:
    """End ``llmd`` after a Ctrl-C: one line ``llmd: interrupted`` on stderr, exit 130 (a
    command's body, click's argument parsing, the import of click; no traceback)."""
    if sys.stderr is not None:  # as click.echo, which writes nowhere without a stderr
        sys.stderr.write("llmd: interrupted\n")
        sys.stderr.flush()
    sys.exit(INTERRUPTED_EXIT)


class HeldInterrupt:
    """Inside ``with``, a SIGINT is kept instead of raised; :meth:`take` says whether one came.

    Only where SIGINT has Python's default handler and this is the main thread: otherwise (a
    parent that ignored SIGINT, an embedding program's own handler, another thread) nothing
    changes. On leaving, Python's default handler is back.
    """

    def __init__(self) -> None:
        self.kept = False
        self._held = False

    def _keep(self, signum, frame) -> None:
        self.kept = True

    def __enter__(self) -> "HeldInterrupt":
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            try:
                signal.signal(signal.SIGINT, self._keep)
                self._held = True
            except ValueError:  # not the main thread: signal.signal refuses
                pass
        return self

    def __exit__(self, *exc) -> None:
        if self._held:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._held = False

    def take(self) -> bool:
        """Whether a SIGINT was kept since the last call (then forgotten)."""
        kept, self.kept = self.kept, False
        return kept
