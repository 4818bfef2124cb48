"""The converted-weights entry's layout: every tensor 64-byte aligned in the file (so in its
memory map), so a warm load maps the packs in place instead of copying them (``aligned`` is then
a no-op); the pad tensors never reach the model."""

from __future__ import annotations

import json
import struct

import gguf
import torch
from safetensors.torch import load_file
from tiny_gguf import write_tiny_llama

from llmd.models import weights_cache as wc
from llmd.models.gguf_loader import load_model
from llmd.quant.packed_linear import PackedLinear


def test_entries_are_aligned_and_warm_packs_are_mapped_in_place(tmp_path, monkeypatch):
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, qtype=gguf.GGMLQuantizationType.Q4_0, hidden=96, ffn=160, vocab=250, seed=3)
    kw = dict(weight_quant="gguf", keep_dense=True, weights_cache=True, cache_dir=str(tmp_path / "c"))
    cold, _ = load_model(path, torch.bfloat16, **kw)
    (entry,) = (tmp_path / "c" / "weights").glob("*.safetensors")
    with open(entry, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    assert (8 + n) % wc.ALIGN == 0
    spans = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    assert all(a % wc.ALIGN == 0 for (a, _), k in spans if not k.startswith(wc.PAD_PREFIX))
    assert all(e == s for ((_, e), _), ((s, _), _) in zip(spans, spans[1:]))  # no holes (the format's rule)
    mapped = load_file(str(entry))
    assert all(t.data_ptr() % wc.ALIGN == 0 for k, t in mapped.items() if not k.startswith(wc.PAD_PREFIX))
    copies = []
    monkeypatch.setattr(wc, "aligned", lambda t: copies.append(t) or t if t.data_ptr() % 64 else t)
    warm, _ = load_model(path, torch.bfloat16, **kw)
    assert not copies  # nothing needed a copy
    assert not any(wc.PAD_PREFIX in name for name, _ in [*warm.named_parameters(), *warm.named_buffers()])
    packs = [m for m in warm.modules() if isinstance(m, PackedLinear)]
    assert packs and all(m.packed.data_ptr() % 64 == 0 for m in packs)
    cold_state = {**dict(cold.named_parameters()), **dict(cold.named_buffers())}
    for name, t in [*warm.named_parameters(), *warm.named_buffers()]:
        assert torch.equal(t, cold_state[name]) and t.dtype == cold_state[name].dtype, name


def test_save_aligned_pads_odd_sizes(tmp_path):
    tensors = {"a": torch.arange(3, dtype=torch.float16), "b": torch.arange(-2, 3, dtype=torch.int8),
               "c": torch.tensor([True, False, True]), "d": torch.randn(7, 3).to(torch.bfloat16),
               "e": torch.zeros(0, 4), "f": torch.tensor(2.5, dtype=torch.float64),
               "g": torch.randn(5).to(torch.float8_e4m3fn)}
    path = str(tmp_path / "x.safetensors")
    wc.save_aligned(tensors, path, {"k": "v"})
    got = load_file(path)
    pads = [k for k in got if k.startswith(wc.PAD_PREFIX)]
    assert len(pads) == 6  # after every tensor but the empty e
    assert all(got[k].data_ptr() % wc.ALIGN == 0 for k in tensors if tensors[k].numel())
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape
        assert torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)) if t.dim() else got[k] == t
    assert wc._data_crc32(path)[0] == {"k": "v"}
