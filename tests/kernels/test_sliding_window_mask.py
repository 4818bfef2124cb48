"""Sliding-window mask semantics of the attention op (``llmd.kernels.paged_attention``).

The query at position ``p`` must see exactly keys ``[p - W + 1, p]``. Keys are one-hot
(``k_j = e_j``), values constant (``v_j = j``); query ``p`` scores key ``p - W + 1`` at 20 and
key ``p - W`` at 40 (everything else 0). A correct window returns ≈ ``p - W + 1``; letting
``p - W`` in returns ≈ ``p - W``; dropping ``p - W + 1`` returns the mean of the rest. Both
backends, prefill (after a cached prefix) and decode; blocks are shuffled in the cache so the
block-table lookups matter. Triton runs under ``TRITON_INTERPRET=1`` on CPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before llmd.kernels.ops imports the Triton modules

from gemma_fixtures import contiguous_meta  # noqa: E402

from llmd import kernels  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
W, BLOCK, HEAD_DIM, HEADS, KV_HEADS = 7, 4, 64, 2, 1


def window_case(seq_len: int, first_query: int, backend: str, num_blocks: int = 24, seed: int = 0):
    """Run one sequence's queries at ``first_query .. seq_len - 1`` through the op.

    Returns:
        (out ``[Q, HEADS, HEAD_DIM]`` float32 on CPU, query positions ``[Q]``).
    """
    g = torch.Generator().manual_seed(seed)
    nblocks = -(-seq_len // BLOCK)
    table = (torch.randperm(num_blocks - 1, generator=g) + 1)[:nblocks]  # shuffled, never the null block
    pos = torch.arange(seq_len)
    slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
    meta = contiguous_meta([(0, first_query, seq_len - first_query)], BLOCK, backend)
    meta.block_tables = table[None].to(torch.int32)
    meta.slot_mapping = slots[first_query:]
    for name in ("slot_mapping", "block_tables", "query_start_loc", "seq_lens"):
        setattr(meta, name, getattr(meta, name).to(DEV))
    eye = torch.eye(HEAD_DIM)
    k = eye[:seq_len, None, :].expand(seq_len, KV_HEADS, HEAD_DIM).contiguous().to(DEV)
    v = pos.float()[:, None, None].expand(seq_len, KV_HEADS, HEAD_DIM).contiguous().to(DEV)
    qpos = pos[first_query:]
    q = (20.0 * eye[qpos - W + 1] + 40.0 * eye[qpos - W])[:, None, :]
    q = q.expand(len(qpos), HEADS, HEAD_DIM).contiguous().to(DEV)
    cache = torch.zeros(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=DEV)
    if first_query:  # the cached prefix, stored by an earlier step
        kernels.store_kv(k[:first_query], v[:first_query], cache, slots[:first_query].to(DEV), backend)
    kernels.store_kv(k[first_query:], v[first_query:], cache, meta.slot_mapping, backend)  # store-then-read
    return kernels.paged_attention(q, cache, meta, 1.0, W).float().cpu(), qpos


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_query_sees_exactly_the_last_w_keys(backend, path):
    """Prefill: queries 20..39 after a 20-token cached prefix; decode: the query at 39 (and 22)."""
    cases = [(40, 20)] if path == "prefill" else [(40, 39), (23, 22)]
    for seq_len, first in cases:
        out, qpos = window_case(seq_len, first, backend)
        want = (qpos - W + 1).float()[:, None, None].expand_as(out)
        assert (out - want).abs().max().item() < 1e-3, (backend, path, seq_len)


def test_no_window_sees_the_far_key():
    """Control: without a window the 40-score key ``p - W`` dominates, so the test can fail."""
    seq_len = 30
    meta = contiguous_meta([(1, 0, seq_len)], BLOCK)
    eye = torch.eye(HEAD_DIM)
    k = eye[:seq_len, None, :].contiguous()
    v = torch.arange(seq_len).float()[:, None, None].expand(seq_len, 1, HEAD_DIM).contiguous()
    cache = torch.zeros(2, 1 + -(-seq_len // BLOCK), BLOCK, 1, HEAD_DIM)
    kernels.store_kv(k, v, cache, meta.slot_mapping)
    p = torch.arange(W, seq_len)
    q = torch.zeros(seq_len, 1, HEAD_DIM)
    q[p, 0] = 20.0 * eye[p - W + 1] + 40.0 * eye[p - W]
    out = kernels.paged_attention(q, cache, meta, 1.0, None)[W:, 0, 0]
    assert (out - (p - W).float()).abs().max().item() < 1e-3
