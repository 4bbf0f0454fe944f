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
    for t in batch.failed:
        entry = state.index.peek(t.block_id)
        if t.kind == MOVE and t.dst_tier == COLD and entry is not None and entry.ref_count == 0 \
                and entry.tier == t.src_tier and not state.is_pinned(t.block_id):
            dropped += state.evict(t.block_id)
    state.report_evictions(dropped, "a failed write into cold")


def report(metrics, warnings, batch: TransferBatch, error: BaseException) -> None:
    """Counted always; one warning per interval (a full disk fails every batch): what failed,
    why (the errno name, the file), and that the blocks stay where they were."""
    metrics.failed_moves.inc((batch.mode, error_name(error)), len(batch.failed))
    if batch.quiet:
        return
    directions: dict[str, int] = {}
    for t in batch.failed:
        direction = f"{TIER_NAMES[t.src_tier] if t.src_tier >= 0 else 'host'}->{TIER_NAMES[t.dst_tier]}"
        directions[direction] = directions.get(direction, 0) + 1
    sources = sorted({TIER_NAMES[t.src_tier] for t in batch.failed if t.src_tier >= 0})
    where = f", {error.filename}" if getattr(error, "filename", None) else ""
    warnings.warning(
        "%s move of %d block(s) (%s) failed (%s: %s%s): nothing moved, they stay in %s",
        "background" if batch.mode == BACKGROUND else "on-demand", len(batch.failed),
        ", ".join(f"{n} {d}" for d, n in directions.items()), error_name(error),
        getattr(error, "strerror", None) or error, where, " and ".join(sources) or "place")
