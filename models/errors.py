"""Errors with one-line, user-facing messages.

Every error a user can cause (a missing model, a bad GGUF, a prompt that is too long)
derives from :class:`LlmdError`; the CLI prints ``str(err)`` on one line and exits 1,
the HTTP server answers 4xx with it.
"""


class LlmdError(Exception):
    """Base class for user-facing llmd errors; ``str()`` is a complete one-line message."""


class ModelNotFoundError(LlmdError):
    """The model name or path does not resolve to a GGUF file (message carries an install hint)."""


class GGUFLoadError(LlmdError):
    """The GGUF file is unreadable, of an unsupported architecture, or its tensors do not map."""


class ServerBusyError(LlmdError):
    """The engine's waiting queue is full; retry after ``retry_after`` seconds (HTTP 429)."""

    retry_after = 1
