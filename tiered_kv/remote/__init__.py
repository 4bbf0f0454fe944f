"""The shared remote tier on Redis / Valkey (config section `remote:`): codec.py (keys and
checked values), client.py (pipelined round trips, timeouts, backoff), tier.py (the writer
thread and lookups). redis-py is imported only when `remote.url` is set."""

from .tier import RemoteTier

__all__ = ["RemoteTier"]
