"""Prometheus export of the stores' metrics, with prometheus_client.

At each scrape a collector reads every live store (or the ones given): the counters and
histograms of its Metrics (registry.py), summed over stores, and gauges read from the store
at that moment (blocks and bytes used and reserved per tier, link saturation, the calibrated
agreement of each compression mode). Every name
starts with `tiered_kv_` and carries its unit; counters end in `_total`.
"""

from __future__ import annotations

import errno
import threading

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..blocks import TIER_NAMES
from ..errors import MetricsPortError
from .registry import Counter, Histogram, Metrics
from .stores import live_stores

PREFIX = "tiered_kv_"



def _metrics_of(source) -> Metrics | None:
    """A Metrics from a Metrics, a TierStore or a CacheBank (None: a closed one)."""
    if isinstance(source, Metrics):
        return source
    store = getattr(source, "store", source)
    if getattr(store, "is_closed", False):
        return None
    return getattr(store, "metrics", None)


def _store_of(source):
    store = getattr(source, "store", source)
    return None if isinstance(store, Metrics) or getattr(store, "is_closed", True) else store


class StoreCollector:
    """A prometheus_client collector over live stores (`sources` None) or the given ones."""

    def __init__(self, sources=None):
        self._sources = None if sources is None else list(sources)

    def _sources_now(self) -> list:
        return live_stores() if self._sources is None else self._sources

    def collect(self):
        sources = self._sources_now()
        all_metrics = [m for m in map(_metrics_of, sources) if m is not None]
        if all_metrics:
            for i, family in enumerate(all_metrics[0].families):
                peers = [m.families[i] for m in all_metrics]
                yield _counter(peers) if isinstance(family, Counter) else _histogram(peers)
        yield from _gauges([s for s in map(_store_of, sources) if s is not None])

    def describe(self):
        return []  # names depend on the stores alive at scrape time


def _counter(families: list[Counter]) -> CounterMetricFamily:
    first = families[0]
    out = CounterMetricFamily(PREFIX + first.name, first.help, labels=list(first.labelnames))
    totals: dict[tuple, float] = {}
    for family in families:
        for labels, value in family.snapshot_values():
            totals[labels] = totals.get(labels, 0) + value
    for labels, value in sorted(totals.items()):
        out.add_metric([str(v) for v in labels], value)
    return out


def _histogram(families: list[Histogram]) -> HistogramMetricFamily:
    first = families[0]
    out = HistogramMetricFamily(PREFIX + first.name, first.help, labels=list(first.labelnames))
    merged: dict[tuple, list] = {}
    for family in families:
        for labels, counts, total in family.snapshot_series():
            into = merged.setdefault(labels, [[0] * len(counts), 0.0])
            into[0] = [a + b for a, b in zip(into[0], counts)]
            into[1] += total
    for labels, (counts, total) in sorted(merged.items()):
        cumulative, running = [], 0
        for bound, n in zip((*first.buckets, float("inf")), counts):
            running += n
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        out.add_metric([str(v) for v in labels], cumulative, sum_value=total)
    return out


def _gauges(stores: list):
    """What the stores hold right now, summed over stores: blocks and bytes per tier, used and
    reserved; the link saturation (the highest of any store); how many stores and chats."""
    used_blocks = GaugeMetricFamily(PREFIX + "used_blocks", "Blocks held per tier", labels=["tier"])
    capacity_blocks = GaugeMetricFamily(PREFIX + "capacity_blocks", "Block slots reserved per tier", labels=["tier"])
    used_bytes = GaugeMetricFamily(PREFIX + "used_bytes", "Bytes of the blocks held per tier", labels=["tier"])
    capacity_bytes = GaugeMetricFamily(PREFIX + "capacity_bytes", "Bytes reserved per tier", labels=["tier"])
    saturation = GaugeMetricFamily(PREFIX + "link_saturation_ratio",
                                   "Host-device link load, 0..1 (NVML PCIe throughput, or bytes moved on CPU)")
    num_stores = GaugeMetricFamily(PREFIX + "stores", "TierStores alive in this process")
    num_chats = GaugeMetricFamily(PREFIX + "chats", "Chats the stores' schedulers track")
    agreement = GaugeMetricFamily(PREFIX + "compression_agreement_ratio", "Next-token agreement of a compression "
                                  "mode with the uncompressed cache, measured on the store's model (compression/"
                                  "auto.py; the lowest of the stores)", labels=["mode"])
    attention = GaugeMetricFamily(PREFIX + "attention_mass_share", "Share of the attention mass of the latest "
                                  "sampled decode step each tier served (bank/attention_stats.py; the stores' mean)",
                                  labels=["tier"])
    shares: dict[str, list[float]] = {}
    lowest: dict[str, float] = {}
    totals = {name: [0, 0, 0, 0] for name in TIER_NAMES}
    link, chats = 0.0, 0
    for store in stores:
        pools, layout = list(store.pools), store.layout
        if layout is not None:
            for t, pool in enumerate(pools):
                row = totals[TIER_NAMES[t]]
                row[0] += pool.num_used
                row[1] += pool.num_slots
                tier = store.tiers[t] if t < len(store.tiers) else None
                block_bytes = tier.layout.block_bytes if tier is not None else layout.block_bytes  # as stored
                row[2] += pool.num_used * block_bytes
                row[3] += pool.num_slots * block_bytes
        link = max(link, float(store.link_monitor.saturation()))
        chats += len(store.access_log.chats)
        placement = getattr(store, "placement", None)
        for tier, share in (getattr(placement, "attention_shares", None) or {}).items():
            shares.setdefault(tier, []).append(share)
        for mode, value in store.compression.measured.items():
            lowest[mode] = min(value, lowest.get(mode, value))
    for name, (ub, cb, uB, cB) in totals.items():
        used_blocks.add_metric([name], ub)
        capacity_blocks.add_metric([name], cb)
        used_bytes.add_metric([name], uB)
        capacity_bytes.add_metric([name], cB)
    saturation.add_metric([], link)
    num_stores.add_metric([], len(stores))
    num_chats.add_metric([], chats)
    for mode, value in sorted(lowest.items()):
        agreement.add_metric([mode], value)
    for tier, values in sorted(shares.items()):
        attention.add_metric([tier], sum(values) / len(values))
    yield from (used_blocks, capacity_blocks, used_bytes, capacity_bytes, saturation, num_stores, num_chats, agreement,
                attention)


def _registry(stores) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(stores))
    return registry


def exposition(stores=None) -> str:
    return generate_latest(_registry(stores)).decode("utf-8")


class MetricsServer:
    """A running /metrics endpoint. `close()` stops it (also a context manager)."""

    def __init__(self, httpd, thread: threading.Thread, host: str):
        self._httpd = httpd
        self._thread = thread
        self.host = host
        self.port = int(httpd.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            self._httpd = None

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(port: int, host: str = "127.0.0.1", *, stores=None) -> MetricsServer:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port {port!r}: allowed: an integer from 0 (any free port) to 65535")
    try:
        httpd, thread = start_http_server(port, addr=host, registry=_registry(stores))
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise MetricsPortError(f"metrics port {port} on {host} is already in use; "
                                   "choose another port (or 0 for any free one)") from None
        if error.errno == errno.EACCES:
            raise MetricsPortError(f"metrics port {port} on {host}: permission denied; "
                                   "ports below 1024 need privileges, choose one from 1024 to 65535") from None
        raise MetricsPortError(f"metrics port {port} on {host}: cannot listen "
                               f"({error.strerror or error})") from None
    return MetricsServer(httpd, thread, host)
