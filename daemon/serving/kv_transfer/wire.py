"""The pull's binary format: one :class:`~llmd.daemon.core.kv_transfer.KVPayload` as bytes.

Layout (all sizes little-endian)::

    b"LLMDKV1\\n"                      8 bytes, the magic (format version 1)
    u32 header_len                   then header_len bytes of UTF-8 JSON:
        {"num_prompt_tokens", "token_digest", "fingerprint", "ranges",
         "tensors": [{"group", "kind": "data" | "scales", "dtype", "shape", "nbytes"}, ...]}
    the tensors' raw bytes, in the header's order (C-contiguous, native little-endian)

No pickling: the reader builds tensors only from a dtype on :data:`DTYPES` and a shape whose
byte count matches ``nbytes``, and refuses a header announcing more than ``max_bytes`` in all
before reading any tensor (a consumer's bound: its context times its bytes per token).
"""

from __future__ import annotations

import json
import struct

import torch

from llmd.daemon.core.kv_transfer import KVPayload

MAGIC = b"LLMDKV1\n"
MAX_HEADER_BYTES = 1 << 20
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                   torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)}


class WireError(ValueError):
    """Bytes that are not a well-formed payload (or announce more than allowed)."""


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def encode(payload: KVPayload) -> tuple[bytes, list[memoryview]]:
    """``(prefix, bodies)``: the magic, length and header, then one buffer per tensor (no copy
    of the tensor data; write them in order). Total size: ``len(prefix) + sum(map(len, bodies))``."""
    tensors, bodies = [], []
    for g, (data, scales) in enumerate(zip(payload.data, payload.scales)):
        for kind, t in (("data", data), ("scales", scales)):
            if t is None:
                continue
            body = _bytes_of(t)
            tensors.append({"group": g, "kind": kind, "dtype": str(t.dtype).removeprefix("torch."),
                            "shape": list(t.shape), "nbytes": len(body)})
            bodies.append(body)
    header = json.dumps({"num_prompt_tokens": payload.num_prompt_tokens, "token_digest": payload.token_digest,
                         "fingerprint": payload.fingerprint, "ranges": [list(r) for r in payload.ranges],
                         "tensors": tensors}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header, bodies


PREFIX_BYTES = len(MAGIC) + 4


def header_length(prefix: bytes) -> int:
    """The JSON header's length from the payload's first :data:`PREFIX_BYTES` bytes (magic and
    length); read that many more and pass them to :func:`check_header`. Raises :class:`WireError`."""
    if len(prefix) != PREFIX_BYTES or not prefix.startswith(MAGIC):
        raise WireError("not an llmd KV payload (bad magic)")
    (n,) = struct.unpack("<I", prefix[len(MAGIC):])
    if n > MAX_HEADER_BYTES:
        raise WireError(f"header of {n} bytes exceeds {MAX_HEADER_BYTES}")
    return n


def check_header(raw: bytes, max_bytes: int) -> dict:
    """Decode and check the JSON header. Raises :class:`WireError`: bad JSON, a field missing,
    an unknown dtype, a shape whose size differs from ``nbytes``, more than ``max_bytes`` in all."""
    try:
        h = json.loads(raw)
        total = 0
        for t in h["tensors"]:
            dtype = DTYPES.get(t["dtype"])
            if dtype is None:
                raise WireError(f"unknown dtype {t['dtype']!r}")
            n = dtype.itemsize
            for d in t["shape"]:
                if not isinstance(d, int) or d < 0:
                    raise WireError(f"bad shape {t['shape']!r}")
                n *= d
            if n != t["nbytes"] or t["kind"] not in ("data", "scales"):
                raise WireError(f"tensor {t['kind']!r} of group {t['group']}: shape {t['shape']} is not "
                                f"{t['nbytes']} bytes")
            total += n
        if total > max_bytes:
            raise WireError(f"payload of {total} bytes exceeds this consumer's bound of {max_bytes}")
        int(h["num_prompt_tokens"]), str(h["token_digest"]), dict(h["fingerprint"])
        [(int(a), int(b)) for a, b in h["ranges"]]
    except WireError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise WireError(f"malformed payload header: {type(e).__name__}: {e}") from None
    return h


def build(header: dict, bodies: list[bytearray]) -> KVPayload:
    """The :class:`KVPayload` of a checked header and its tensors' bytes (one buffer each).
    Raises :class:`WireError` when the tensors do not pair up with the groups."""
    ranges = [(int(a), int(b)) for a, b in header["ranges"]]
    data: list = [None] * len(ranges)
    scales: list = [None] * len(ranges)
    for t, body in zip(header["tensors"], bodies):
        g = t["group"]
        if not isinstance(g, int) or not 0 <= g < len(ranges):
            raise WireError(f"tensor of group {g!r} but {len(ranges)} groups")
        dtype = DTYPES[t["dtype"]]
        tensor = torch.frombuffer(body, dtype=torch.uint8).view(dtype).reshape(t["shape"]) if len(body) else \
            torch.empty(t["shape"], dtype=dtype)
        (data if t["kind"] == "data" else scales)[g] = tensor
    if any(d is None for d in data):
        raise WireError("a group has no data tensor")
    return KVPayload(int(header["num_prompt_tokens"]), str(header["token_digest"]), dict(header["fingerprint"]),
                     ranges, data, scales)
