"""The converted-weights cache (llmd.models.weights_cache): a warm load gives bit-identical
logits to the cold one (dense and packed, tied and untied heads), shares the tied head's dense
copy with the embedding table again, rebuilds a corrupt, truncated or stale entry, keys on
every setting, and writes 0600 files in a 0700 directory."""

import os
import stat

import gguf
import pytest
import torch
from gemma_fixtures import contiguous_meta
from tiny_gguf import write_tiny_llama

from llmd.models import gguf_loader
from llmd.models import weights_cache as wc
from llmd.models.gguf_loader import load_model
from llmd.models.header_cache import header_info
from llmd.quant.packed_linear import PackedLinear

T = gguf.GGMLQuantizationType
IDS = [5, 17, 200, 3, 99, 42, 7, 128]


def _logits(model, cfg):
    caches = [torch.zeros(2, 4, 4, cfg.num_kv_heads, cfg.head_dim, dtype=model.embed_tokens.weight.dtype)
              for _ in range(cfg.num_layers)]
    with torch.inference_mode():
        pre = model(torch.tensor(IDS[:7]), torch.arange(7), caches, contiguous_meta([(1, 0, 7)], 4))
        dec = model(torch.tensor(IDS[7:]), torch.tensor([7]), caches, contiguous_meta([(1, 7, 1)], 4))
        return model.compute_logits(torch.cat((pre, dec)))


def _entries(root):
    d = os.path.join(root, "weights")
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors")) if os.path.isdir(d) else []


@pytest.mark.parametrize("weight_quant,keep_dense,dtype,tied", [
    ("none", False, torch.float32, True), ("gguf", False, torch.float32, False),
    ("gguf", True, torch.bfloat16, True), ("int8", False, torch.bfloat16, False),
    ("nf4", False, torch.bfloat16, True), ("fp4", False, torch.float32, False)])  # bitsandbytes layers
def test_warm_load_is_bit_identical(tmp_path, monkeypatch, weight_quant, keep_dense, dtype, tied):
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, qtype=T.Q4_1, tied=tied, seed=1)
    kw = dict(weight_quant=weight_quant, keep_dense=keep_dense, weights_cache=True, cache_dir=str(tmp_path / "c"))
    cold, cfg = load_model(path, dtype, **kw)
    assert len(_entries(tmp_path / "c")) == 1
    monkeypatch.setattr(gguf_loader, "open_gguf", lambda p: pytest.fail("a warm load parsed the GGUF"))
    warm, cfg2 = load_model(path, dtype, **kw)
    assert cfg2 == cfg and repr(warm) == repr(cold)
    assert warm.weight_quant_summary == cold.weight_quant_summary
    a, b = _logits(cold, cfg), _logits(warm, cfg)
    assert torch.equal(a, b) and torch.isfinite(a).all()
    cold_state = {**dict(cold.named_parameters()), **dict(cold.named_buffers())}
    warm_state = {**dict(warm.named_parameters()), **dict(warm.named_buffers())}
    assert cold_state.keys() == warm_state.keys()
    assert all(torch.equal(cold_state[k], warm_state[k]) and cold_state[k].dtype == warm_state[k].dtype
               for k in cold_state)
    assert all(not p.requires_grad for p in warm.parameters())
    packs = [t for m in warm.modules() if isinstance(m, PackedLinear) for t in (m.packed, m.scales)]
    assert all(t.data_ptr() % 64 == 0 for t in packs)  # the weight-only kernels' aligned loads
    head = warm.logits_proj
    if tied and isinstance(head, PackedLinear):  # the tied head's dense copy is the table itself, once
        assert head.dense.data_ptr() == warm.embed_tokens.weight.data_ptr()
    assert (warm.lm_head is None) == (cold.lm_head is None)


def test_a_misaligned_mapped_pack_is_copied_to_an_aligned_one():
    buf = torch.arange(4096 + 128, dtype=torch.int32).to(torch.uint8)
    start = (64 - buf.data_ptr() % 64) % 64 + 40
    t = buf[start:start + 4096]
    assert t.data_ptr() % 64 == 40
    a = wc.aligned(t)
    assert a.data_ptr() % 64 == 0 and torch.equal(a, t)
    assert wc.aligned(a) is a  # an aligned tensor stays mapped (no copy)


def test_corrupt_truncated_and_stale_entries_are_rebuilt(tmp_path, caplog):
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, qtype=T.Q4_0, seed=2)
    root = str(tmp_path / "c")
    kw = dict(weight_quant="gguf", weights_cache=True, cache_dir=root)
    ref = _logits(*load_model(path, torch.float32, **kw))
    entry = os.path.join(root, "weights", _entries(root)[0])
    size = os.path.getsize(entry)
    with open(entry, "r+b") as f:  # flip one byte of tensor data: only the crc32 can tell
        f.seek(size - 100)
        byte = f.read(1)
        f.seek(size - 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    model, cfg = load_model(path, torch.float32, **kw)
    assert "discarded" in caplog.text and torch.equal(_logits(model, cfg), ref)
    assert _entries(root) == [os.path.basename(entry)]  # rebuilt in place
    caplog.clear()
    with open(entry, "r+b") as f:
        f.truncate(size // 2)
    model, cfg = load_model(path, torch.float32, **kw)
    assert "discarded" in caplog.text and torch.equal(_logits(model, cfg), ref)
    caplog.clear()
    write_tiny_llama(path, qtype=T.Q4_0, seed=3)  # the GGUF changed: a new key, the old entry unused
    fresh, cfg = load_model(path, torch.float32, **kw)
    assert "discarded" not in caplog.text and not torch.equal(_logits(fresh, cfg), ref)
    assert torch.equal(_logits(fresh, cfg), _logits(*load_model(path, torch.float32, weight_quant="gguf")))


def test_key_changes_with_every_setting_and_files_are_private(tmp_path, monkeypatch):
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, seed=4)
    off = header_info(path, str(tmp_path / "c")).data_offset
    keys = {wc.cache_key(path, off, dt, wq, kd) for dt in (torch.float32, torch.bfloat16)
            for wq in ("none", "gguf", "int8") for kd in (False, True)}
    assert len(keys) == 12
    base = wc.cache_key(path, off, torch.float32, "none", False)
    monkeypatch.setattr(wc, "source_digest", lambda: "edited")  # the conversion code changed
    assert wc.cache_key(path, off, torch.float32, "none", False) != base
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    load_model(path, torch.float32, weights_cache=True)
    d = tmp_path / "xdg" / "llmd" / "weights"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert [stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()] == [0o600, 0o600]  # the entry, its crc


def test_least_recently_used_entries_are_pruned(tmp_path, monkeypatch):
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, layers=1, seed=5)
    monkeypatch.setattr(wc, "MAX_ENTRIES", 2)
    root = str(tmp_path / "c")
    off = header_info(path, root).data_offset
    entries = {}
    for i, wq in enumerate(("none", "int8", "none", "gguf")):  # "none" used again: int8 is the oldest
        load_model(path, torch.float32, weight_quant=wq, weights_cache=True, cache_dir=root)
        entries[wq] = wc.entry_path(wc.cache_key(path, off, torch.float32, wq, False), root)
        os.utime(entries[wq], (1000 + i, 1000 + i))  # distinct mtimes on a coarse clock
    assert _entries(root) == sorted(os.path.basename(entries[w]) for w in ("none", "gguf"))
    assert not os.path.exists(entries["int8"] + ".crc")
