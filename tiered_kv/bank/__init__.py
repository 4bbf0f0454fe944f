"""CacheBank, the transformers Cache of one chat, and the pieces it is built from; BankBatch, many
banks as the rows of one forward pass."""

from .batch import BankBatch, BatchOutput, RowFailure, forward_rows
from .cache_bank import CacheBank

__all__ = ["CacheBank", "BankBatch", "BatchOutput", "RowFailure", "forward_rows"]
