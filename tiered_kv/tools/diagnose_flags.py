"""What a diagnose Report's numbers show, as flags naming the config key to turn and which way.

Policy only (no torch, no I/O): `find_flags(report, thresholds)` reads the figures of
diagnose_report.Report. Each rule below fires on a measured figure, says it, and names one key:

  prompt_spilled     part of the prompt's KV sits below hot (it did not fit under hot's high
                     watermark): attention gathers it every step -> raise hot.capacity
  kv_share           the hot slab is more than `kv_share_max` of the compute device's measured
                     memory -> lower hot.capacity (to what the prompt needed, when less)
  hot_fragmented     hot pool fragmentation above scheduler.max_fragmentation, or the prompt's
                     contiguity below scheduler.min_contiguity -> turn on scheduler.background
                     (the mover compacts); with it on: raise hot's capacity when no hot slot is
                     free to compact into, else lower scheduler.max_fragmentation (fragmented)
                     or scheduler.mover_interval_s (scattered). Not raised for a scattered,
                     spilled prompt in a full hot pool: prompt_spilled names the fix
  tier_never_used    warm or cold has capacity but holds no block and the run put nothing there
                     -> lower its capacity (0 disables it) unless longer conversations need it
  block_size_waste   the prompt's partly filled last block leaves more than `block_waste_max` of
                     its token slots empty -> lower block_size (to the largest power of two under)
  link_saturated     link saturation peaked above scheduler.bs_threshold (background moves wait)
                     -> raise hot.capacity, so fewer blocks cross the link
  cold_unavailable   cold is configured but every block file there is held -> fewer stores or own cold.path
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..blocks import num_blocks_for
from .diagnose_report import MIB, Flag, Report

KV_SHARE_MAX = 0.5  # hot slab share of the compute device's measured memory above which kv_share fires
BLOCK_WASTE_MAX = 0.10  # share of the prompt's token slots left empty above which block_size_waste fires


@dataclass(frozen=True)
class Thresholds:
    kv_share_max: float = KV_SHARE_MAX
    block_waste_max: float = BLOCK_WASTE_MAX

    def __post_init__(self) -> None:
        for name in ("kv_share_max", "block_waste_max"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"diagnose threshold {name}={value!r}; allowed: a share from 0 to 1")


def waste_ratio(num_tokens: int, block_size: int) -> float:
    """Share of the token slots of ceil(num_tokens / block_size) blocks left empty."""
    num_slots = num_blocks_for(num_tokens, block_size) * block_size
    return (num_slots - num_tokens) / num_slots if num_slots else 0.0


def largest_block_size_within(num_tokens: int, block_size: int, max_waste: float) -> int:
    """The largest power of two below `block_size` that wastes at most `max_waste` (1 wastes nothing)."""
    size = block_size // 2
    while size > 1 and waste_ratio(num_tokens, size) > max_waste:
        size //= 2
    return max(size, 1)


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / MIB:,.1f} MiB"


def _size(num_bytes: int) -> str:
    """Exact bytes and a readable size, for a capacity to set: "20,480 B (20.0 KiB)"."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes:,} B ({num_bytes / size:,.1f} {unit})"
    return f"{num_bytes:,} B"


def find_flags(report: Report, thresholds: Thresholds = Thresholds()) -> list[Flag]:
    flags: list[Flag] = []
    for rule in (_prompt_spilled, _kv_share, _hot_fragmented, _tier_never_used, _block_size_waste,
                 _link_saturated, _cold_unavailable):
        flags.extend(rule(report, thresholds))
    return flags


def _hot_need_blocks(report: Report) -> int:
    """Hot blocks that hold the prompt's blocks under hot's high watermark (where the mover starts demoting)."""
    high = report.settings["hot.high_watermark"]
    return math.ceil(report.kv.blocks / high) if high > 0 else report.kv.blocks


def _prompt_spilled(report: Report, _: Thresholds) -> list[Flag]:
    kv, hot = report.kv, report.kv.tiers["hot"]
    if kv.blocks == 0 or hot.prompt_blocks >= kv.blocks:
        return []
    below = ", ".join(f"{kv.tiers[name].prompt_blocks} {name}" for name in ("warm", "cold")
                      if kv.tiers[name].prompt_blocks)
    need = _hot_need_blocks(report)
    key = report.settings["hot.capacity_key"]
    amount = f"{need} blocks" if key.endswith("_blocks") else _size(need * kv.block_bytes)
    return [Flag(
        "prompt_spilled",
        f"{kv.blocks - hot.prompt_blocks} of the prompt's {kv.blocks} blocks are below hot ({below}); hot holds "
        f"{hot.capacity_blocks} blocks ({_mib(hot.reserved_bytes)}), so attention gathers that history every step",
        key, f"raise {key} to at least {amount} ({kv.blocks} blocks under hot.high_watermark "
             f"{report.settings['hot.high_watermark']})",
        hot.prompt_blocks / kv.blocks, 1.0)]


