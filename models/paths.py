"""Where llmd keeps its files: one helper for every user of the cache directory.

``$XDG_CACHE_HOME/llmd`` (default ``~/.cache/llmd``) holds the tokenizers built from GGUFs
(``tokenizers/``), assembled split models (``models/``), the auto-started daemon's log
(``daemon.log``) and, without ``$XDG_RUNTIME_DIR``, the daemon's socket. Standard library only.
"""

from __future__ import annotations

import os


def cache_dir(*parts: str) -> str:
    """``$XDG_CACHE_HOME/llmd`` (default ``~/.cache/llmd``), joined with ``parts``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "llmd", *parts)
