"""The shared store: tiers, slot pools, block index, scheduler plans, transfers and step leases."""

from .leases import StepLease, StepRequest
from .tier_store import PIN_WAIT_S, STAGING_BYTES, TierStore
from .token_map import TierRun

__all__ = ["TierStore", "TierRun", "StepRequest", "StepLease", "STAGING_BYTES", "PIN_WAIT_S"]
