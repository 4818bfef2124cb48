"""Attention ops over the paged KV cache: torch reference and Triton kernels behind one interface."""

from llmd.kernels.kv_shift import shift_keys
from llmd.kernels.metadata import AttentionMetadata
from llmd.kernels.ops import BACKENDS, paged_attention, store_kv

__all__ = ["AttentionMetadata", "BACKENDS", "paged_attention", "shift_keys", "store_kv"]
