"""Wire-level facts shared by the daemon, its clients and ``tui/`` (no torch, no aiohttp; a leaf).

* where the socket, its lock files and an auto-started daemon's log live
  (:func:`default_socket_path`, :func:`check_socket_path`, :func:`lock_path`,
  :func:`spawn_lock_path`, :func:`default_log_path`);
* the OpenAI-style error body (:func:`error_body`) and the draining daemon's 503 code
  (:data:`DRAINING_CODE`);
* Server-Sent Events framing (:func:`sse`, :data:`SSE_DONE`);
* the ``GET /v1/stats`` schema, versioned by :data:`STATS_SCHEMA_VERSION` (bump it on any
  incompatible change; clients such as ``llmd ps`` / ``llmd top`` check it), and the compact
  block map (run-length encoded, or aggregated to a requested number of cells, so a
  100k-block pool never ships 100k entries per poll).

``/v1/stats`` (schema 1) is a JSON object::

    schema_version  int (1)
    model           served model id;  kv_cache_dtype  str;  uptime_s  float (seconds)
    runtime         str: the engine's dtype, attention backend and kernels, threads and how the
                    linears are packed (the startup line's; added later in schema 1, so a
                    client reads it with a default)
    kv_cache        {block_size, num_blocks (incl. null block 0), total (usable), used,
                     cached_free (unused blocks still holding cached KV, evictable), free
                     (unused, no cached KV; used + cached_free + free == total), usage (0..1,
                     used / total), bytes_per_token (all layers, scales included),
                     memory_bytes (the pool: num_blocks x bytes per block),
                     groups: [{name, sliding_window (tokens or null), layers, total (shared
                               pool), used (blocks this group's tables hold), free, usage}]}
    block_map       {encoding: "rle", runs: [[state, count], ...]} over block ids 0..N-1,
                    states "null" / "free" / "cached" (free, evictable) / "used"; with ``?cells=K`` instead
                    {encoding: "cells", cells: [used fraction of each of K equal ranges]}
    prefix_cache    {queries, hits (tokens), enabled (bool), evictions (blocks)}
    scheduler       {running, waiting, preempted, context_shifts (cumulative; added later in schema 1)}
    throughput      {prompt_tokens_per_s, generation_tokens_per_s}  (over the last ~5 s)
    counters        {prompt_tokens, generation_tokens, requests_finished: {stop, length, abort, error},
                     requests_rejected, num_preemptions}
    requests        [{id, state ("waiting"/"running"), prompt_tokens, cached_tokens,
                      generated_tokens, blocks (all groups), block_table (group 0),
                      block_tables (per group; 0 = null block), priority, ttft_s (null before the first
                      token), age_s, preemptions}]
"""

from __future__ import annotations

import json
import os

from llmd.models.paths import cache_dir

STATS_SCHEMA_VERSION = 1
SOCKET_NAME = "llmd.sock"
# sun_path is 108 bytes on Linux (104 on macOS/BSD), including the terminating NUL.
MAX_UNIX_PATH_BYTES = 107
SSE_DONE = b"data: [DONE]\n\n"


