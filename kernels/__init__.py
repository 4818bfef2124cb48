"""Attention ops over the paged KV cache (torch reference now; Triton kernels share its interface)."""

from llmd.kernels.metadata import AttentionMetadata
from llmd.kernels.reference import paged_attention, store_kv

__all__ = ["AttentionMetadata", "paged_attention", "store_kv"]
