"""tiered_kv: a three-tier (device / host / NVMe) paged KV cache for transformers generate()."""

import logging

logging.getLogger(__name__).addHandler(logging.NullHandler())  # the application decides what is shown

from .bank import BankBatch, CacheBank, RowFailure, forward_rows
from .config import Config, load_config
from .errors import BankClosedError, CapacityError, ConfigError, CorruptBlockError, LayoutError
from .store import TierStore
from . import hooks  # tiered_kv.hooks.install(model, bank): paged attention over the bank's blocks

__all__ = [
    "CacheBank",
    "BankBatch",
    "RowFailure",
    "forward_rows",
    "TierStore",
    "Config",
    "load_config",
    "ConfigError",
    "CapacityError",
    "CorruptBlockError",
    "LayoutError",
    "BankClosedError",
    "hooks",
]
__version__ = "0.1.0"
