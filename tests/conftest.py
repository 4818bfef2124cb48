"""Shared fixtures: the real SmolLM2 model, its tokenizer and the HF reference load once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# `python -m pytest` puts the repo root on sys.path, where the repo's `kernels/` folder would
# shadow the optional HF hub package `kernels` that transformers probes for; pytest puts this
# folder (tests/) there to import this file, where tests/kernels/ and tests/models/ would do the
# same. llmd is imported from its installed `llmd.*` namespace, never from the bare folders; test
# helpers come from tests/fixtures/ (pytest's ``pythonpath``).
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() not in (REPO, REPO / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# engines and daemons in tests load cold (as before the cache) and never write the converted-weights
# cache in ~/.cache/llmd, whose few entries would be evicted by tiny test GGUFs; tests/models/
# test_weights_cache.py turns it on with its own cache dir, and the real-model subprocesses share a
# cache of the session's own (daemon_harness.SESSION_WEIGHTS_CACHE). LLMD_WEIGHTS_CACHE=1 pytest ... opts in.
os.environ.setdefault("LLMD_WEIGHTS_CACHE", "0")
# a fixed thread count: exact-token comparisons must not depend on what else the machine runs
# (the adaptive threads are tested on their own, tests/core/test_thread_governor.py)
os.environ.setdefault("LLMD_ADAPTIVE_THREADS", "0")

import torch  # noqa: E402

from llmd.daemon.core.config import EngineConfig  # noqa: E402
from llmd.daemon.core.engine import Engine  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from llmd.models.registry import resolve_model

    return resolve_model("smollm2-135m")  # raises with the install hint if the package is missing


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_path):
    """The GGUF's ``gguf.GGUFReader`` from llmd's ``open_gguf``, parsed once (~2-3 s) and kept for
    the session (tests/fixtures/gguf_readers.py: a later ``open_gguf`` would parse it again)."""
    from llmd.models.gguf_loader import open_gguf

    return open_gguf(smollm2_path)


@pytest.fixture(scope="session")
def smollm2(smollm2_path, smollm2_reader):
    """(model, config) of SmolLM2-135M-Instruct in float32, loaded once (the loader's
    ``open_gguf`` finds the reader ``smollm2_reader`` has just parsed)."""
    from llmd.models.gguf_loader import load_model

    return load_model(smollm2_path, torch.float32, "cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path, smollm2, smollm2_reader, tmp_path_factory):
    from llmd.models.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path, smollm2[1], smollm2_reader.data_offset)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path, smollm2_reader):
    """HF transformers' own float32 model from the same GGUF (the reference). transformers parses
    the GGUF twice (config, then weights); it gets the session's parsed reader instead (the same
    ``gguf.GGUFReader`` of the same file, read-only use: tests/fixtures/gguf_readers.py)."""
    from gguf_readers import shared_gguf_readers
    from transformers import AutoModelForCausalLM

    with shared_gguf_readers((smollm2_path, smollm2_reader)):
        m = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32
        )
    return m.eval()


@pytest.fixture(scope="session")
def make_engine(smollm2, smollm2_tokenizer):
    """Build an Engine from the already-loaded SmolLM2 (pool and scheduler sizes vary per test)."""

    def make(**kw) -> Engine:
        kw.setdefault("kv_cache_memory", 64 * 2**20)
        kw.setdefault("threads", torch.get_num_threads())  # keep the test's own thread setting
        return Engine(smollm2[0], smollm2_tokenizer, EngineConfig(device="cpu", dtype="float32", **kw))

    return make


# Real daemons in subprocesses (session-scoped; see tests/fixtures/daemon_harness.py). The helper
# modules of tests/fixtures/ are importable by name (pytest's ``pythonpath`` in pyproject.toml).
from daemon_harness import llmd_daemon, llmd_daemons, llmd_small_daemon  # noqa: E402,F401
from gemma_fixtures import (  # noqa: E402,F401
    gemma3,
    gemma3_path,
    gemma3_reader,
    gemma3_tokenizer,
    hf_gemma3,
    make_gemma_engine,
)
