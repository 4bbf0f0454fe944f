"""CacheBank, the transformers Cache of one chat, and the pieces it is built from."""

from .cache_bank import CacheBank

__all__ = ["CacheBank"]
