from .base import CacheView, KVCache, visibility
from .full import FullCache
from .retrieval import RetrievalCache
from .streaming import StreamingCache

__all__ = ["CacheView", "KVCache", "visibility", "FullCache", "RetrievalCache", "StreamingCache"]
