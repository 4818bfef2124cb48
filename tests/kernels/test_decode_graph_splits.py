"""The Triton pieces a CUDA-graph decode relies on (``llmd.daemon.core.cuda_graphs``), under the
interpreter on CPU: the decode kernel with a split count fixed by a bound (``--max-model-len``)
and each sequence's split length computed on the device (``per_seq_splits``) matches the float64
reference, padded rows (seq_len 0) give exact zeros, and ``store_kv`` skips slot -1."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from llmd.kernels import AttentionMetadata, ops, reference  # noqa: E402
from llmd.kernels.bench import random_paged_layout  # noqa: E402
from llmd.quant.kv import PagedKVCache, get_format  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HD, NKV, GROUP, BS = 64, 2, 2, 16


def padded_batch(seq_lens: list[int], fmt: str, seed: int = 0):
    """A decode batch whose seq_len-0 rows are padding (null-block tables, nothing stored)."""
    g = torch.Generator().manual_seed(seed)
    real = [s for s in seq_lens if s]
    tables_r, slots, nb = random_paged_layout(real, BS, g, spare_blocks=2)
    tables = torch.zeros(len(seq_lens), tables_r.shape[1], dtype=torch.int32)
    tables[torch.tensor([s > 0 for s in seq_lens])] = tables_r
    cache = PagedKVCache.allocate((2, nb, BS, NKV, HD), get_format(fmt), torch.float32, DEV)
    slot = torch.cat(slots)
    k, v = torch.randn(len(slot), NKV, HD, generator=g), torch.randn(len(slot), NKV, HD, generator=g)
    ops.store_kv(k.to(DEV), v.to(DEV), cache, slot.to(DEV), "triton" if DEV == "cuda" else "torch")
    q = torch.randn(len(seq_lens), NKV * GROUP, HD, generator=g)
    n = len(seq_lens)
    meta = AttentionMetadata(torch.full((n,), -1, dtype=torch.int64), tables, torch.arange(n + 1, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), [1] * n, seq_lens, BS, "triton")
    return q, cache, meta


@pytest.mark.parametrize("fmt, window, splits", [("auto", None, None), ("int8", 40, 8), ("auto", 40, 3)])
def test_per_sequence_splits_match_the_reference_and_padded_rows_are_zero(fmt, window, splits):
    from llmd.kernels.decode_attention import num_decode_splits, paged_decode_attention

    seq_lens = [37, 0, 130, 5, 0, 64]
    q, cache, meta = padded_batch(seq_lens, fmt)
    bound = 1024  # the graph's --max-model-len: 4 splits by default, most of them empty here
    assert num_decode_splits(bound, 32) == 4
    out = paged_decode_attention(q.to(DEV), cache, meta.block_tables.to(DEV), meta.seq_lens.to(DEV), bound,
                                 HD**-0.5, window, num_splits=splits, per_seq_splits=True).cpu()
    ref = reference.paged_attention(q.double(), PagedKVCache(cache.data.cpu(), None if cache.scales is None else
                                                             cache.scales.cpu(), cache.fmt), meta, HD**-0.5, window,
                                    compute_dtype=torch.float64)
    real = torch.tensor([s > 0 for s in seq_lens])
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # padded rows: nothing read, exact 0
    err = ((out[real].double() - ref[real]).norm() / ref[real].norm()).item()
    assert err <= 1e-5, err


def test_ops_route_a_bounded_decode_through_per_sequence_splits():
    """``AttentionMetadata.decode_max_seq_len`` (what a captured step carries) gives the same
    outputs as the host split of the step's own longest context, to float32 rounding."""
    q, cache, meta = padded_batch([20, 0, 90], "auto", seed=1)
    dmeta = AttentionMetadata(meta.slot_mapping.to(DEV), meta.block_tables.to(DEV), meta.query_start_loc.to(DEV),
                              meta.seq_lens.to(DEV), meta.query_lens_cpu, meta.seq_lens_cpu, BS, "triton")
    eager = ops.paged_attention(q.to(DEV), cache, dmeta, HD**-0.5).cpu()
    dmeta.decode_max_seq_len = 4096  # 16 splits, per sequence
    fixed = ops.paged_attention(q.to(DEV), cache, dmeta, HD**-0.5).cpu()
    assert torch.allclose(fixed, eager, rtol=1e-5, atol=1e-6)
    assert torch.equal(fixed[1], torch.zeros_like(fixed[1]))


def test_triton_store_kv_skips_slot_minus_one():
    """Padded rows of a captured step carry slot -1: the Triton store writes nothing for them,
    the same bytes as the torch reference (which skips negative slots too)."""
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(4, NKV, HD, generator=g), torch.randn(4, NKV, HD, generator=g)
    slots = torch.tensor([5, -1, 17, -1])
    for fmt in ("auto", "int8"):
        ref = PagedKVCache.allocate((2, 3, BS, NKV, HD), get_format(fmt), torch.float32, "cpu")
        reference.store_kv(k, v, ref, slots)
        cache = PagedKVCache.allocate((2, 3, BS, NKV, HD), get_format(fmt), torch.float32, DEV)
        ops.store_kv(k.to(DEV), v.to(DEV), cache, slots.to(DEV), "triton")
        assert torch.equal(cache.data.cpu(), ref.data)
        written = cache.data.cpu().reshape(2, -1, NKV, HD).abs().sum((0, 2, 3)) > 0
        assert written.nonzero().flatten().tolist() == [5, 17]
