"""The stores alive in this process, whose metrics a Prometheus scrape reports (weakly held)."""

from __future__ import annotations

import weakref

_LIVE: "weakref.WeakSet" = weakref.WeakSet()


def register_store(store) -> None:
    """Called by every TierStore when it is made; a closed or collected store stops being reported."""
    _LIVE.add(store)


def live_stores() -> list:
    return [store for store in list(_LIVE) if not store.is_closed]
