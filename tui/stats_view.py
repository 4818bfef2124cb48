"""Reading ``/v1/stats`` payloads defensively and formatting them (pure Python, no Textual).

Every accessor takes a default: a field missing from the daemon's payload (an older or newer
daemon, a feature not landed yet) renders as "-" and never raises.
"""

from __future__ import annotations

from llmd.daemon.protocol import STATS_SCHEMA_VERSION, fmt_bytes  # noqa: F401 (fmt_bytes: this module's name too)

_MISSING = object()


def get(d, *path, default=None):
    """``d[path[0]][path[1]]...`` or ``default`` when any step is missing or not a dict/list."""
    cur = d
    for key in path:
        if isinstance(cur, dict) and key in cur:
            cur = cur[key]
        elif isinstance(cur, list) and isinstance(key, int) and -len(cur) <= key < len(cur):
            cur = cur[key]
        else:
            return default
    return default if cur is None else cur


def num(d, *path, default: float = 0.0) -> float:
    """A numeric field as float, ``default`` when missing or not a number."""
    v = get(d, *path, default=_MISSING)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def version_problem(stats) -> str | None:
    """A message when ``stats`` is not a stats payload of the schema this dashboard reads."""
    if not isinstance(stats, dict):
        return "the daemon answered /v1/stats with something that is not a JSON object"
    v = stats.get("schema_version")
    if v != STATS_SCHEMA_VERSION:
        return (f"the daemon speaks stats schema {v!r}, this llmd top reads {STATS_SCHEMA_VERSION}: "
                "upgrade llmd or the daemon so they match (retrying)")
    return None


def fmt_duration(s) -> str:
    """Seconds → ``42s``, ``3m05s``, ``2h03m``, ``1d02h``; None → ``-``."""
    if not isinstance(s, (int, float)) or s < 0:
        return "-"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_rate(x) -> str:
    """Hit rate fraction → ``42.0%``; None → ``n/a``."""
    return "n/a" if x is None else f"{100 * x:.1f}%"


def groups(stats) -> list[dict]:
    """The KV cache groups (always at least one: the whole pool when the payload has none)."""
    gs = get(stats, "kv_cache", "groups", default=[])
    gs = [g for g in gs if isinstance(g, dict)] if isinstance(gs, list) else []
    if gs:
        return gs
    return [{"name": "kv", **{k: get(stats, "kv_cache", k) for k in ("total", "used", "usage")}}]


def windows_text(stats) -> str:
    """Attention windows per group: ``full``, ``1 full + 5 × 512`` (or names when sizes are unknown);
    ``-`` (not shown) without a ``kv_cache`` in ``stats`` (no daemon yet: nothing is known)."""
    if not isinstance(get(stats, "kv_cache"), dict):
        return "-"
    full, windowed = 0, {}
    for g in groups(stats):
        w = g.get("sliding_window", g.get("window"))
        if isinstance(w, int) and w > 0:
            windowed[w] = windowed.get(w, 0) + 1
        elif "sliding" in str(g.get("name", "")):
            windowed["?"] = windowed.get("?", 0) + 1
        else:
            full += 1
    parts = ([f"{full} full" if windowed else "full"] if full else [])
    parts += [f"{n} × {w}" for w, n in windowed.items()]
    return " + ".join(parts) or "-"


def header_fields(stats) -> list[tuple[str, str]]:
    """``(label, value)`` pairs for the header: model, KV dtype, block size, windows, memory, uptime."""
    kv = get(stats, "kv_cache", default={})
    bpt = get(kv, "bytes_per_token")
    bpt = bpt if isinstance(bpt, (int, float)) else None
    mem = get(kv, "memory_bytes")
    if mem is None and isinstance(bpt, (int, float)):
        mem = bpt * num(kv, "num_blocks") * num(kv, "block_size")
    fields = [
        ("model", str(get(stats, "model", default="-"))),
        ("KV", str(get(stats, "kv_cache_dtype", default="-"))),
        ("block", str(get(kv, "block_size", default="-"))),
        ("windows", windows_text(stats)),
        ("KV mem", fmt_bytes(mem)),
        ("B/tok", f"{bpt:,}" if isinstance(bpt, (int, float)) else "-"),
        ("up", fmt_duration(get(stats, "uptime_s"))),
    ]
    return [(k, v) for k, v in fields if v != "-" or k in ("model", "up")]  # omit what the daemon does not send


# ---- request table ------------------------------------------------------------------
# (key, header, width); sorting uses the raw values of request_rows().
COLUMNS = [("id", "ID", 11), ("state", "STATE", 7), ("prompt", "PROMPT", 6), ("cached", "CACHED", 6),
           ("gen", "GEN", 5), ("blocks", "BLOCKS", 6), ("ttft", "TTFT", 6), ("tps", "TOK/S", 6),
           ("preempt", "PRE", 3)]


def request_rows(stats) -> list[dict]:
    """One dict per live request with the table's column keys (None where unknown)."""
    rows = []
    reqs = get(stats, "requests", default=[])
    for r in reqs if isinstance(reqs, list) else []:
        if not isinstance(r, dict) or r.get("id") is None:
            continue
        def number(key):
            v = r.get(key)
            return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        ttft, age, gen = number("ttft_s"), number("age_s"), number("generated_tokens")
        tps = None
        if ttft is not None and age is not None and gen is not None and gen > 1 and age > ttft:
            tps = (gen - 1) / (age - ttft)  # decode rate after the first token
        state = r.get("state")
        rows.append({"id": str(r["id"]), "state": None if state is None else str(state),
                     "prompt": number("prompt_tokens"), "cached": number("cached_tokens"), "gen": gen,
                     "blocks": number("blocks"), "ttft": ttft, "tps": tps, "preempt": number("preemptions")})
    return rows


def sort_rows(rows: list[dict], key: str, reverse: bool = False) -> list[dict]:
    """Rows sorted by column ``key``; unknown values (None) last in either direction."""
    known = [r for r in rows if r.get(key) is not None]
    unknown = [r for r in rows if r.get(key) is None]
    try:
        known.sort(key=lambda r: (r[key], r["id"]), reverse=reverse)
    except TypeError:  # mixed types: compare as text
        known.sort(key=lambda r: (str(r[key]), r["id"]), reverse=reverse)
    return known + unknown


def cell_text(key: str, value, width: int) -> str:
    """A table cell: numbers right-aligned, times in seconds, ids shortened to ``width``."""
    if value is None:
        return "-".rjust(width) if key not in ("id", "state") else "-"
    if key == "ttft":
        return f"{value:.2f}".rjust(width)
    if key == "tps":
        return f"{value:.1f}".rjust(width)
    if key == "id":
        return short_id(value, width)
    if isinstance(value, (int, float)):
        return f"{value:,}".rjust(width)
    return str(value)[:width]


def short_id(rid: str, width: int = 12) -> str:
    """``cmpl-88f49793f8c24bce…-0`` → ``88f4979…-0``: no ``cmpl-``/``chatcmpl-`` prefix, index kept."""
    for prefix in ("chatcmpl-", "cmpl-"):
        if rid.startswith(prefix):
            rid = rid[len(prefix):]
            break
    if len(rid) <= width:
        return rid
    head, sep, tail = rid.rpartition("-")
    if sep and tail.isdigit() and len(tail) + 3 <= width:
        return head[: width - len(tail) - 2] + "…-" + tail
    return rid[: width - 1] + "…"
