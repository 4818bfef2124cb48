"""The lazy GGUF header reader and its cache: the values, tensor infos and data offset
``gguf.GGUFReader`` gives (every value type, both byte orders, a custom alignment), clean errors
on bad files, a cache entry rebuilt when the file changes or the entry is corrupt, and
``llmd kv-size`` (with ``--total-memory``) giving the GGUFReader-derived numbers in a process
where ``import gguf`` fails."""

import json
import os
import stat
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
from tiny_gguf import write_tiny_llama

from llmd.daemon.core.kv_size import kv_size_rows
from llmd.models import header_cache
from llmd.models.config import read_config
from llmd.models.errors import GGUFLoadError
from llmd.models.gguf_header import read_header
from llmd.models.llama import LlamaForCausalLM
from llmd.models.weight_quant import weight_bytes


def _write_every_type(path, endian, alignment):
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "ünï", "x" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b.weight", gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                                                 gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endian,alignment", [(gguf.GGUFEndian.LITTLE, 0), (gguf.GGUFEndian.BIG, 64)])
def test_header_equals_gguf_reader(tmp_path, endian, alignment):
    path = tmp_path / "all.gguf"
    _write_every_type(path, endian, alignment)
    ref, h = gguf.GGUFReader(str(path)), read_header(str(path))
    assert h.data_offset == ref.data_offset and (alignment == 0 or h.data_offset % alignment == 0)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # the reader's own pseudo-fields
    assert sorted(keys) == sorted(h.fields)
    for k in keys:
        assert h.fields[k].contents() == ref.fields[k].contents(), k
    assert h.fields["t.strs"].count == 4 and h.fields["t.str"].contents() == "héllo ✓"
    assert [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data_offset) for t in ref.tensors] == \
        [tuple(t) for t in h.tensors]


def test_config_equals_the_gguf_reader_one(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, tied=False)
    assert read_config(read_header(path), "m") == read_config(gguf.GGUFReader(path), "m")


def test_bad_files_raise_gguf_load_error(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path)
    data = path.read_bytes()
    for name, content in [("empty", b""), ("junk", b"not a gguf at all, no"), ("cut", data[:200])]:
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(content)
        with pytest.raises(GGUFLoadError, match="not a readable GGUF"):
            read_header(str(bad))
    with pytest.raises(GGUFLoadError, match="not found"):
        read_header(str(tmp_path / "missing.gguf"))


def test_cache_is_used_private_and_rebuilt_when_stale_or_corrupt(tmp_path, monkeypatch):
    path, root = str(tmp_path / "m.gguf"), str(tmp_path / "c")
    write_tiny_llama(path, vocab=256)
    first = header_cache.header_info(path, root)
    (entry,) = (tmp_path / "c" / "headers").iterdir()
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600 and stat.S_IMODE(entry.parent.stat().st_mode) == 0o700
    with monkeypatch.context() as m:  # a hit parses nothing
        m.setattr(header_cache, "read_header", lambda p: pytest.fail("the cache was not used"))
        assert header_cache.header_info(path, root) == first
    write_tiny_llama(path, vocab=512)  # the file changes (size and mtime): the entry is stale
    header_info = header_cache.header_info(path, root)
    assert header_info.config.vocab_size == 512 and header_info.tensors != first.tensors
    (entry,) = [e for e in (tmp_path / "c" / "headers").iterdir()
                if json.loads(e.read_text())["key"] == header_cache._key(path)]  # the new file's own entry
    entry.write_text(json.dumps({"key": header_cache._key(path), "config": {}}))  # corrupt
    assert header_cache.header_info(path, root) == header_info
    assert json.loads(entry.read_text())["config"]["vocab_size"] == 512  # rewritten


def test_kv_size_numbers_without_gguf(tmp_path):
    """``llmd kv-size`` and ``--total-memory`` in a process where ``import gguf`` fails print the
    numbers the GGUFReader-based path gives."""
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, layers=3, hidden=64, heads=4, kv_heads=2, vocab=256,
                     qtype=gguf.GGMLQuantizationType.Q4_0)
    code = textwrap.dedent("""
        import sys
        sys.modules["gguf"] = None  # any import of gguf now raises
        from llmd.daemon.cli.main import main
        sys.argv = ["llmd", *sys.argv[1:]]
        main()
    """)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}

    def cli(*args):
        r = subprocess.run([sys.executable, "-c", code, "kv-size", "--model", path, *args], capture_output=True,
                           text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    reader = gguf.GGUFReader(path)
    cfg = read_config(reader, "m")
    out = cli("--memory", "1MiB")
    for r in kv_size_rows(cfg, cfg.max_position, 2**20, 16):
        assert f"{r.bytes_per_token:>12,.0f}{r.bytes_per_sequence:>16,.0f}{r.num_blocks:>10}" in out
    out = cli("--total-memory", "8MiB")
    tensors = {t.name: t for t in reader.tensors}
    for mode, keep in (("none", False), ("gguf", True), ("gguf", False), ("int8", False)):
        assert f"{weight_bytes(tensors, LlamaForCausalLM.layer_tensors, mode, 2, keep) / 2**20:>12.0f}" in out


def test_weight_bytes_type_ids_are_gguf_packs_ones():
    from llmd.models import weight_bytes as wb
    from llmd.quant import gguf_packs

    assert wb.INT4_TYPES == gguf_packs.INT4_TYPES and wb.INT8_TYPES == gguf_packs.INT8_TYPES
    assert wb.GROUP == gguf_packs.GROUP
