"""llmd.daemon.kv: paged KV cache bookkeeping (blocks, block pool, block tables). Torch-free."""

from .block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from .manager import KVCacheManager

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager"]
