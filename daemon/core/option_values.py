"""Option values parsed from text: byte sizes (``--kv-cache-memory``, ``--memory``, ``--total-memory``)
and ``--kv-scales``. Torch-free, so ``llmd kv-size`` parses its options without importing torch."""

from __future__ import annotations

import math

from llmd.daemon.core.errors import LlmdError


def parse_kv_scales(text: str) -> tuple[float, float]:
    """Parse ``--kv-scales k,v`` (e.g. ``0.05,0.1``). Raises LlmdError."""
    try:
        k, v = (float(x) for x in text.split(","))
    except ValueError:
        raise LlmdError(f"--kv-scales takes two numbers k,v (e.g. 0.05,0.1), got {text!r}") from None
    return k, v


MAX_BYTES = 2**50  # 1 PiB: above any machine's memory; a larger --memory is a typo


def parse_bytes(text: str) -> int:
    """Parse a byte size such as ``536870912``, ``512MiB``, ``2GiB``, ``300MB``, ``1TiB``, ``1PiB``
    (an integer literal exactly; at most :data:`MAX_BYTES`). Raises LlmdError."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("kmgtpib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise LlmdError(f"cannot parse byte size {text!r} (try 512MiB or 2GiB)") from None
    if unit not in units:
        raise LlmdError(f"cannot parse byte size {text!r} (try 512MiB or 2GiB)")
    if not math.isfinite(value):  # inf, nan, 1e400: int() raised OverflowError / ValueError
        raise LlmdError(f"byte size must be a finite number, got {text!r}")
    if value <= 0:
        raise LlmdError(f"byte size must be > 0, got {text!r}")
    if value * units[unit] < 1:  # 0.5 was 0 B
        raise LlmdError(f"byte size must be at least 1 B, got {text!r}")
    if value * units[unit] > MAX_BYTES:  # 1e23 printed as 99999999999999991611392 B, columns run together
        raise LlmdError(f"byte size must be at most 1 PiB, got {text!r}")
    return int(num) * units[unit] if num.isdigit() else int(value * units[unit])
