"""Errors with one-line, user-facing messages: the base class and the model-loading errors.

Every error a user can cause (a missing model, a bad GGUF, a prompt that is too long)
derives from :class:`LlmdError`; the CLI prints ``str(err)`` on one line and exits 1,
the HTTP server answers 4xx with it. The engine's request errors (with the field they name)
live in ``llmd.daemon.core.errors``, which re-exports these.
"""


class LlmdError(Exception):
    """Base class for user-facing llmd errors; ``str()`` is a complete one-line message."""


class ModelNotFoundError(LlmdError):
    """The model name or path does not resolve to a GGUF file (message carries an install hint)."""


class GGUFLoadError(LlmdError):
    """The GGUF file is unreadable, of an unsupported architecture, or its tensors do not map."""


class NoChatTemplateError(LlmdError):
    """Chat messages were given to a model whose GGUF has no chat template (a base model); the
    caller words what to do instead (the HTTP API: a 400 naming ``messages``)."""
