"""What a failed transfer batch leaves behind (transfers.py calls these from `complete`): the
failure counted and said (one warning per interval: a full disk fails every batch), and the cached
blocks whose move into cold could not be written dropped (they were only a cache copy; the room
they held above is what the caller needed), so a failed cold write costs the copy, never the step."""

from __future__ import annotations

from ..blocks import COLD, TIER_NAMES
from ..logs import error_name
from ..metrics.registry import BACKGROUND
from .batches import TransferBatch
from .copies import MOVE


def drop_cached_that_failed_into_cold(state, batch: TransferBatch) -> None:
    """A cached block (no chat holds it) whose move into cold failed to write is dropped: it was
    only a cache copy, and the room it held above is what the caller needed."""
    dropped = 0
    for group, positions in batch.failed_parts:
        if group.kind != MOVE or group.dst_tier != COLD:
            continue
        for block_id in group.block_ids[positions].tolist():
            entry = state.index.peek(block_id)
            if entry is not None and entry.ref_count == 0 and entry.tier == group.src_tier \
                    and not state.is_pinned(block_id):
                dropped += state.evict(block_id)
    state.report_evictions(dropped, "a failed write into cold")


def report(metrics, warnings, batch: TransferBatch, error: BaseException) -> None:
    """Counted always; one warning per interval (a full disk fails every batch): what failed,
    why (the errno name, the file), and that the blocks stay where they were."""
    num_failed = batch.num_failed
    metrics.failed_moves.inc((batch.mode, error_name(error)), num_failed)
    if batch.quiet:
        return
    directions: dict[str, int] = {}
    for group, positions in batch.failed_parts:
        source = TIER_NAMES[group.src_tier] if group.src_tier >= 0 else "host"
        direction = f"{source}->{TIER_NAMES[group.dst_tier]}"
        directions[direction] = directions.get(direction, 0) + len(positions)
    sources = sorted({TIER_NAMES[g.src_tier] for g, positions in batch.failed_parts if g.src_tier >= 0 and len(positions)})
    where = f", {error.filename}" if getattr(error, "filename", None) else ""
    warnings.warning(
        "%s move of %d block(s) (%s) failed (%s: %s%s): nothing moved, they stay in %s",
        "background" if batch.mode == BACKGROUND else "on-demand", num_failed,
        ", ".join(f"{n} {d}" for d, n in directions.items()), error_name(error),
        getattr(error, "strerror", None) or error, where, " and ".join(sources) or "place")
