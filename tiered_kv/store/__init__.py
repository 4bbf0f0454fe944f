"""The shared store: tiers, slot pools, block index, scheduler plans and their execution."""

from .tier_store import PIN_WAIT_S, STAGING_BYTES, TierStore
from .token_map import TierRun

__all__ = ["TierStore", "TierRun", "STAGING_BYTES", "PIN_WAIT_S"]
