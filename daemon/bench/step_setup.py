"""The decode step ``llmd bench step`` times and the KV state under it, built without the
scheduler or the KV manager (their state is untouched).

* :func:`decode_step`: a :class:`~llmd.daemon.core.outputs.SchedulerOutput` of ``batch`` greedy
  decodes with ``context`` tokens cached each, and its :class:`~llmd.daemon.core.request.Request` s;
  each sequence's block ids are drawn without replacement from a seeded shuffle of the pool
  (block 0, the null block, excluded), as a pool after some churn; blocks a sliding window no
  longer sees are the null block (:func:`first_kept`).
* :func:`blocks_needed`: the pool's blocks for such a step over all KV cache groups;
  :func:`engine_for`: an engine over a loaded model whose pool holds them (``kv_cache_memory`` in
  bytes, from :func:`llmd.daemon.core.kv_size.kv_cache_block_bytes`), its cache filled by
  :func:`fill_kv` with uniform random K/V (codes in [-2, 2] for int8/fp8, scales in [0.01, 0.1]),
  so every read touches real memory (never the kernel's zero page).
* :func:`kv_read_bytes`: the K/V bytes (scales included) such a step must read: every layer's
  ``context + 1`` tokens, or its sliding window, × the engine's bytes per token and layer.

Errors: whatever :class:`~llmd.daemon.core.engine.Engine` raises for the sized configuration.
Every name is re-exported by :mod:`llmd.daemon.bench.step`.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.outputs import ScheduledRequest, SchedulerOutput
from llmd.daemon.core.request import Request, SamplingParams


def first_kept(group, context: int, block_size: int) -> int:
    """Index of the first block a decoding sequence at position ``context`` still holds in
    ``group`` (0 for full attention; a sliding window frees the blocks it no longer sees)."""
    return 0 if group.sliding_window is None else max(0, (context - group.sliding_window + 1) // block_size)


def blocks_needed(groups, block_size: int, batch: int, context: int) -> int:
    """Blocks of ``batch`` decoding sequences of ``context + 1`` tokens over all groups, + the null block."""
    n = -(-(context + 1) // block_size)
    return batch * sum(n - first_kept(g, context, block_size) for g in groups) + 1


def decode_step(engine, batch: int, context: int, seed: int = 0) -> tuple[SchedulerOutput, list[Request]]:
    """A step of ``batch`` greedy decodes with ``context`` tokens cached each, and its requests."""
    rng = random.Random(seed)
    pool = list(range(1, engine.num_blocks))
    rng.shuffle(pool)
    ids = iter(pool)
    vocab, bs = engine.model_config.vocab_size, engine.config.block_size
    n = -(-(context + 1) // bs)
    sched, reqs = [], []
    for b in range(batch):
        tok = rng.randrange(vocab)
        tables = [[0] * first_kept(g, context, bs) + [next(ids) for _ in range(n - first_kept(g, context, bs))]
                  for g in engine.kv_cache_groups]
        sched.append(ScheduledRequest(f"step-{b}", [tok], context, tables, sample=True, is_prefill=False))
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        reqs.append(Request(f"step-{b}", [tok] * context, params))
    return SchedulerOutput(scheduled=sched), reqs


def fill_kv(runner) -> None:
    """Uniform random K/V codes (and scales in [0.01, 0.1]) in every cache tensor."""
    for c in runner.caches:
        if c.data.dtype.is_floating_point and c.data.element_size() > 1:
            c.data.uniform_(-1, 1)
        else:  # int8 / fp8 codes, a block at a time (no full-size float32 copy)
            for i in range(c.data.shape[1]):
                c.data[:, i].copy_(torch.empty(c.data[:, i].shape, device=c.data.device).uniform_(-2, 2))
        if c.scales is not None:
            c.scales.uniform_(0.01, 0.1)


def kv_read_bytes(engine, batch: int, context: int) -> int:
    """K/V bytes (scales included) a decode step of ``batch`` × ``context`` must read."""
    cfg = engine.model_config
    per_layer_token = engine.bytes_per_token / cfg.num_layers
    tokens = sum(min(context + 1, cfg.layer_window(i) or context + 1) for i in range(cfg.num_layers))
    return int(batch * tokens * per_layer_token)

def engine_for(model, config: EngineConfig, batch: int, context: int):
    """An engine over the loaded ``model`` whose pool holds ``batch`` × (``context`` + 1) tokens
    (``config.kv_cache_memory`` is replaced; ``max_num_seqs`` and the token budget are raised
    to ``batch``), its cache filled with random K/V."""
    from llmd.daemon.core.engine import Engine
    from llmd.daemon.core.kv_size import kv_cache_block_bytes
    from llmd.daemon.kv import make_kv_cache_groups

    cfg, dtype = model.config, next(model.parameters()).dtype
    groups = make_kv_cache_groups(cfg.layer_windows, hybrid=not config.disable_hybrid_kv_cache_manager)
    block_bytes = kv_cache_block_bytes(cfg, groups, config.block_size, config.kv_cache_dtype, dtype)
    memory = (blocks_needed(groups, config.block_size, batch, context) + 1) * block_bytes
    sized = dataclasses.replace(config, kv_cache_memory=memory, max_num_seqs=max(batch, config.max_num_seqs),
                                # the runner's buffers fit
                                max_num_batched_tokens=max(batch, config.max_num_batched_tokens))
    sized.fp16_weights = getattr(config, "fp16_weights", False)  # not a field: replace() drops it
    engine = Engine(model, None, sized)  # no tokenizer: no requests are added
    fill_kv(engine.runner)
    return engine
