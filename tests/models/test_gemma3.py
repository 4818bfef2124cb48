"""Gemma 3 270M: llmd's model and paged KV cache equal HF transformers (float32, same GGUF).

The model is driven directly (``contiguous_meta`` over a KV cache tensor allocated here), not
through the engine (one end-to-end engine test comes last). Prompts are prefixes of one BOS + 1,499
random-token sequence, so a single
HF forward (over the 1,500 tokens plus the 7 fed-back greedy tokens; causal, so a position's
logits do not depend on later tokens) is the reference for every prompt length.
"""

import gguf
import numpy as np
import pytest
import torch
from gemma_fixtures import GEMMA_GLOBAL_LAYERS, GEMMA_WINDOW, contiguous_meta

from llmd.models.config import ModelConfig, read_config, sliding_layers
from llmd.models.errors import LlmdError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # first test here loads HF's reference
BLOCK = 16
LENGTHS = (100, 500, 511, 512, 513, 700)  # prefilled together in one batch
LONG = 1500  # prefilled in chunks of CHUNK, then DECODE greedy steps
CHUNK = 256
DECODE = 8
TOL = 1e-3


def gemma_ids(n: int, seed: int = 0) -> list[int]:
    """BOS + ``n - 1`` random ordinary-token ids (1,000 ≤ id < 250,000)."""
    g = torch.Generator().manual_seed(seed)
    return [2] + torch.randint(1000, 250_000, (n - 1,), generator=g).tolist()


