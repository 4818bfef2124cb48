"""Converted-weights cache: a loaded model's tensors in a memory-mapped safetensors file.

A cold load dequantizes every GGUF tensor and, with ``--weight-quant``, packs the linears
(tens of seconds on 2 cores). The result (every parameter and buffer, the packs of each
:class:`~llmd.quant.packed_linear.PackedLinear` included) is written once in the ``safetensors``
format, every tensor 64-byte aligned (:func:`save_aligned`), to
``$XDG_CACHE_HOME/llmd/weights/<digest>.safetensors`` (0600 in the 0700 llmd cache; temporary
file + rename, atomic). A warm load builds the model skeleton on the
``meta`` device, rebuilds the packed modules from the metadata, and assigns the tensors of
``safetensors.torch.load_file`` (a private memory map: nothing is read until used, pages are
shared with the page cache). Tensors that share memory (a tied head's dense copy and the
embedding table) are stored once and shared again.

The digest covers the GGUF identity (sha256 of its metadata header, size, mtime in ns), the
dtype, ``weight_quant``, ``keep_dense``, torch's version (the int4 pack layout is torch's) and
a digest of the conversion code's sources (:func:`source_digest`), so any change selects
another entry. An entry is used only if its stored key matches and the crc32 of its
data bytes matches the one it records; every parameter and buffer of the skeleton must be
filled and none left on ``meta``; else it is deleted and the model rebuilt from the GGUF
(:func:`load_cached` returns None). At most :data:`MAX_ENTRIES` entries are kept (least
recently used go). ``LLMD_WEIGHTS_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import struct
import tempfile
import zlib

import torch
from safetensors.torch import load_file
from torch import nn

from llmd.models.paths import cache_dir as default_cache_dir
from llmd.models.paths import ensure_cache_dir
from llmd.quant.bnb_linear import BnbLinear
from llmd.quant.packed_linear import PackedLinear

log = logging.getLogger("llmd.weights_cache")
FORMAT = 2  # bump when the entry layout changes (2: every tensor 64-byte aligned, save_aligned)
ALIGN = 64  # bytes: torch's CPU allocator's alignment, which its weight-only kernels assume
PAD_PREFIX = "__pad__."
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                       torch.float8_e5m2: "F8_E5M2"}
MAX_ENTRIES = 4  # SmolLM2: ~350 MiB per bfloat16 entry with --weight-quant auto
_MODELS = os.path.dirname(os.path.abspath(__file__))
_QUANT = os.path.join(os.path.dirname(_MODELS), "quant")
#: the conversion code the key covers: llmd.models but the modules no converted tensor depends on
#: (this one's entry layout is :data:`FORMAT`), and the weight packs of llmd.quant (not its KV formats)
_NOT_CONVERSION = ("assemble.py", "errors.py", "paths.py", "presets.py", "tokenizer.py", "fast_tokenizer.py",
                   "chat_template.py", "weights_cache.py", "__init__.py")
_QUANT_SOURCES = ("gguf_packs.py", "packed_linear.py", "bnb_linear.py", "native_packs.py", "int8_groups.py")


def enabled() -> bool:
    """False when ``$LLMD_WEIGHTS_CACHE`` is ``0`` (or ``off``/``no``/``false``)."""
    return os.environ.get("LLMD_WEIGHTS_CACHE", "1").lower() not in ("0", "off", "no", "false")


def source_digest() -> str:
    """sha256 of the conversion code's sources: the ``.py`` files of ``llmd.models`` but
    :data:`_NOT_CONVERSION`, and :data:`_QUANT_SOURCES` of ``llmd.quant``."""
    files = [p for p in sorted(glob.glob(os.path.join(_MODELS, "*.py"))) if os.path.basename(p) not in _NOT_CONVERSION]
    files += [os.path.join(_QUANT, name) for name in _QUANT_SOURCES]
    h = hashlib.sha256()
    for p in files:
        with open(p, "rb") as f:
            h.update(os.path.basename(p).encode() + f.read())
    return h.hexdigest()[:16]


def cache_key(path: str, data_offset: int, dtype: torch.dtype, weight_quant: str, keep_dense: bool) -> str:
    """The entry key (see the module docstring); ``data_offset``: the GGUF's header bytes."""
    from llmd.models.tokenizer import gguf_identity

    st = os.stat(path)
    return (f"v{FORMAT}|{gguf_identity(path, data_offset)}|{st.st_mtime_ns}|{dtype}|{weight_quant}|"
            f"keep_dense={bool(keep_dense)}|torch{torch.__version__}|src{source_digest()}")


