"""``llmd bench context-shift``'s teacher forcing on the tiny model: without a shift it equals the
engine's own teacher forcing; with shifts it still gives one logits row per token, and the
shifted context is what the model saw (its rows differ once a shift happened)."""

from __future__ import annotations

import torch
from tiny_engine import tiny_engine

from llmd.daemon.bench.context_shift import repeated_4grams, shifted_teacher_forced


def test_shifted_teacher_forcing(tmp_path):
    ids = [(i * 37 + 11) % 256 for i in range(150)]
    wide = tiny_engine(tmp_path / "w.gguf", max_model_len=256)
    plain = wide.teacher_forced_logits(ids, 16)
    run = shifted_teacher_forced(wide, ids, 16, keep=0)
    assert run.num_shifts == 0 and torch.allclose(run.logits, plain, atol=1e-5)
    narrow = tiny_engine(tmp_path / "n.gguf", max_model_len=64)
    run = shifted_teacher_forced(narrow, ids, 16, keep=16)
    assert run.logits.shape == plain.shape and run.num_shifts == 6 and run.shift_starts[0] == 64
    assert torch.allclose(run.logits[:64], plain[:64], atol=1e-5)
    assert not torch.allclose(run.logits[64:80], plain[64:80], atol=1e-3)
    kv = narrow.kv_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    kv.check_integrity()


def test_repeated_4grams():
    assert repeated_4grams([1, 2, 3, 4, 5]) == 0.0
    assert repeated_4grams([1, 2, 3, 4] * 3) == 1 - 4 / 9
