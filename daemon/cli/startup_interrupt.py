"""A Ctrl-C while ``llmd`` imports click, before any command runs: kept, then one line and exit 130.

The ``llmd`` script's first step after Python's own start is importing click (:mod:`.main`,
~20 ms); a SIGINT there was a ``KeyboardInterrupt`` traceback and a death by SIGINT (exit -2).
:class:`HeldInterrupt` keeps it instead, and ``OneLineUsageErrors.main`` (:mod:`.main`) then ends
the process as a command's own Ctrl-C does: ``llmd: interrupted``, exit 130
(:func:`llmd.daemon.cli.common.one_line_errors`). Imported before click, so stdlib only.
"""

from __future__ import annotations

import signal


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