def entry_path(key: str, cache_dir: str | None = None) -> str:
    """File of the entry for ``key`` (``cache_dir`` overrides the cache root, for tests)."""
    root = os.path.join(cache_dir, "weights") if cache_dir else default_cache_dir("weights")
    return os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:32] + ".safetensors")


def _data_crc32(path: str) -> tuple[str | None, int]:
    """(the metadata's ``key``, crc32 of the bytes after the safetensors header) of a file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        crc = 0
        while block := f.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return header.get("__metadata__", {}), crc


def store(model: nn.Module, key: str, cache_dir: str | None = None) -> str | None:
    """Write ``model`` (on the CPU, after :func:`~llmd.models.weight_quant.quantize_linears`)
    as the entry of ``key``; returns its path, or None when the cache cannot be written (a full
    or read-only disk is not an error: the next start converts again)."""
    tensors, aliases, seen = {}, {}, {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if ident in seen:
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        tensors[name] = t.detach().contiguous()
    spec = {
        "packed": [{"name": n, "in": m.in_features, "out": m.out_features, "kind": m.kind, "sizes": m.sizes,
                    "small_batch": m.small_batch, "dense": m.dense is not None, "native": m.native_kind}
                   for n, m in model.named_modules() if isinstance(m, PackedLinear)],
        "bnb": [{"name": n, **m.spec()} for n, m in model.named_modules() if isinstance(m, BnbLinear)],
        "lm_head_none": model.lm_head is None,
        "aliases": aliases,
        "summary": dataclasses.asdict(model.weight_quant_summary),
    }
    target = entry_path(key, cache_dir)
    root = os.path.dirname(target)
    try:
        ensure_cache_dir("weights") if cache_dir is None else os.makedirs(root, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-", suffix=".safetensors")  # 0600
        os.close(fd)
    except OSError as e:
        log.warning("weights cache not written (%s)", e)
        return None
    try:
        save_aligned(tensors, tmp, metadata={"key": key, "spec": json.dumps(spec)})
        _, crc = _data_crc32(tmp)
        with os.fdopen(os.open(tmp + ".crc", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(str(crc))
        os.replace(tmp + ".crc", target + ".crc")
        os.replace(tmp, target)
    except OSError as e:
        log.warning("weights cache not written (%s)", e)
        for p in (tmp, tmp + ".crc"):
            _unlink(p)
        return None
    _prune(root)
    return target


def save_aligned(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """Write a safetensors file (the format: 8-byte little-endian header length, JSON header,
    then the data without holes) in which every tensor starts :data:`ALIGN` bytes aligned in the
    file, hence in its memory map: the header is padded with spaces (as ``safetensors`` itself
    pads it) and each gap is a ``uint8`` pad tensor named ``__pad__.<i>``, which
    :func:`load_cached` drops. ``safetensors.torch.save_file`` packs tensors back to back
    after a header of any length, so most start off a 64-byte boundary, which torch's weight-only
    CPU kernels cannot read in place (see :func:`aligned`). Tensors sharing memory are written
    each in full (the format forbids shared storage, not equal bytes)."""
    header: dict = {"__metadata__": metadata}
    layout: list = []
    offset = 0
    for i, (name, t) in enumerate(tensors.items()):
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + data.numel()]}
        layout.append(data)
        offset += data.numel()
        pad = -offset % ALIGN
        if pad:
            header[f"{PAD_PREFIX}{i}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
            layout.append(bytes(pad))
            offset += pad
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in layout:
            f.write(data if isinstance(data, bytes) else memoryview(data.numpy()))


def _unlink(path: str) -> None:
    """Remove ``path``; one already gone (another process pruned it) or unremovable is no error."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:  # removed meanwhile by another process
        return 0.0


def _prune(root: str) -> None:
    """Keep the :data:`MAX_ENTRIES` most recently used entries of ``root``."""
    entries = sorted(glob.glob(os.path.join(root, "*.safetensors")), key=_mtime, reverse=True)
    for old in entries[MAX_ENTRIES:]:
        discard(old)