def new_caches(cfg: ModelConfig, num_blocks: int) -> list[torch.Tensor]:
    """One zeroed float32 ``[2, num_blocks, BLOCK, kv_heads, head_dim]`` cache per layer."""
    return [torch.zeros(2, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]


@pytest.fixture(scope="module")
def ours_batch(gemma3):
    """llmd's logits for the LENGTHS prompts prefilled as one batch: every row of the first,
    the last row of the others (each ``[rows, vocab]`` float32)."""
    model, cfg = gemma3
    ids = gemma_ids(LONG)
    with torch.inference_mode():
        caches = new_caches(cfg, 1 + sum(-(-n // BLOCK) for n in LENGTHS))
        seqs, first = [], 1
        for n in LENGTHS:
            seqs.append((first, 0, n))
            first += -(-n // BLOCK)
        flat = torch.tensor([t for n in LENGTHS for t in ids[:n]])
        hidden = model(flat, torch.cat([torch.arange(n) for n in LENGTHS]), caches, contiguous_meta(seqs, BLOCK))
        ends = np.cumsum(LENGTHS)
        rows = [hidden[: LENGTHS[0]]] + [hidden[e - 1 : e] for e in ends[1:]]
        return [model.compute_logits(r) for r in rows]


@pytest.fixture(scope="module")
def ours_long(gemma3):
    """The LONG prompt prefilled in CHUNK-token steps, then DECODE greedy tokens one at a time
    (per-layer metadata lists). Returns {"ids", "rows": {pos: [vocab]}, "greedy": [DECODE],
    "decode": DECODE - 1 rows [vocab] for positions LONG.., "caches"}."""
    model, cfg = gemma3
    ids = gemma_ids(LONG)
    caches = new_caches(cfg, 1 + -(-(LONG + DECODE) // BLOCK))
    rows, greedy, decode = {}, [], []
    with torch.inference_mode():
        for start in range(0, LONG, CHUNK):
            q = min(CHUNK, LONG - start)
            h = model(torch.tensor(ids[start : start + q]), torch.arange(start, start + q), caches,
                      contiguous_meta([(1, start, q)], BLOCK))
            for p in (*range(510, 515), LONG - 1):
                if start <= p < start + q:
                    rows[p] = model.compute_logits(h[p - start : p - start + 1])[0]
        greedy.append(int(rows[LONG - 1].argmax()))
        for pos in range(LONG, LONG + DECODE - 1):
            meta = contiguous_meta([(1, pos, 1)], BLOCK)
            h = model(torch.tensor(greedy[-1:]), torch.tensor([pos]), caches, [meta] * cfg.num_layers)
            decode.append(model.compute_logits(h)[0])
            greedy.append(int(decode[-1].argmax()))
    return {"ids": ids, "rows": rows, "greedy": greedy, "decode": decode, "caches": caches}


@pytest.fixture(scope="module")
def reference(hf_gemma3, ours_long):
    """HF logits at every position we check: {pos: [vocab] float32}, one forward over ids + greedy[:-1]."""
    seq = ours_long["ids"] + ours_long["greedy"][:-1]
    wanted = sorted({*range(LENGTHS[0]), *(n - 1 for n in LENGTHS), *range(510, 515), *range(LONG - 1, len(seq))})
    with torch.inference_mode():
        hidden = hf_gemma3.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
        logits = hf_gemma3.lm_head(hidden[wanted]).float()
    return dict(zip(wanted, logits))


def test_windows_and_rope_bases_per_layer(gemma3, gemma3_reader):
    """Case W1: window 512 on local layers, None on 5/11/17; RoPE 10,000 local, freq_base global."""
    model, cfg = gemma3
    freq_base = gemma3_reader.fields["gemma3.rope.freq_base"].contents()
    assert freq_base == 1e6
    want = [None if i in GEMMA_GLOBAL_LAYERS else GEMMA_WINDOW for i in range(cfg.num_layers)]
    assert list(cfg.sliding_window) == want == [layer.self_attn.sliding_window for layer in model.layers]
    thetas = [layer.self_attn.rope_theta for layer in model.layers]
    assert thetas == list(cfg.rope_thetas) == [freq_base if w is None else 10000.0 for w in want]
    assert cfg.softmax_scale == 256**-0.5 and cfg.embedding_scale == 640**0.5 and cfg.tie_word_embeddings


class Field:
    """A stand-in for a ``gguf.ReaderField``: just ``contents()``."""

    def __init__(self, name, value):
        self.name, self.value = name, value

    def contents(self):
        return self.value


def test_metadata_keys_override_gemma_defaults():
    """sliding_window_pattern (int or per-layer bools) and rope.freq_base_swa win over defaults."""
    assert sliding_layers(6, 12) == [i not in (5, 11) for i in range(12)]
    assert sliding_layers(None, 3) == [True] * 3 and sliding_layers(0, 2) == [True, True]
    fields = {"general.architecture": "gemma3", "gemma3.block_count": 4, "gemma3.embedding_length": 64,
              "gemma3.attention.head_count": 2, "gemma3.feed_forward_length": 128, "gemma3.vocab_size": 10,
              "gemma3.attention.sliding_window": 8, "gemma3.rope.freq_base": 5e5}

    class Reader:
        def __init__(self, **extra):
            self.fields = {k: Field(k, v) for k, v in {**fields, **extra}.items()}
            self.tensors = []

    cfg = read_config(Reader())
    assert cfg.sliding_window == (8, 8, 8, 8) and cfg.rope_thetas == (1e4,) * 4  # 4 layers: no 6th
    cfg = read_config(Reader(**{"gemma3.attention.sliding_window_pattern": 2, "gemma3.rope.freq_base_swa": 2e4,
                                "gemma3.attention.scale": 0.5}))
    assert cfg.sliding_window == (8, None, 8, None) and cfg.rope_thetas == (2e4, 5e5, 2e4, 5e5)
    assert cfg.softmax_scale == 0.5
    cfg = read_config(Reader(**{"gemma3.attention.sliding_window_pattern": [False, True, True, False]}))
    assert cfg.sliding_window == (None, 8, 8, None)


def test_dequantization_exact_on_gemma3(gemma3, gemma3_reader):
    """Case L2 (Gemma half): every tensor type equals gguf.quants.dequantize bit for bit, norms as stored.

    Layer 0 and 5 (global) in full, then the first tensor of any type not seen yet. Tensor bytes
    come from ``gguf.GGUFReader`` (llmd's ``open_gguf``, the session's ``gemma3_reader``); the
    dequantization is ``gguf``'s own.
    """
    model, _ = gemma3
    params, tmap = dict(model.named_parameters()), model.gguf_tensor_map()
    tensors = gemma3_reader.tensors
    picked = [t for t in tensors if t.name.startswith(("blk.0.", "blk.5.")) or t.name == "output_norm.weight"]
    seen = {t.tensor_type.name for t in picked}
    for t in tensors:
        if t.tensor_type.name not in seen:
            picked.append(t)
            seen.add(t.tensor_type.name)
    for t in picked:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        assert torch.equal(tmap[t.name].of(params), torch.from_numpy(np.array(ref))), t.name
    assert seen == {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}


def test_tokenizer_and_no_chat_template(gemma3_tokenizer):
    """BOS + SentencePiece ids from the GGUF vocabulary; --chat on this base model: one-line error."""
    tok = gemma3_tokenizer
    ids = tok.encode("The capital of France is the city of")
    assert ids == [2, 818, 5279, 529, 7001, 563, 506, 3207, 529]
    assert tok.decode(ids) == "The capital of France is the city of" and tok.eos_token_ids == {1}
    with pytest.raises(LlmdError, match="no chat template") as e:
        tok.apply_chat([{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value)


def test_hf_reference_layout_matches_llmd(hf_gemma3, gemma3):
    """HF's config (from the same GGUF) has the same local/global layers and RoPE bases as llmd's."""
    c, cfg = hf_gemma3.config, gemma3[1]
    assert [None if t == "full_attention" else c.sliding_window for t in c.layer_types] == list(cfg.sliding_window)
    assert [c.rope_parameters[t]["rope_theta"] for t in c.layer_types] == list(cfg.rope_thetas)
    assert c.query_pre_attn_scalar**-0.5 == cfg.softmax_scale and c.rms_norm_eps == cfg.rms_norm_eps


def test_per_layer_meta_list_equals_shared_meta(gemma3, ours_long):
    """Decode with one shared AttentionMetadata gives the same logits as the per-layer list did."""
    model, cfg = gemma3
    pos = LONG + DECODE - 2  # rewrite the last decode step (same token, same slot, same K/V)
    with torch.inference_mode():
        h = model(torch.tensor([ours_long["greedy"][-2]]), torch.tensor([pos]), ours_long["caches"],
                  contiguous_meta([(1, pos, 1)], BLOCK))
        assert torch.equal(model.compute_logits(h)[0], ours_long["decode"][-1])


def test_full_sequence_logits_100_tokens(ours_batch, reference):
    """Every position of a 100-token prompt (batched with the others) within 1e-3 of HF."""
    ref = torch.stack([reference[p] for p in range(LENGTHS[0])])
    assert (ours_batch[0] - ref).abs().max().item() < TOL


@pytest.mark.parametrize("i", range(1, len(LENGTHS)))
def test_last_position_logits(ours_batch, reference, i):
    """Last position of 500/511/512/513/700-token prompts (window 512 straddled) within 1e-3."""
    n = LENGTHS[i]
    assert (ours_batch[i][0] - reference[n - 1]).abs().max().item() < TOL, n


def test_long_prompt_window_edges_and_last_position(ours_long, reference):
    """1,500 tokens prefilled in chunks of 256: positions 510-514 and 1,499 within 1e-3."""
    for p, row in ours_long["rows"].items():
        assert (row - reference[p]).abs().max().item() < TOL, p


def test_decode_greedy_tokens_match_hf(ours_long, reference):
    """8 greedy tokens decoded one at a time through the paged cache equal HF's argmax."""
    hf_greedy = [int(reference[LONG - 1 + k].argmax()) for k in range(DECODE)]
    assert ours_long["greedy"] == hf_greedy
    for k, row in enumerate(ours_long["decode"]):
        assert (row - reference[LONG + k]).abs().max().item() < TOL, k


def test_engine_completes_paris(make_gemma_engine, gemma3_tokenizer):
    """End to end through the engine (scheduler, KV manager, runner): greedy continuation names Paris."""
    from llmd.daemon.core.request import SamplingParams

    engine = make_gemma_engine()
    ids = gemma3_tokenizer.encode("The capital of France is the city of")
    engine.add_request(ids, SamplingParams(max_tokens=3, temperature=0))
    text = ""
    while engine.has_unfinished_requests():
        text += "".join(o.new_text for o in engine.step())
    assert text.startswith(" Paris"), text
