"""Hardware paths are chosen once at start and fall back cleanly without a GPU. On a machine
with CUDA the same checks run against the real device paths."""

from __future__ import annotations

import pytest
import torch

import tiered_kv
from helpers import tier_config, tiny_model
from tiered_kv.hw.block_io import PosixBlockIO, kvikio_usable
from tiered_kv.hw.copy_engine import CudaCopyEngine, SyncCopyEngine, ThreadCopyEngine, make_copy_engine
from tiered_kv.hw.devices import resolve_device, resolve_pinned
from tiered_kv.hw.link_monitor import MeasuredLinkMonitor, make_link_monitor

HAS_CUDA = torch.cuda.is_available()


def test_auto_device_follows_cuda_availability():
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_pinned("auto", torch.device("cpu")) is False
    assert resolve_pinned("false", resolve_device("auto")) is False


def test_a_cuda_device_that_is_not_there_is_a_config_error():
    missing = f"cuda:{torch.cuda.device_count() if HAS_CUDA else 1}"
    with pytest.raises(tiered_kv.ConfigError, match=rf"hot.device.*'{missing}'"):
        resolve_device(missing)
    if not HAS_CUDA:
        with pytest.raises(tiered_kv.ConfigError, match="warm.pinned"):
            resolve_pinned("true", torch.device("cpu"))
        with pytest.raises(tiered_kv.ConfigError, match="hot.device"):
            tiered_kv.TierStore({"hot": {"device": "cuda"}, "cold": {"capacity_blocks": 0, "path": "/tmp"}})


def test_copy_engine_and_link_monitor_are_picked_for_the_device():
    device = resolve_device("auto")
    engine = make_copy_engine(device)
    assert isinstance(engine, CudaCopyEngine if HAS_CUDA else SyncCopyEngine)
    assert isinstance(make_copy_engine(device, "sync"), SyncCopyEngine)
    threaded = make_copy_engine(device, "thread", 250)
    assert isinstance(threaded, ThreadCopyEngine) and threaded.delay_s == 0.00025
    threaded.close()
    monitor = make_link_monitor(device)
    assert isinstance(monitor, MeasuredLinkMonitor)  # NvmlLinkMonitor is a subclass
    assert 0.0 <= monitor.saturation() <= 1.0
    # without NVML (a cpu device never asks it) the measured rate is the signal
    measured = make_link_monitor(torch.device("cpu"))
    assert type(measured) is MeasuredLinkMonitor and measured.saturation() == 0.0
    measured.record(int(measured.peak_bytes_per_s * measured.window_s / 2))
    assert measured.saturation() == pytest.approx(0.5, rel=0.05)


ENGINES = ["sync", "thread"] + (["auto"] if HAS_CUDA else [])


@pytest.mark.parametrize("kind", ENGINES)
def test_every_copy_engine_copies_exactly_and_its_event_passes_after_the_copy(kind):
    device = resolve_device("auto")
    engine = make_copy_engine(device, kind)
    try:
        src = torch.randn(3, 5, device=device)
        host = torch.empty(3, 5, pin_memory=HAS_CUDA)
        event = engine.submit(lambda: host.copy_(src, non_blocking=True))
        event.wait()
        assert event.done() and event.error is None
        assert torch.equal(host, src.cpu())
        back = torch.empty(3, 5, device=device)
        engine.submit(lambda: back.copy_(host, non_blocking=True)).wait()
        assert torch.equal(back, src)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ENGINES)
def test_an_error_in_a_unit_is_kept_on_its_event_and_never_raised_by_submit(kind):
    engine = make_copy_engine(resolve_device("auto"), kind)
    try:
        def fails():
            raise MemoryError("injected: out of memory")

        event = engine.submit(fails)
        event.wait()
        assert isinstance(event.error, MemoryError)
        later = engine.submit(lambda: None)  # the engine goes on
        later.wait()
        assert later.error is None
    finally:
        engine.close()


def test_the_thread_engine_runs_units_later_and_in_order_like_a_stream():
    """Its events are not passed until the unit ran, whatever the submitting thread does; units
    run in submission order; close() runs what is queued, then stops its thread."""
    import threading

    engine = ThreadCopyEngine(delay_us=200)
    gate, order = threading.Event(), []
    first = engine.submit(lambda: (gate.wait(10), order.append(1)))
    second = engine.submit(lambda: order.append(2))
    assert not first.done() and not second.done()
    gate.set()
    second.wait()
    assert first.done() and order == [1, 2]
    third = engine.submit(lambda: order.append(3))
    engine.close()
    assert third.done() and order == [1, 2, 3]
    assert not engine._thread.is_alive()
    refused = engine.submit(lambda: order.append(4))
    assert refused.done() and isinstance(refused.error, RuntimeError) and order == [1, 2, 3]


def test_cold_backend_auto_is_posix_without_cuda(tmp_path):
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model, tier_config("forces_cold", tmp_path))
    model.generate(torch.randint(3, 200, (1, 30)), cache=bank, max_new_tokens=2, do_sample=False)
    cold_io = bank.store.tiers[2].io
    assert cold_io.name == ("kvikio" if kvikio_usable() else "posix")
    if not kvikio_usable():
        assert type(cold_io) is PosixBlockIO
    bank.close()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_every_tier_setup_matches_dynamic_cache_on_each_device(device, tmp_path):
    """The same check on every device this machine has: on a GPU machine the hot tier is HBM,
    the warm slab is pinned and moves run on the side stream."""
    from transformers import DynamicCache

    model = tiny_model("llama").to(device)
    for kind in ("all_hot", "forces_warm", "forces_cold"):
        config = tier_config(kind, tmp_path / kind)
        config["hot"]["device"] = device
        bank = tiered_kv.CacheBank(model, config)
        assert bank.store.pinned is (device == "cuda")
        ids = torch.randint(3, 200, (1, 21), device=device)
        out_bank = model.generate(ids, cache=bank, max_new_tokens=8, do_sample=False)
        out_dyn = model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=8, do_sample=False)
        assert torch.equal(out_bank, out_dyn), kind
        bank.close()
