"""The daemon's own output (``llmd serve``'s lines and log) when nobody reads it any more.

``llmd serve 2>&1 | head -1``: once the pipe's reader has gone, the next write raises
BrokenPipeError, and the daemon died of it (exit 1) at its next line. A daemon keeps serving:
a write that fails because the reader has gone (:data:`GONE`: BrokenPipeError, ECONNRESET)
points that stream's file descriptor at ``os.devnull`` (every later write there, the log's and
the interpreter's last flush included, succeeds and is dropped) and goes on. Other write errors
(a full disk under ``daemon.log``) are not a reader that left: the line raises as before, and a
log record gets logging's own error report, so the stream is kept for the lines after.
"""

from __future__ import annotations

import logging
import os
import sys

import click

GONE = (BrokenPipeError, ConnectionResetError)  # the stream's reader has gone for good


def drop_stream(stream) -> None:
    """Point ``stream``'s file descriptor at ``os.devnull`` (nothing to do for a stream without
    one, such as a test's in-memory buffer)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def echo_err(message: str) -> None:
    """``click.echo(message, err=True)``, or nothing once stderr's reader has gone (see the module)."""
    try:
        click.echo(message, err=True)
    except GONE:
        drop_stream(sys.stderr)


class DaemonLogHandler(logging.StreamHandler):
    """A log handler on stderr whose failed write (the reader has gone) drops the stream instead
    of printing logging's "--- Logging error ---" report (to that same stream) at every record."""

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], GONE):
            drop_stream(self.stream)
        else:
            super().handleError(record)
