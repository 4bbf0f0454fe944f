"""Metrics: counters and histograms per tier, kept by each store, exported in Prometheus format.

    bank.stats()["metrics"]                       # a snapshot of the bank's store's metrics
    server = tiered_kv.metrics.serve(9400)        # http://127.0.0.1:9400/metrics, every live store
    server.close()
    tiered_kv.metrics.exposition()                # the same text, without a server

registry.py keeps the numbers (no torch, no prometheus_client); export.py formats them.
"""

from .registry import Metrics
from .stores import live_stores, register_store


def serve(port: int, host: str = "127.0.0.1", *, stores=None):
    """Serve Prometheus text on http://host:port/metrics in a daemon thread; returns a MetricsServer
    (`.port`, `.url`, `.close()`). Binds 127.0.0.1 unless told otherwise; port 0 takes a free one.
    Raises MetricsPortError naming the port when it is taken. See export.py."""
    from .export import serve as _serve

    return _serve(port, host, stores=stores)


def exposition(stores=None) -> str:
    """The Prometheus text of every live store's metrics (or of `stores`: stores, banks or Metrics)."""
    from .export import exposition as _exposition

    return _exposition(stores)


__all__ = ["Metrics", "exposition", "live_stores", "register_store", "serve"]
