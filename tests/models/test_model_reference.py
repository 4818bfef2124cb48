"""SmolLM2 logits from llmd's own model and paged KV cache equal HF transformers (float32, same GGUF)."""

import gguf
import numpy as np
import torch

from llmd.daemon.core.outputs import ScheduledRequest, SchedulerOutput
from llmd.daemon.core.request import SamplingParams
from llmd.models.llama import unpermute_qk


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49000, (n,), generator=g).tolist()


def schedule_whole(engine, prompts: list[list[int]]) -> SchedulerOutput:
    """One step that prefills every prompt completely (blocks allocated through the KV manager)."""
    out = SchedulerOutput()
    for i, ids in enumerate(prompts):
        rid = f"ref-{i}"
        assert engine.kv_manager.allocate_slots(rid, len(ids)) is not None
        out.scheduled.append(ScheduledRequest(rid, ids, 0, engine.kv_manager.get_block_tables(rid), True, True))
    return out


def test_all_position_logits_match_hf(make_engine, hf_smollm2):
    """Prompts <= 256 tokens, batched into one step: every position's logits within 1e-3."""
    engine = make_engine()
    prompts = [prompt_ids(n, seed=n) for n in (1, 17, 100, 256)]
    out = schedule_whole(engine, prompts)
    input_ids, positions, meta, _ = engine.runner.prepare_inputs(out)
    with torch.inference_mode():
        hidden = engine.runner.model(input_ids, positions, engine.runner.kv_caches, meta)
        logits = engine.runner.model.compute_logits(hidden)
        start = 0
        for ids in prompts:
            ref = hf_smollm2(torch.tensor([ids])).logits[0]
            ours = logits[start : start + len(ids)]
            start += len(ids)
            assert (ours - ref).abs().max().item() < 1e-3, len(ids)


def test_long_prompt_last_position_matches_hf(make_engine, hf_smollm2):
    """~1,000-token prompt, prefilled in chunks of the CPU token budget (256): last logits within 1e-3."""
    engine = make_engine(max_num_batched_tokens=256)
    ids = prompt_ids(1000, seed=7)
    rid = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    outs, steps = [], 0
    while engine.has_unfinished_requests():
        outs += engine.step()
        steps += 1
    assert steps == 4  # 256 + 256 + 256 + 232 tokens
    with torch.inference_mode():
        ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0, -1], -1)
    lp = outs[-1].logprobs[0]
    assert lp.token_id == int(ref.argmax())
    for tok, val in lp.top:
        assert abs(val - ref[tok].item()) < 1e-3
    assert engine.kv_manager.num_used_blocks == 0 and rid not in engine.scheduler.requests


def test_dequantization_exact_on_smollm2(smollm2, smollm2_path):
    """Case L2 (SmolLM2 half): Q4_1, Q8_0 and F32 tensors equal gguf.quants.dequantize bit for bit."""
    model, cfg = smollm2
    params = dict(model.named_parameters())
    tmap = model.gguf_tensor_map()
    seen = set()
    reader = gguf.GGUFReader(smollm2_path)
    for t in reader.tensors:
        if t.tensor_type.name in seen and not t.name.startswith("blk.0."):
            continue  # every type once, plus all of layer 0
        seen.add(t.tensor_type.name)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            ref = unpermute_qk(ref, cfg.num_heads)
        elif t.name.endswith("attn_k.weight"):
            ref = unpermute_qk(ref, cfg.num_kv_heads)
        assert torch.equal(tmap[t.name].of(params), torch.from_numpy(np.array(ref))), t.name
    assert seen == {"Q4_1", "Q8_0", "F32"}


def test_tied_embeddings_and_paris(smollm2, make_engine):
    """Case L1: no output.weight, LM head = token embedding, no NaN parameter; greedy says Paris."""
    model, cfg = smollm2
    assert cfg.tie_word_embeddings and model.lm_head is None
    assert "output.weight" not in model.gguf_tensor_map()
    assert not any(torch.isnan(p).any() for p in model.parameters())
    engine = make_engine()
    [res] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    assert "Paris" in res["text"]
