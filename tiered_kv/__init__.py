"""tiered_kv: a three-tier (device / host / NVMe) paged KV cache for transformers generate()."""

from .bank import CacheBank
from .config import Config, load_config
from .errors import BankClosedError, CapacityError, ConfigError, CorruptBlockError, LayoutError
from .store import TierStore

__all__ = [
    "CacheBank",
    "TierStore",
    "Config",
    "load_config",
    "ConfigError",
    "CapacityError",
    "CorruptBlockError",
    "LayoutError",
    "BankClosedError",
]
__version__ = "0.1.0"