def _kv_share(report: Report, thresholds: Thresholds) -> list[Flag]:
    totals = report.totals()
    share = totals["kv_share"]
    if share <= thresholds.kv_share_max:
        return []
    hot, kv = report.kv.tiers["hot"], report.kv
    key = report.settings["hot.capacity_key"]
    need = _hot_need_blocks(report)
    direction = f"lower {key}"
    if need < hot.capacity_blocks:
        direction += (f" (this prompt needs {need} blocks" if key.endswith("_blocks")
                      else f" (this prompt needs {_size(need * kv.block_bytes)}") + "; longer chats then move to warm)"
    return [Flag(
        "kv_share",
        f"the hot KV slab is {100 * share:.0f}% of the compute device's measured memory "
        f"({_mib(hot.reserved_bytes)} of {_mib(totals['device_bytes'])}); this prompt used "
        f"{100 * hot.prompt_bytes / max(hot.reserved_bytes, 1):.0f}% of it",
        key, direction, share, thresholds.kv_share_max)]


def _hot_fragmented(report: Report, _: Thresholds) -> list[Flag]:
    layout, settings, hot = report.layout, report.settings, report.kv.tiers["hot"]
    max_fragmentation, min_contiguity = settings["scheduler.max_fragmentation"], settings["scheduler.min_contiguity"]
    fragmented = layout.fragmentation > max_fragmentation
    scattered = layout.contiguity < min_contiguity
    hot_full = hot.used_blocks >= hot.capacity_blocks
    if scattered and not fragmented and hot_full and hot.prompt_blocks < report.kv.blocks:
        return []  # no free hot slot to compact into: prompt_spilled already says raise the hot capacity
    if not fragmented and not scattered:
        return []
    if fragmented:
        shows = f"hot pool fragmentation {layout.fragmentation:.2f} (> scheduler.max_fragmentation {max_fragmentation})"
        value, threshold = layout.fragmentation, max_fragmentation
    else:
        shows = (f"the prompt's hot blocks are {100 * layout.contiguity:.0f}% contiguous (< scheduler.min_contiguity "
                 f"{min_contiguity}): attention gathers them instead of reading one slice")
        value, threshold = layout.contiguity, min_contiguity
    if not settings["scheduler.background"]:
        key, direction = "scheduler.background", "set scheduler.background to true (the mover compacts the hot pool)"
    elif hot_full:
        key = settings["hot.capacity_key"]
        direction = f"raise {key} (compaction needs free hot slots to move blocks into)"
    elif fragmented:
        key, direction = "scheduler.max_fragmentation", "lower scheduler.max_fragmentation (compaction starts sooner)"
    else:
        key, direction = "scheduler.mover_interval_s", "lower scheduler.mover_interval_s (compaction runs sooner)"
    return [Flag("hot_fragmented", shows, key, direction, value, threshold)]


def _tier_never_used(report: Report, _: Thresholds) -> list[Flag]:
    flags = []
    for name in ("warm", "cold"):
        tier = report.kv.tiers[name]
        if tier.capacity_blocks == 0 or tier.touched or tier.used_blocks:
            continue  # off, used by this run, or holding blocks of earlier runs (cold: reused after restarts)
        key = report.settings[f"{name}.capacity_key"]
        flags.append(Flag(
            "tier_never_used",
            f"{name}: {tier.capacity_blocks} blocks ({_mib(tier.reserved_bytes)}) reserved, and this prompt of "
            f"{report.run.kv_tokens} tokens put nothing there",
            key, f"lower {key} (0 disables {name}) unless longer conversations need it",
            float(tier.reserved_bytes), 0.0))
    return flags


def _block_size_waste(report: Report, thresholds: Thresholds) -> list[Flag]:
    kv = report.kv
    if kv.waste_ratio <= thresholds.block_waste_max:
        return []
    smaller = largest_block_size_within(kv.tokens, kv.block_size_tokens, thresholds.block_waste_max)
    return [Flag(
        "block_size_waste",
        f"{kv.waste_slots} of the prompt's {kv.blocks * kv.block_size_tokens} token slots are empty "
        f"({100 * kv.waste_ratio:.0f}%, {_mib(kv.waste_bytes)}) in its partly filled last block of "
        f"{kv.block_size_tokens} tokens",
        "block_size", f"lower block_size to {smaller} (wastes {100 * waste_ratio(kv.tokens, smaller):.0f}% here)",
        kv.waste_ratio, thresholds.block_waste_max)]


def _link_saturated(report: Report, _: Thresholds) -> list[Flag]:
    link, threshold = report.link, report.settings["scheduler.bs_threshold"]
    if link.saturation_peak <= threshold:
        return []
    key = report.settings["hot.capacity_key"]
    return [Flag(
        "link_saturated",
        f"link saturation peaked at {link.saturation_peak:.2f} ({link.monitor} monitor), above "
        f"scheduler.bs_threshold {threshold}: background moves wait",
        key, f"raise {key} (fewer blocks cross the link)", link.saturation_peak, threshold)]


def _cold_unavailable(report: Report, _: Thresholds) -> list[Flag]:
    cold = report.kv.tiers["cold"]
    if not report.settings["cold.configured"] or not cold.location.startswith("unavailable"):
        return []
    return [Flag("cold_unavailable", f"cold is configured but {cold.location}", "cold.path",
                 "run fewer stores at once on this cold.path, or give this one its own (it reads the others' records "
                 "there but writes none)", 1.0, 0.0)]
