"""Link saturation (BS): how busy the host<->device link is, in [0, 1].

NvmlLinkMonitor samples PCIe TX+RX throughput from NVML on a background thread (never on the
decode path) and divides by the link's peak (from its generation and width). Without a GPU or
NVML, MeasuredLinkMonitor divides the store's own copy rate over the last `window_s` by a peak
calibrated once at start (a timed host copy). Both offer `record(bytes)` and `saturation()`;
`make_link_monitor` picks one at start and never raises when NVML is missing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

from ..logs import log_once

log = logging.getLogger(__name__)

CALIBRATION_BYTES = 32 * 2**20
PCIE_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}


_CALIBRATED: dict[str, float] = {}  # device -> peak bytes/s, measured once per process


def calibrate_copy_peak(device: torch.device, num_bytes: int = CALIBRATION_BYTES, repeats: int = 3) -> float:
    """Bytes per second of the fastest of `repeats` copies of `num_bytes` (host->device, or
    host->host without a GPU). Measured once per device per process."""
    if str(device) in _CALIBRATED:
        return _CALIBRATED[str(device)]
    src = torch.empty(num_bytes, dtype=torch.uint8)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best_s = min(best_s, time.perf_counter() - start)
    _CALIBRATED[str(device)] = num_bytes / max(best_s, 1e-9)
    return _CALIBRATED[str(device)]


class MeasuredLinkMonitor:
    name = "measured"

    def __init__(self, peak_bytes_per_s: float = 10e9, window_s: float = 1.0):
        self.peak_bytes_per_s = peak_bytes_per_s
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()  # the mover and the banks' threads both record
        self.closed = False

    def record(self, num_bytes: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._events.append((now, num_bytes))
            self._trim(now)

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        while self._events and self._events[0][0] < cutoff:
            self._events.popleft()

    def saturation(self) -> float:
        with self._lock:
            self._trim(time.monotonic())
            moved = sum(n for _, n in self._events)
        return min(1.0, moved / self.window_s / self.peak_bytes_per_s)

    def close(self) -> None:
        self.closed = True


class NvmlLinkMonitor(MeasuredLinkMonitor):
    name = "nvml"

    def __init__(self, device_index: int, sample_interval_s: float = 0.1):
        super().__init__()
        import pynvml

        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        gen = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(self._handle)
        width = pynvml.nvmlDeviceGetMaxPcieLinkWidth(self._handle)
        self.peak_bytes_per_s = PCIE_LANE_BYTES_PER_S.get(gen, PCIE_LANE_BYTES_PER_S[4]) * width
        self.sample_interval_s = sample_interval_s
        self._last = self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiered_kv-nvml", daemon=True)
        self._thread.start()

    def _sample(self) -> float:
        nvml = self._nvml
        tx_kib = nvml.nvmlDeviceGetPcieThroughput(self._handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
        rx_kib = nvml.nvmlDeviceGetPcieThroughput(self._handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
        return min(1.0, (tx_kib + rx_kib) * 1024 / self.peak_bytes_per_s)

    def _run(self) -> None:
        while not self._stop.wait(self.sample_interval_s):
            try:
                self._last = self._sample()
            except Exception:  # a transient NVML error: keep the last value
                pass

    def saturation(self) -> float:
        return self._last  # sampled by the thread; reading it costs nothing

    def close(self) -> None:
        """Stop the sampler thread and wait for it (it wakes every sample_interval_s)."""
        self.closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def make_link_monitor(device) -> MeasuredLinkMonitor:
    """NVML when the hot tier is a CUDA device and NVML answers; else a monitor of our own
    copies over a peak calibrated now."""
    if getattr(device, "type", "cpu") == "cuda":
        try:
            import pynvml

            pynvml.nvmlInit()
            return NvmlLinkMonitor(device.index or 0)
        except Exception as exc:  # NVMLError_LibraryNotFound, no driver, no permission
            why = f"NVML unavailable ({type(exc).__name__}: {exc})"
    else:
        why = f"no NVML for a {getattr(device, 'type', 'cpu')} hot tier"
    device = device if device is not None else torch.device("cpu")
    monitor = MeasuredLinkMonitor(peak_bytes_per_s=calibrate_copy_peak(device))
    log_once(log, logging.INFO, "link saturation: %s; measuring the store's own copies against a peak of "
             "%.1f GB/s calibrated on %s", why, monitor.peak_bytes_per_s / 1e9, device)
    return monitor
