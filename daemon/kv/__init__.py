"""llmd.daemon.kv: paged KV cache bookkeeping (blocks, block pool, block tables). Torch-free."""

from .block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from .groups import KVCacheGroupSpec, layer_placement, make_kv_cache_groups
from .manager import KVCacheManager

__all__ = [
    "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheGroupSpec", "KVCacheManager",
    "layer_placement", "make_kv_cache_groups",
]
