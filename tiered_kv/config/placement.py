"""The scheduler section of a config: how the MemScheduler places blocks (tiered_kv/scheduler/)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigError
from .checks import _choices, _error, _is_int, _is_share

ALLOWED_POLICIES = ("lru", "lfu", "fifo", "turns")
# older names a config may still give, each meaning the policy it names here: `ali` was the turns
# policy's first name (it ranks chats by turn heat or recency, not by ALI)
POLICY_ALIASES = {"ali": "turns"}
RESTORE_MODES = ("auto", "always")  # scheduler.restore (scheduler/restore.py)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How the MemScheduler places blocks (policy code: see tiered_kv/scheduler/).

    Signals: ALI (access locality index) = the share of the last `ali_window` store steps that
    read a block; a block belongs hot above `ali_hot`, warm above `ali_warm`, cold otherwise.
    BS (link saturation, 0..1): above `bs_threshold`, optional background moves wait. CS (cost
    sensitivity, 0..1, per chat: `CacheBank(..., cost_sensitivity=)`, else
    `default_cost_sensitivity`) adds `cs_weight * CS` to a block's value under every policy (in
    the policy's unit: times `ali_window` for the step-valued ones; log2 turn heat under `turns`,
    where 0.5 is worth 8 turns of decay at the default half-life), so high-CS chats stay hot
    longer and are the last victims. `attention_weight` adds `attention_weight * mass` the same way,
    mass a block's measured share of its chat's attention (the attention section samples it): within
    a chat, the blocks attention passes over go down first. `lru` is the default (bench/policy_family.py, issue 35); `lfu` ages its counts and `turns` ranks chats
    by turn heat or by recency, whichever has lately predicted the next speaker better: see
    tiered_kv/scheduler/policies.py and access_log.py. `policy: ali` is accepted and means
    `turns` (its former name; `policy` then reads "turns").
    """
    policy: str = "lru"
    ali_window: int = 100  # store steps
    ali_hot: float = 0.7
    ali_warm: float = 0.3
    bs_threshold: float = 0.8
    cs_weight: float = 0.5
    attention_weight: float = 0.0  # adds this x a block's attention mass (attention section) to its value; 0: off
    default_cost_sensitivity: float = 0.5
    idle_steps: int = 1000  # a chat unread this many store steps has its hot blocks demoted; 0: never
    half_life_turns: float = 16.0  # `turns`: a chat's turn heat halves every this many turns of the store
    lfu_half_life_turns: float = 16.0  # `lfu`: a read counts half after this many turns of the store
    ali_promote: bool = False  # `turns`: the mover also brings up blocks read lately whose ALI says hot
    restore: str = "always"  # auto: a turn restores only the stored prefix that loads faster than it recomputes
    background: bool = True  # run the background mover (prefetch, watermark demotion, compaction)
    mover_interval_s: float = 0.02  # how often the mover looks for work when nobody wakes it
    max_fragmentation: float = 0.5  # hot pool: 1 - largest free run / free slots, above which it repacks
    min_contiguity: float = 0.9  # per chat: share of its hot blocks in one run, below which it repacks

    _SHARES: ClassVar[tuple[str, ...]] = ("ali_hot", "ali_warm", "bs_threshold", "cs_weight", "attention_weight",
                                          "default_cost_sensitivity", "max_fragmentation", "min_contiguity")

    def __post_init__(self) -> None:
        if isinstance(self.policy, str) and self.policy in POLICY_ALIASES:
            object.__setattr__(self, "policy", POLICY_ALIASES[self.policy])
        if self.policy not in ALLOWED_POLICIES:
            raise _error("scheduler.policy", self.policy, _choices(ALLOWED_POLICIES) + " ('ali' is accepted as "
                         "the former name of 'turns')")
        if not (_is_int(self.ali_window) and self.ali_window >= 1):
            raise _error("scheduler.ali_window", self.ali_window, "an integer >= 1 (store steps)")
        for name in self._SHARES:
            if not _is_share(getattr(self, name)):
                raise _error(f"scheduler.{name}", getattr(self, name), "a number from 0 to 1")
        if self.ali_warm > self.ali_hot:
            raise ConfigError(f"config key 'scheduler.ali_warm': got {self.ali_warm!r}, above 'scheduler.ali_hot' "
                              f"{self.ali_hot!r}; allowed: ali_warm <= ali_hot")
        if not (isinstance(self.half_life_turns, (int, float)) and not isinstance(self.half_life_turns, bool)
                and 0.5 <= self.half_life_turns <= 1e6):
            raise _error("scheduler.half_life_turns", self.half_life_turns, "a number of turns from 0.5 to 1000000")
        if not (isinstance(self.lfu_half_life_turns, (int, float)) and not isinstance(self.lfu_half_life_turns, bool)
                and 1 <= self.lfu_half_life_turns <= 1e9):
            raise _error("scheduler.lfu_half_life_turns", self.lfu_half_life_turns,
                         "a number of turns from 1 to 1000000000")
        if not isinstance(self.ali_promote, bool):
            raise _error("scheduler.ali_promote", self.ali_promote, "true or false")
        if self.restore not in RESTORE_MODES:
            raise _error("scheduler.restore", self.restore, _choices(RESTORE_MODES) + " (auto: restore only what loads "
                         "faster than recomputing it, from measured rates; always: every stored token)")
        if not (_is_int(self.idle_steps) and self.idle_steps >= 0):
            raise _error("scheduler.idle_steps", self.idle_steps, "an integer >= 0 (store steps; 0 never demotes idle chats)")
        if not isinstance(self.background, bool):
            raise _error("scheduler.background", self.background, "true or false")
        if not (isinstance(self.mover_interval_s, (int, float)) and not isinstance(self.mover_interval_s, bool)
                and 0.001 <= self.mover_interval_s <= 60):
            raise _error("scheduler.mover_interval_s", self.mover_interval_s, "a number of seconds from 0.001 to 60")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