def default_socket_dir() -> str:
    """``$XDG_RUNTIME_DIR/llmd`` when that variable is set, else llmd's cache directory
    (``$XDG_CACHE_HOME/llmd``, default ``~/.cache/llmd``)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "llmd")
    return cache_dir()


def default_socket_path() -> str:
    """``LLMD_SOCKET`` if set, else ``<default_socket_dir()>/llmd.sock``."""
    return os.environ.get("LLMD_SOCKET") or os.path.join(default_socket_dir(), SOCKET_NAME)


def default_log_path() -> str:
    """The log of a daemon a client starts in the background: ``$XDG_CACHE_HOME/llmd/daemon.log``
    (default ``~/.cache/llmd/daemon.log``)."""
    return cache_dir("daemon.log")


def lock_path(socket_path: str) -> str:
    """The daemon's lock file, ``<socket>.lock``: ``flock``-ed from before the daemon loads its
    model until its process exits (a second daemon on the path is refused while it is held)."""
    return socket_path + ".lock"


def spawn_lock_path(socket_path: str) -> str:
    """``<socket>.spawn.lock``: held by a client while it starts a daemon on the path."""
    return socket_path + ".spawn.lock"


def lock_file(path: str, blocking: bool = True, flags: int = 0) -> int:
    """Open ``path`` (created 0600; ``flags`` added to ``os.open``'s, e.g. ``O_NOFOLLOW``) and
    ``flock`` it exclusively; returns the descriptor. Lock files are removed by their holder
    before it lets go (:func:`unlock_file`), so a lock won on a file that is no longer at
    ``path`` (its holder unlinked it meanwhile) is dropped and taken again on the new file.

    Raises:
        OSError: ``open`` fails, or ``EAGAIN``/``EACCES`` when ``blocking`` is False and
            another process holds the lock.
    """
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                return fd
        except FileNotFoundError:
            pass  # unlinked by its previous holder: take the lock on a new file
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def unlock_file(path: str, fd: int) -> None:
    """Remove the lock file ``path`` held through ``fd`` (:func:`lock_file`), then release it."""
    try:
        if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
            os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)


def check_socket_path(path: str) -> str | None:
    """Return an error message if ``path`` cannot be an AF_UNIX socket path, else None."""
    n = len(os.fsencode(path))
    if n > MAX_UNIX_PATH_BYTES:
        return (f"socket path is {n} bytes, over the AF_UNIX limit of {MAX_UNIX_PATH_BYTES}: {path} "
                "(pick a shorter --socket, $LLMD_SOCKET or $XDG_RUNTIME_DIR)")
    return None


DRAINING_CODE = "shutting_down"
"""The error body's ``code`` of the 503 a draining daemon gives new generation requests (clients
such as ``llmd chat`` wait for it to exit and reconnect on it, not on the message's wording)."""


def fmt_bytes(n) -> str:
    """A byte count for people: ``536870912`` → ``512 MiB``, ``409600`` → ``400 KiB``, ``1.5 GiB``,
    ``2**50`` → ``1 PiB``; not a number → ``-``."""
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return "-"  # pragma: no cover


def error_type(status: int) -> str:
    """The error body's ``type`` for an HTTP ``status``, in OpenAI's lowercase style:
    ``authentication_error`` (401), ``rate_limit_error`` (429: the waiting queue is full),
    ``server_error`` (any 5xx: a failed request, loading, draining, a dead engine, the
    connection cap), ``invalid_request_error`` (every other 4xx). OpenAI's SDKs pick their
    exception class from the status (``RateLimitError``, ``InternalServerError``), not this."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error", code: int = 400) -> dict:
    """OpenAI-style error object: ``{"error": {"message", "type", "param", "code"}}`` (``type_``:
    :func:`error_type` of the status; ``code``: the status, or OpenAI's string code)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(obj: dict) -> bytes:
    """One Server-Sent Event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


# ---- block map ----------------------------------------------------------------------
def rle(states: list[str]) -> list[list]:
    """Run-length encode per-block states: ``["null","free","free"]`` → ``[["null",1],["free",2]]``."""
    runs: list[list] = []
    for s in states:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return runs


def rle_to_cells(runs: list[list], cells: int) -> list[float]:
    """Aggregate a run-length block map into ``cells`` equal ranges of block ids.

    Each cell is the fraction (0..1) of its blocks that are "used" (the null block counts as
    not used). ``cells`` is clamped to [1, number of blocks]. Cost O(runs + cells).
    """
    total = sum(n for _, n in runs)
    cells = max(1, min(cells, total)) if total else 0
    out = [0.0] * cells
    if not cells:
        return out
    # cell c covers [c*total/cells, (c+1)*total/cells)
    bounds = [(c * total) // cells for c in range(cells + 1)]
    used = [0] * cells
    pos, c = 0, 0
    for state, n in runs:
        start, end = pos, pos + n
        pos = end
        if state != "used":
            continue
        while c < cells and bounds[c + 1] <= start:
            c += 1
        k = c
        while k < cells and bounds[k] < end:
            used[k] += min(end, bounds[k + 1]) - max(start, bounds[k])
            k += 1
    return [used[k] / max(1, bounds[k + 1] - bounds[k]) for k in range(cells)]


def stats_with_cells(stats: dict, cells: int | None) -> dict:
    """A copy of a stats snapshot whose block map is aggregated to ``cells`` (None: keep RLE)."""
    if cells is None:
        return stats
    out = dict(stats)
    out["block_map"] = {"encoding": "cells", "cells": rle_to_cells(stats["block_map"]["runs"], cells)}
    return out


def check_stats_schema(stats: dict) -> None:
    """Raise ``ValueError`` when a stats payload is of a schema version this client does not know."""
    v = stats.get("schema_version")
    if v != STATS_SCHEMA_VERSION:
        raise ValueError(f"daemon stats schema {v!r}, this client understands {STATS_SCHEMA_VERSION}; upgrade llmd")
