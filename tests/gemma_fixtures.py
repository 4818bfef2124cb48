"""Gemma 3 270M fixtures (re-exported by conftest.py) and a helper to drive a model directly.

Session scope: one llmd load (``gemma3``: float32, CPU, ~20 s), one tokenizer, one HF
transformers reference from the same GGUF (``hf_gemma3``: float32, eager attention, ~80 s:
``gguf.GGUFReader`` parses the 262k-entry vocabulary slowly). ``contiguous_meta`` builds
:class:`AttentionMetadata` over a plain KV cache tensor, so model tests do not depend on the
engine's scheduler / runner.
"""

from __future__ import annotations

import os

import pytest
import torch

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.kernels import AttentionMetadata

GEMMA_WINDOW = 512
GEMMA_GLOBAL_LAYERS = (5, 11, 17)


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """Path of the assembled Gemma 3 270M GGUF (raises with the pip hint if the package is missing)."""
    from llmd.models.registry import resolve_model

    return resolve_model("gemma3-270m")


@pytest.fixture(scope="session")
def gemma3(gemma3_path):
    """(model, config) of Gemma 3 270M in float32 on CPU, loaded once."""
    from llmd.models.gguf_loader import load_model

    return load_model(gemma3_path, torch.float32, "cpu")


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_path, gemma3):
    from llmd.models.gguf_loader import open_gguf
    from llmd.models.tokenizer import load_tokenizer

    return load_tokenizer(gemma3_path, gemma3[1], open_gguf(gemma3_path).data_offset)


@pytest.fixture(scope="session")
def hf_gemma3(gemma3_path):
    """HF transformers' ``Gemma3ForCausalLM`` in float32 from the same GGUF (the reference).

    transformers (checked on 5.24) maps ``gemma3.attention.sliding_window`` to
    ``sliding_window=512`` and, for the keys this GGUF lacks, uses ``Gemma3TextConfig``'s
    defaults: every 6th layer ``full_attention``, local RoPE base 10,000, global base from
    ``rope.freq_base``, ``query_pre_attn_scalar=256``. Its GGUF loader subtracts 1 from every
    ``*norm.weight`` and ``Gemma3RMSNorm`` adds it back, so both sides use the stored value.
    Nothing needed fixing; the asserts below fail loudly if a transformers release changes that.
    transformers parses the GGUF header twice (config, then weights) with ``gguf.GGUFReader``
    (~40 s each here); the reader is memoized for the duration of the load (read-only use).
    """
    import gguf
    from transformers import AutoModelForCausalLM

    readers, reader_cls = {}, gguf.GGUFReader

    def memo_reader(path, *args, **kw):
        key = (os.fspath(path), args, tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = reader_cls(path, *args, **kw)
        return readers[key]

    gguf.GGUFReader = memo_reader
    try:
        m = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gemma3_path), gguf_file=os.path.basename(gemma3_path), dtype=torch.float32,
            attn_implementation="eager",
        ).eval()
    finally:
        gguf.GGUFReader = reader_cls
    c = m.config
    assert c.sliding_window == GEMMA_WINDOW
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == list(GEMMA_GLOBAL_LAYERS)
    assert c.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert c.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert c.final_logit_softcapping is None and c.attn_logit_softcapping is None
    return m


@pytest.fixture(scope="session")
def make_gemma_engine(gemma3, gemma3_tokenizer):
    """Build an Engine from the already-loaded Gemma 3 (pool and scheduler sizes vary per test)."""

    def make(**kw) -> Engine:
        kw.setdefault("kv_cache_memory", 64 * 2**20)
        kw.setdefault("threads", torch.get_num_threads())  # keep the test's own thread setting
        return Engine(gemma3[0], gemma3_tokenizer, EngineConfig(device="cpu", dtype="float32", **kw))

    return make


def contiguous_meta(seqs: list[tuple[int, int, int]], block_size: int, backend: str = "torch") -> AttentionMetadata:
    """Metadata for one step over sequences whose KV blocks are contiguous in the cache.

    Args:
        seqs: per sequence ``(first_block, num_cached, query_len)``: its blocks are
            ``first_block, first_block + 1, ...``; this step computes positions
            ``num_cached .. num_cached + query_len - 1``.
        block_size: tokens per block.
    Returns:
        AttentionMetadata with int64 slot mapping ``[T]``, int32 block tables ``[B, max_blocks]``
        (padded with the null block 0), query_start_loc ``[B + 1]`` and seq_lens ``[B]``.
    """
    slots, tables, qlens, lens = [], [], [], []
    for first, cached, q in seqs:
        total = cached + q
        slots.append(torch.arange(cached, total) + first * block_size)
        tables.append(list(range(first, first + -(-total // block_size))))
        qlens.append(q)
        lens.append(total)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return AttentionMetadata(torch.cat(slots).long(), block_tables, qsl, torch.tensor(lens, dtype=torch.int32),
                             qlens, lens, block_size, backend)
