"""Claiming a daemon's socket path: the checks and the ``<socket>.lock`` that ``llmd serve`` takes
before anything heavy is imported (:mod:`.lifecycle` imports aiohttp and, through the app, torch:
~2 s in which ``llmd status`` saw neither a lock nor a socket and said "no llmd daemon").

The lock file holds the daemon's pid (one decimal line, written once the lock is won), so a client
that finds the lock held and no socket yet can name the starting process (``llmd status``,
``llmd stop``: :func:`llmd.daemon.client.spawn.starting_pid`). Only os / socket / stat and the
leaf :mod:`llmd.daemon.protocol` are imported here.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.protocol import check_socket_path, default_socket_dir, lock_file, lock_path, unlock_file

log = logging.getLogger("llmd.serve")


def _owner_is_safe(st: os.stat_result) -> bool:
    """Owned by this user or by root (root can replace anything anyway)."""
    return st.st_uid in (os.geteuid(), 0)


def prepare_socket_dir(path: str) -> None:
    """Create the socket's directory 0700 (and tighten the default one to 0700), then check
    that nobody else can replace what the daemon puts there.

    Raises:
        LlmdError: the directory cannot be created, is owned by another user (not root), or
            is group/world-writable without the sticky bit (others could rename or delete the
            socket and lock and put their own in their place; a sticky directory such as
            ``/tmp`` protects them, and :func:`claim_socket` checks their owners).
    """
    d = os.path.dirname(os.path.abspath(path))
    created = not os.path.isdir(d)
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        if created or os.path.abspath(d) == os.path.abspath(default_socket_dir()):
            os.chmod(d, 0o700)
        st = os.stat(d)
    except OSError as e:
        raise LlmdError(f"cannot create the socket directory {d}: {e.strerror}") from None
    if not _owner_is_safe(st):
        raise LlmdError(f"the socket directory {d} belongs to another user (uid {st.st_uid}); "
                        "pick a --socket in a directory of your own")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise LlmdError(f"the socket directory {d} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}, "
                        "not sticky); pick a --socket in a directory only you can write to")


def socket_is_live(path: str, timeout: float = 1.0) -> bool:
    """True if something accepts connections on the Unix socket ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def claim_socket(path: str) -> int:
    """Check the path, take the daemon lock and clear a stale socket file.

    Returns the lock file descriptor (keep it open while serving); the file then holds this
    process's pid.
    Raises:
        LlmdError: path too long, an unsafe directory (:func:`prepare_socket_dir`), a lock file
            or socket of another user (or a symlink as the lock), another daemon holds the lock
            or answers on the path, or the path exists and is not a socket. A refusal once the
            lock is won removes ``<socket>.lock`` (:func:`unlock_file`); a lock another process
            holds, or a lock file of another user, is left alone.
    """
    err = check_socket_path(path)
    if err:
        raise LlmdError(err)
    prepare_socket_dir(path)
    lock = lock_path(path)
    try:
        fd = lock_file(lock, blocking=False, flags=os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise LlmdError(f"another llmd daemon is already running (or starting) on {path}; "
                            f"stop it with `llmd stop --socket {path}`") from None
        raise LlmdError(f"cannot open the lock file {lock}: {e.strerror} (another user's file, or a symlink); "
                        "remove it or pick another --socket") from None
    if not _owner_is_safe(os.fstat(fd)):
        uid = os.fstat(fd).st_uid
        os.close(fd)  # their file: left where it is
        raise LlmdError(f"the lock file {lock} belongs to another user (uid {uid}); pick another --socket")
    try:
        os.ftruncate(fd, 0)  # this pid at once: a crashed daemon's stale pid in a reused lock file would
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # name an unrelated process to a client during the checks
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise LlmdError(f"{path} exists and is not a socket; remove it or pick another --socket")
            if not _owner_is_safe(os.lstat(path)):
                raise LlmdError(f"the socket {path} belongs to another user (uid {os.lstat(path).st_uid}); "
                                "pick another --socket")
            if socket_is_live(path):
                raise LlmdError(f"an llmd daemon is already serving on {path}; "
                                f"stop it with `llmd stop --socket {path}`")
            log.info("removing stale socket %s", path)
            os.unlink(path)
    except BaseException:
        unlock_file(lock, fd)  # refused with the lock held: ours, so no <socket>.lock left behind
        raise
    return fd
