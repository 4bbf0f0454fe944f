"""Placement policy: ids in, a Plan of moves out. Never imports torch."""

from .mem_scheduler import ALLOWED_POLICIES, MemScheduler
from .plan import COLD, DROPPED, HOT, TIER_NAMES, WARM, Move, Plan

__all__ = ["MemScheduler", "Plan", "Move", "HOT", "WARM", "COLD", "DROPPED", "TIER_NAMES", "ALLOWED_POLICIES"]
