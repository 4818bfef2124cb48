"""Start-up warm-up (``llmd.kernels.warmup``): the variants listed for a model configuration are
the launchers' own (constexprs of a real step), one per compiled binary; on CPU warm_up is a no-op;
a failing variant is one line naming it."""

import pytest
import torch

from llmd.kernels.launch import Launch
from llmd.kernels.prefill_attention import prefill_tile
from llmd.kernels.warmup import WarmupSpec, merge_pads, run_launches, warm_up, warmup_launches

QWEN3 = WarmupSpec(128, 16, 8, torch.bfloat16, 16, "auto", False, (None,), 40960)  # Qwen3-0.6B, bf16
GEMMA3 = WarmupSpec(256, 4, 1, torch.float32, 32, "fp8_e4m3", True, (512, None), 32768)  # local + global layers


def test_merge_pads_follow_the_split_count():
    assert merge_pads(256) == [] and merge_pads(2048) == [2, 4, 8] and merge_pads(8192) == [2, 4, 8, 16, 32]
    assert merge_pads(131072) == [2, 4, 8, 16, 32, 64]


def test_variants_of_a_full_attention_model():
    got = warmup_launches(QWEN3, "cpu", capability=90)
    names = [n for n, _ in got]
    assert names == ["store_kv", "decode window=off direct", "decode window=off split", "prefill window=off",
                     *(f"merge splits_pad={p}" for p in (2, 4, 8, 16, 32, 64))]
    kw = {n: launch.kwargs for n, launch in got}
    assert kw["decode window=off direct"]["DIRECT"] and not kw["decode window=off split"]["DIRECT"]
    assert kw["decode window=off direct"]["GROUP"] == 2 and not kw["store_kv"]["QUANT"]
    pad, bq, bn, warps, stages = prefill_tile(2, 128, torch.bfloat16)
    assert (kw["prefill window=off"]["BLOCK_Q"], kw["prefill window=off"]["num_warps"]) == (bq, warps)
    assert len({tuple(sorted(k.items())) for k in kw.values()}) == len(got)  # each a distinct binary


def test_variants_of_a_sliding_window_model_on_sm80():
    """Windowed and global layers: both decode/prefill kinds; fp8_e4m3 on sm_80 is the software
    path (uint8 bits), on sm_90 native; static scales reach the store kernel."""
    names = dict(warmup_launches(GEMMA3, "cpu", capability=80))
    assert {"decode window=on direct", "decode window=on split", "prefill window=on", "decode window=off direct",
            "prefill window=off"} <= set(names)
    assert names["decode window=on split"].kwargs["USE_WINDOW"] and names["store_kv"].kwargs["STATIC"]
    assert all(launch.kwargs.get("E4M3_SW", True) for n, launch in names.items() if not n.startswith("merge"))
    native = dict(warmup_launches(GEMMA3, "cpu", capability=90))
    assert not native["prefill window=on"].kwargs["E4M3_SW"]


def test_variants_of_an_int4_model_are_the_kivi_kernels():
    """int4: no store_kv (torch stores it), decode and prefill are the KIVI kernels with one key
    tile per 16 keys, the merges the shared merge kernel."""
    from llmd.kernels.decode_attention import _decode_merge_kernel
    from llmd.kernels.kivi_decode import _kivi_decode_kernel
    from llmd.kernels.kivi_prefill import _kivi_prefill_kernel, kivi_prefill_tile

    spec = WarmupSpec(64, 9, 3, torch.bfloat16, 16, "int4", False, (None, 24), 8192)  # SmolLM2-like, Gemma windows
    got = dict(warmup_launches(spec, "cpu", capability=90))
    assert "store_kv" not in got and {"decode window=on split", "prefill window=off"} <= set(got)
    assert all(got[n].kernel is _kivi_decode_kernel for n in got if n.startswith("decode"))
    assert all(got[n].kernel is _kivi_prefill_kernel for n in got if n.startswith("prefill"))
    merges = [n for n in got if got[n].kernel is _decode_merge_kernel]
    assert merges == [f"merge splits_pad={p}" for p in (2, 4, 8, 16, 32)]
    assert got["prefill window=off"].kwargs["BLOCK_Q"] == kivi_prefill_tile(3, 64, torch.bfloat16)[1]
    assert got["decode window=on direct"].kwargs["TILE"] == 16 and got["decode window=on direct"].kwargs["USE_WINDOW"]


def test_warm_up_is_a_no_op_on_cpu():
    assert warm_up(QWEN3, "cpu") == 0


def test_a_failing_variant_is_one_line():
    """The first variant runs, the second raises a two-line error: one line naming it comes out."""
    ran = []

    class Kernel:
        def __init__(self, fail: bool):
            self.fail = fail

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if self.fail:
                    raise ValueError("ptxas fatal   : Unresolved extern function 'oops'\nmore detail")
                ran.append(grid)
            return launch

    launches = [("store_kv", Launch(Kernel(False), (1,), ())),
                ("decode window=off direct", Launch(Kernel(True), (2,), ()))]
    with pytest.raises(RuntimeError) as e:
        run_launches(QWEN3, launches, "sm_90")
    msg = str(e.value)
    assert ran == [(1,)] and "\n" not in msg
    assert msg.startswith("Triton kernel decode window=off direct failed to compile for sm_90 (head_dim 128, "
                          "16/8 heads, bfloat16, KV auto, block 16)")
    assert msg.endswith("ValueError: ptxas fatal   : Unresolved extern function 'oops'")


def test_model_runner_passes_its_model_and_cache_settings(tmp_path, monkeypatch):
    """The runner's warm-up spec is the model's attention shape and the engine's cache settings;
    a compile failure becomes the engine's one-line LlmdError."""
    from tiny_engine import tiny_engine

    from llmd.daemon.core.errors import LlmdError
    from llmd.kernels import warmup

    engine = tiny_engine(tmp_path / "tiny.gguf", kv_cache_dtype="int8", block_size=32, max_model_len=300)
    seen = []

    def fake(spec, device):
        seen.append((spec, str(device)))
        raise RuntimeError("Triton kernel prefill window=off failed to compile for sm_90 (...): X: y")

    monkeypatch.setattr(warmup, "warm_up", fake)
    with pytest.raises(LlmdError, match="^Triton kernel prefill window=off failed"):
        engine.runner.warm_up_kernels(torch.float32, "int8", False, engine.max_model_len)
    spec, device = seen[0]
    assert spec == WarmupSpec(16, 4, 2, torch.float32, 32, "int8", False, (None,), 300) and device == "cpu"
    assert engine.runner.num_warmed_up == 0  # CPU engine: nothing compiled at start-up
