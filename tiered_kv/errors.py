"""Exceptions raised by tiered_kv. Every message names what was wrong and what is allowed."""


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the key path, the value and what is allowed."""


class ColdPathInUseError(ConfigError):
    """Another running TierStore (this or another process) holds the cold directory's lock."""


class CapacityError(RuntimeError):
    """A request needs more blocks than all tiers together can hold. Raised before anything is written."""


class CorruptBlockError(RuntimeError):
    """A stored block failed its checksum. It is never served; the bank drops it so the tokens are recomputed."""


class LayoutError(ValueError):
    """A model config or tensor does not match what the bank/store can serve (names the field)."""


class TraceError(ValueError):
    """A trace file cannot be written, or read back: the message names the file (and the line)."""


class BankClosedError(RuntimeError):
    """A CacheBank was used after close(): its blocks were released. Create a new bank."""


class MetricsPortError(OSError):
    """The metrics server could not listen on its port (taken, or not allowed); the message names it."""
