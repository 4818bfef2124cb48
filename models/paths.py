"""Where llmd keeps its files: one helper for every user of the cache directory.

``$XDG_CACHE_HOME/llmd`` (default ``~/.cache/llmd``) holds the tokenizers built from GGUFs
(``tokenizers/``), assembled split models (``models/``), parsed GGUF headers (``headers/``,
:mod:`llmd.models.header_cache`), converted weights (``weights/``,
:mod:`llmd.models.weights_cache`), the auto-started daemon's log
(``daemon.log``) and, without ``$XDG_RUNTIME_DIR``, the daemon's socket; it is created 0700
(:func:`ensure_cache_dir`). Standard library only.
"""

from __future__ import annotations

import os


def cache_dir(*parts: str) -> str:
    """``$XDG_CACHE_HOME/llmd`` (default ``~/.cache/llmd``), joined with ``parts``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "llmd", *parts)


def ensure_cache_dir(*parts: str) -> str:
    """:func:`cache_dir` ``(*parts)`` created as a directory, returned. The ``llmd`` directory
    and each of ``parts`` are created 0700 (they hold the daemon's log, and its socket without
    ``$XDG_RUNTIME_DIR``), and an ``llmd`` directory of this user's that others can read is
    tightened to 0700.

    Raises:
        OSError: a directory cannot be created.
    """
    root = cache_dir()
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.stat(root)
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.chmod(root, 0o700)
    path = root
    for part in parts:
        path = os.path.join(path, part)
        os.makedirs(path, mode=0o700, exist_ok=True)
    return path
