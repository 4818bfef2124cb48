"""A GGUF file's :class:`ModelConfig`, tensor infos and data offset, cached per file identity.

:mod:`llmd.models.gguf_header` reads them in 10 ms for SmolLM2 but ~0.3 s for Gemma 3 (its
262k vocabulary strings are walked to find where the tensor infos start), so the result is
kept as JSON under ``$XDG_CACHE_HOME/llmd/headers/`` (0600 files in the 0700 llmd cache),
named by a digest of (real path, mtime in ns, size in bytes, :data:`FORMAT`). The entry
repeats that key inside and is used only when it matches; a changed, unreadable or foreign
entry is rebuilt from the file. Written to a temporary file and renamed (atomic). Standard
library only (no torch, numpy or gguf: ``llmd kv-size`` imports nothing else).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from typing import NamedTuple

from llmd.models.config import ModelConfig, read_config
from llmd.models.errors import GGUFLoadError
from llmd.models.gguf_header import HeaderTensor, read_header
from llmd.models.paths import cache_dir as default_cache_dir
from llmd.models.paths import ensure_cache_dir

FORMAT = 1  # bump when the entry's layout or read_config's meaning changes
_TUPLES = ("sliding_window", "rope_thetas", "eos_token_ids")  # JSON lists back to tuples


class HeaderInfo(NamedTuple):
    """What the metadata users need from a GGUF header: its config, tensor infos (with
    ``name``, ``shape``, ``tensor_type``, ``offset``: :class:`HeaderTensor`) and ``data_offset``
    (bytes before the tensor data, ``GGUFReader.data_offset``)."""

    config: ModelConfig
    tensors: list[HeaderTensor]
    data_offset: int


def _key(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.realpath(path)}|{st.st_mtime_ns}|{st.st_size}|{FORMAT}"


def _decode(entry: dict) -> HeaderInfo:
    cfg = dict(entry["config"])
    for name in _TUPLES:
        cfg[name] = tuple(cfg[name])
    tensors = [HeaderTensor(n, tuple(s), t, o) for n, s, t, o in entry["tensors"]]
    return HeaderInfo(ModelConfig(**cfg), tensors, int(entry["data_offset"]))


def header_info(path: str, cache_dir: str | None = None) -> HeaderInfo:
    """The :class:`HeaderInfo` of the GGUF at ``path``, from the cache when its entry matches.

    Args:
        path: GGUF file; cache_dir: cache root override (tests; default the llmd cache dir).
    Raises:
        GGUFLoadError: missing or unreadable GGUF, or a required metadata key missing.
    """
    if not os.path.isfile(path):
        raise GGUFLoadError(f"model file not found: {path}")
    key = _key(path)
    root = os.path.join(cache_dir, "headers") if cache_dir else default_cache_dir("headers")
    entry_path = os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
    try:
        with open(entry_path) as f:
            entry = json.load(f)
        if entry.get("key") == key:
            return _decode(entry)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no entry, or an unreadable one: rebuilt below
    header = read_header(path)
    info = HeaderInfo(read_config(header, name=os.path.splitext(os.path.basename(path))[0]), header.tensors,
                      header.data_offset)
    entry = {"key": key, "config": dataclasses.asdict(info.config), "tensors": [list(t) for t in info.tensors],
             "data_offset": info.data_offset}
    _write(root, entry_path, entry, cache_dir is None)
    return info


def _write(root: str, entry_path: str, entry: dict, default_root: bool) -> None:
    """Write ``entry`` atomically; a read-only or racing cache is not an error (the next start
    reads the file again)."""
    try:
        if default_root:
            ensure_cache_dir("headers")  # 0700, as the whole llmd cache
        else:
            os.makedirs(root, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-", suffix=".json")  # mkstemp: 0600
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, entry_path)
    except OSError:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_config(path: str, cache_dir: str | None = None) -> ModelConfig:
    """Only the :class:`ModelConfig` of a GGUF (see :func:`header_info`). Raises GGUFLoadError."""
    return header_info(path, cache_dir).config


def model_config(model: str, cache_dir: str | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a ``--model`` value without loading weights: a ``random:``
    preset's (:mod:`llmd.models.presets`), else its GGUF header's (:func:`load_config`, cached).
    Torch-free. Raises LlmdError: an unknown model or preset, an unreadable GGUF."""
    from llmd.models.presets import is_random_model, preset_config

    if is_random_model(model):
        return preset_config(model)
    from llmd.models.registry import resolve_model

    return load_config(resolve_model(model), cache_dir)
