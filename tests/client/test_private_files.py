"""Files llmd creates for its user only: the cache directory 0700 (``models.paths.ensure_cache_dir``)
and the auto-started daemon's log 0600 (``spawn.ensure_daemon``, with a stand-in ``llmd serve``
that exits at once, so no model loads)."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from llmd.daemon.client import spawn
from llmd.daemon.core.errors import LlmdError
from llmd.models.paths import ensure_cache_dir


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_cache_dir_is_created_0700_and_tightened(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    old = os.umask(0o022)
    try:
        assert ensure_cache_dir("tokenizers") == str(tmp_path / "cache" / "llmd" / "tokenizers")
        assert mode(tmp_path / "cache" / "llmd") == mode(tmp_path / "cache" / "llmd" / "tokenizers") == 0o700
        os.chmod(tmp_path / "cache" / "llmd", 0o755)  # a cache made by an older llmd
        ensure_cache_dir()
        assert mode(tmp_path / "cache" / "llmd") == 0o700
    finally:
        os.umask(old)


def test_daemon_log_is_created_0600_in_a_0700_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(spawn, "SERVE_COMMAND", [sys.executable, "-c", "import sys; print('bye'); sys.exit(3)"])
    old = os.umask(0o022)
    try:
        with pytest.raises(LlmdError, match="exited with code 3"):
            spawn.ensure_daemon(str(tmp_path / "s.sock"), [], timeout=30, echo=lambda m, nl=True: None)
        log = tmp_path / "cache" / "llmd" / "daemon.log"
        assert "bye" in log.read_text()
        assert mode(log) == 0o600 and mode(log.parent) == 0o700
        os.chmod(log, 0o644)  # an older, readable log is tightened when appended to
        with pytest.raises(LlmdError):
            spawn.ensure_daemon(str(tmp_path / "s.sock"), [], timeout=30, echo=lambda m, nl=True: None)
        assert mode(log) == 0o600
    finally:
        os.umask(old)
