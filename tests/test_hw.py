"""Hardware paths are chosen once at start and fall back cleanly without a GPU. On a machine
with CUDA the same checks run against the real device paths."""

from __future__ import annotations

import pytest
import torch

import tiered_kv
from helpers import tier_config, tiny_model
from tiered_kv.hw.block_io import PosixBlockIO, kvikio_usable
from tiered_kv.hw.copy_engine import CpuCopyEngine, CudaCopyEngine, make_copy_engine
from tiered_kv.hw.devices import resolve_device, resolve_pinned
from tiered_kv.hw.link_monitor import MeasuredLinkMonitor, make_link_monitor

HAS_CUDA = torch.cuda.is_available()


def test_auto_device_follows_cuda_availability():
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_pinned("auto", torch.device("cpu")) is False
    assert resolve_pinned("false", resolve_device("auto")) is False


@pytest.mark.skipif(HAS_CUDA, reason="checks the error a CPU-only machine gives")
def test_cuda_requested_without_gpu_is_a_config_error():
    with pytest.raises(tiered_kv.ConfigError, match=r"hot.device.*'cuda:1'.*no CUDA device"):
        resolve_device("cuda:1")
    with pytest.raises(tiered_kv.ConfigError, match="warm.pinned"):
        resolve_pinned("true", torch.device("cpu"))
    with pytest.raises(tiered_kv.ConfigError, match="hot.device"):
        tiered_kv.TierStore({"hot": {"device": "cuda"}, "cold": {"capacity_blocks": 0, "path": "/tmp"}})


def test_copy_engine_and_link_monitor_are_picked_for_the_device():
    device = resolve_device("auto")
    engine = make_copy_engine(device)
    assert isinstance(engine, CudaCopyEngine if HAS_CUDA else CpuCopyEngine)
    monitor = make_link_monitor(device)
    assert isinstance(monitor, MeasuredLinkMonitor)  # NvmlLinkMonitor is a subclass
    assert 0.0 <= monitor.saturation() <= 1.0
    # without NVML (a cpu device never asks it) the measured rate is the signal
    measured = make_link_monitor(torch.device("cpu"))
    assert type(measured) is MeasuredLinkMonitor and measured.saturation() == 0.0
    measured.record(int(measured.peak_bytes_per_s * measured.window_s / 2))
    assert measured.saturation() == pytest.approx(0.5, rel=0.05)


def test_copy_engine_copies_exactly():
    device = resolve_device("auto")
    engine = make_copy_engine(device)
    src = torch.randn(3, 5, device=device)
    host = torch.empty(3, 5, pin_memory=HAS_CUDA)
    engine.copy(host, src)
    engine.before_host_read()
    assert torch.equal(host, src.cpu())
    back = torch.empty(3, 5, device=device)
    engine.copy(back, host)
    engine.before_device_use()
    assert torch.equal(back, src)


def test_cold_backend_auto_is_posix_without_cuda(tmp_path):
    model = tiny_model("llama")
    bank = tiered_kv.CacheBank(model.config, tier_config("forces_cold", tmp_path))
    model.generate(torch.randint(3, 200, (1, 30)), cache=bank, max_new_tokens=2, do_sample=False)
    cold_io = bank.store.tiers[2].io
    assert cold_io.name == ("kvikio" if kvikio_usable() else "posix")
    if not kvikio_usable():
        assert type(cold_io) is PosixBlockIO
    bank.close()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_tiers_match_dynamic_cache(tmp_path):
    from transformers import DynamicCache

    model = tiny_model("llama").to("cuda")
    for kind in ("all_hot", "forces_warm", "forces_cold"):
        config = tier_config(kind, tmp_path / kind)
        config["hot"]["device"] = "cuda"
        bank = tiered_kv.CacheBank(model.config, config)
        assert bank.store.pinned is True
        ids = torch.randint(3, 200, (1, 21), device="cuda")
        out_bank = model.generate(ids, cache=bank, max_new_tokens=8, do_sample=False)
        out_dyn = model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=8, do_sample=False)
        assert torch.equal(out_bank, out_dyn), kind
        bank.close()
