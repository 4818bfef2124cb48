"""``--kv-rotation hadamard`` with the Triton backend (issue 19): the rotation lives in
``kernels/ops.py`` around every backend, so the Triton store_kv writes the torch reference's
bytes of ``K H`` and the decode / prefill kernels, given ``q H``, equal the torch backend on
those bytes. On CPU the kernels run under ``TRITON_INTERPRET=1`` (set here before the Triton
modules are imported, as in test_kernels.py); on a CUDA machine the GPU script covers them."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kv_rotation_support import make_step, rel  # noqa: E402

from llmd.kernels import ops  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the Triton interpreter")


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("decode_only", [False, True])
def test_triton_rotated_cache_matches_torch_backend(fmt, decode_only):
    meta, q, cache, _ = make_step(fmt, "hadamard", "triton", torch.float32, seed=7)
    _, _, ref_cache, _ = make_step(fmt, "hadamard", "torch", torch.float32, seed=7)
    assert torch.equal(cache.data.view(torch.uint8), ref_cache.data.view(torch.uint8))
    assert torch.equal(cache.scales, ref_cache.scales)
    if decode_only:  # the step's three decodes alone: the decode kernel instead of prefill
        meta.query_lens_cpu, meta.seq_lens_cpu = meta.query_lens_cpu[:3], meta.seq_lens_cpu[:3]
        meta.block_tables, meta.seq_lens = meta.block_tables[:3], meta.seq_lens[:3]
        meta.query_start_loc, q = meta.query_start_loc[:4], q[:3]
    out = ops.paged_attention(q, cache, meta, 0.125)
    meta.attn_backend = "torch"
    assert rel(out, ops.paged_attention(q, cache, meta, 0.125)) <= 1e-5
