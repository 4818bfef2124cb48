"""The llmd error family, in one place (a leaf: no torch).

Every error a user can cause derives from :class:`LlmdError`, whose ``str()`` is a complete
one-line message: the CLI prints ``llmd: error: <message>`` and exits 1, the HTTP API answers
4xx with it. Model-loading errors live in :mod:`llmd.models.errors` (models never import the
daemon) and are re-exported here.

Errors about a request carry the request field they are about (``param``), so the HTTP
layer never guesses it from the message text:

* :class:`RequestError` (400): the engine refuses a request; ``param`` is ``"prompt"`` (the
  endpoint's prompt field: ``prompt``, or ``messages`` for chat), ``"max_tokens"``, ``"n"``, a
  sampling field, or None (nothing the client sent: also reported as the prompt field);
* :class:`ServerBusyError` (429 + ``Retry-After``): the engine cannot take more work now;
  :class:`QueueFullError` is the scheduler's (the waiting queue is at ``max_num_waiting``).

:class:`RequestError` is also a ``ValueError`` (sampling ranges, scheduler admission), so
callers that only know "a bad value" keep working.
"""

from __future__ import annotations

from llmd.models.errors import GGUFLoadError, LlmdError, ModelNotFoundError

__all__ = ["GGUFLoadError", "LlmdError", "ModelNotFoundError", "QueueFullError", "RequestError", "ServerBusyError"]


class RequestError(LlmdError, ValueError):
    """The engine refuses a request; ``param`` names the request field at fault (or None)."""

    status = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def with_hint(self, hint: str) -> "RequestError":
        """The same error (class and field) with ``hint`` appended to its message."""
        return type(self)(str(self) + hint, self.param)


class ServerBusyError(RequestError):
    """The engine cannot take the request now; retry after ``retry_after`` seconds (HTTP 429)."""

    status = 429
    retry_after = 1


class QueueFullError(ServerBusyError):
    """The waiting queue is at ``max_num_waiting``; the caller should retry later."""


def require_at_least_one(**flags: int | None) -> None:
    """The CLI's rule for counts (``--block-size``, ``--max-num-seqs``, ...): raises
    :class:`LlmdError` ``--block-size must be >= 1, got 0`` for the first of ``flags`` (option
    name in snake case → value) below 1; None (not given) passes."""
    for name, value in flags.items():
        if value is not None and value < 1:
            raise LlmdError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