def discard(path: str) -> None:
    """Delete an entry (and its crc file)."""
    for p in (path, path + ".crc"):
        _unlink(p)


def load_cached(cls, cfg, dtype: torch.dtype, key: str, cache_dir: str | None = None):
    """The model of class ``cls`` for ``cfg`` from the entry of ``key``, or None (no entry, or a
    stale or corrupt one, which is deleted). The model is on the CPU with ``weight_quant_summary``."""
    from llmd.models.weight_quant import WeightQuantSummary

    path = entry_path(key, cache_dir)
    if not os.path.isfile(path):
        return None
    try:
        with open(path + ".crc") as f:
            want = int(f.read())
        meta, crc = _data_crc32(path)
        if meta.get("key") != key or crc != want:
            raise ValueError("key or crc32 mismatch")
        spec = json.loads(meta["spec"])
        tensors = {k: t for k, t in load_file(path).items() if not k.startswith(PAD_PREFIX)}
        for name, canonical in spec["aliases"].items():
            tensors[name] = tensors[canonical]
        with torch.device("meta"):
            model = cls(cfg, dtype)
        for p in spec["packed"]:
            packs = (aligned(tensors.pop(f"{p['name']}.packed")), aligned(tensors.pop(f"{p['name']}.scales")))
            dense = tensors.pop(f"{p['name']}.dense") if p["dense"] else None
            native = None
            if p.get("native"):
                roles = [r for r in ("native_codes", "native_scales", "native_mins") if f"{p['name']}.{r}" in tensors]
                native = p["native"], tuple(aligned(tensors.pop(f"{p['name']}.{r}")) for r in roles)
            mod = PackedLinear(p["in"], p["out"], **{p["kind"]: packs}, dense=dense, small_batch=p["small_batch"],
                               sizes=p["sizes"], native=native)
            parent, _, leaf = p["name"].rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, mod)
        for p in spec.get("bnb", []):  # bitsandbytes layers (--weight-quant nf4 / fp4, CUDA int8)
            mod = BnbLinear.from_spec(p, aligned(tensors.pop(f"{p['name']}.packed")),
                                      aligned(tensors.pop(f"{p['name']}.scales")))
            parent, _, leaf = p["name"].rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, mod)
        if spec["lm_head_none"]:
            model.lm_head = None
        for name, t in tensors.items():
            _assign(model, name, t)
        _check_filled(model)
        model.weight_quant_summary = WeightQuantSummary(**spec["summary"])
    except Exception as e:  # any failure means the entry cannot be trusted: rebuild from the GGUF
        log.warning("weights cache entry %s discarded (%s: %s); converting the GGUF again", path,
                    type(e).__name__, e)
        discard(path)
        return None
    try:
        os.utime(path)  # most recently used (pruning keeps it)
    except OSError:
        pass
    return model


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it on a 64-byte boundary (torch's allocator's alignment) when the
    mapped file put it elsewhere: torch's weight-only CPU kernels use aligned vector loads, and
    ``_weight_int8pack_mm`` over 4 rows took a general protection fault on a packed head mapped
    at an address ≡ 40 (mod 64) (torch 2.13, SmolLM2's warm load: any step with 4 logits rows,
    e.g. 4 streams decoding, killed the daemon)."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


def _assign(model: nn.Module, name: str, t: torch.Tensor) -> None:
    """Put ``t`` at parameter or buffer ``name``. Raises KeyError when ``name`` is neither."""
    parent, _, leaf = name.rpartition(".")
    mod = model.get_submodule(parent) if parent else model
    if leaf in mod._parameters:
        mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    elif leaf in mod._buffers:
        mod._buffers[leaf] = t
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer of the model")


def _check_filled(model: nn.Module) -> None:
    """Raise ValueError when a parameter, buffer or tensor attribute is still on ``meta``."""
    for mod_name, mod in model.named_modules():
        for attr, v in {**mod._parameters, **mod._buffers, **vars(mod)}.items():
            if isinstance(v, torch.Tensor) and v.is_meta:
                raise ValueError(f"{mod_name}.{attr} was not in the entry")
