"""Beam search against HF transformers on SmolLM2, in float64 on both sides: the same K beams
in the same order, token for token (``generate(num_beams=K, do_sample=False,
length_penalty=0.0, early_stopping=...)``; at length_penalty 0 vLLM's and HF's scores agree).
In float32 the llmd/HF logit gap (~1e-3) can swap near-tied beams, hence float64: float64
copies of the session's float32 models (the GGUF weights dequantize exactly in float32)."""

from __future__ import annotations

import copy

import pytest
import torch

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.parallel import child_request_ids
from llmd.daemon.core.request import SamplingParams

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "user", "content": "Name a primary color."}],
    "The quick brown fox",
]
MAX_TOKENS = 8
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine64(smollm2, smollm2_tokenizer):
    model = copy.deepcopy(smollm2[0]).double()
    return Engine(model, smollm2_tokenizer, EngineConfig(device="cpu", dtype="float64", attention_backend="torch",
                                                         kv_cache_memory=64 * 2**20, threads=torch.get_num_threads()))


@pytest.fixture(scope="module")
def hf64(hf_smollm2):
    return copy.deepcopy(hf_smollm2).double().eval()


def llmd_beams(engine: Engine, width: int, early_stopping) -> list[list[list[int]]]:
    """Every prompt's beams, searched at once (one batch), best first."""
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, use_beam_search=True, length_penalty=0.0,
                        early_stopping=early_stopping)
    for i, p in enumerate(PROMPTS):
        engine.add_parallel_request(p, sp, child_request_ids(f"ref{i}", width), parent_id=f"ref{i}")
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] = o.new_token_ids
    assert engine.kv_manager.num_used_blocks == 0  # every beam's blocks are back (cached ones are free)
    return [[got[c] for c in child_request_ids(f"ref{i}", width)] for i in range(len(PROMPTS))]


def hf_beams(hf, ids: list[int], width: int, early_stopping, eos: list[int]) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=width, do_sample=False,
                          length_penalty=0.0, early_stopping=early_stopping, max_new_tokens=MAX_TOKENS,
                          eos_token_id=eos, pad_token_id=eos[0], attention_mask=torch.ones(1, len(ids), dtype=int),
                          repetition_penalty=1.0, temperature=None, top_p=None, top_k=None)
    beams = []
    for row in out.tolist():
        gen = row[len(ids):]
        end = next((k + 1 for k, t in enumerate(gen) if t in eos), len(gen))  # HF pads after the EOS
        beams.append(gen[:end])
    return beams


@pytest.mark.parametrize("width,early_stopping", [(2, True), (4, False)])
def test_beams_equal_hf_token_for_token(engine64, hf64, width, early_stopping):
    eos = sorted(engine64.tokenizer.eos_token_ids)
    ours = llmd_beams(engine64, width, early_stopping)
    ids = [engine64.input_processor.process(p, SamplingParams(max_tokens=MAX_TOKENS)).token_ids for p in PROMPTS]
    theirs = [hf_beams(hf64, i, width, early_stopping, eos) for i in ids]
    assert ours == theirs
    assert any(b[-1] in eos for group in ours for b in group)  # hypotheses that ended with EOS were ranked too
