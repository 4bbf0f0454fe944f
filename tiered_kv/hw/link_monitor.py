"""Link saturation (BS): how busy the host<->device link is, in [0, 1].

NvmlLinkMonitor reads PCIe TX+RX throughput from NVML and divides by the link's peak.
MeasuredLinkMonitor (no GPU / no NVML) divides the store's own measured copy rate by a
calibrated peak. Both have `saturation()`; `make_link_monitor` picks one at start and never
raises when NVML is missing.
"""

from __future__ import annotations

import time


class MeasuredLinkMonitor:
    name = "measured"

    def __init__(self, peak_bytes_per_s: float = 10e9, window_s: float = 1.0):
        self.peak_bytes_per_s = peak_bytes_per_s
        self.window_s = window_s
        self._events: list[tuple[float, int]] = []

    def record(self, num_bytes: int) -> None:
        now = time.monotonic()
        self._events.append((now, num_bytes))
        cutoff = now - self.window_s
        while self._events and self._events[0][0] < cutoff:
            self._events.pop(0)

    def saturation(self) -> float:
        now = time.monotonic()
        moved = sum(n for t, n in self._events if t >= now - self.window_s)
        return min(1.0, moved / self.window_s / self.peak_bytes_per_s)


class NvmlLinkMonitor(MeasuredLinkMonitor):
    name = "nvml"

    def __init__(self, device_index: int):
        super().__init__()
        import pynvml

        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        gen = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(self._handle)
        width = pynvml.nvmlDeviceGetMaxPcieLinkWidth(self._handle)
        per_lane_bytes = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}.get(gen, 1.969e9)
        self.peak_bytes_per_s = per_lane_bytes * width

    def saturation(self) -> float:
        nvml = self._nvml
        tx_kib = nvml.nvmlDeviceGetPcieThroughput(self._handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
        rx_kib = nvml.nvmlDeviceGetPcieThroughput(self._handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
        return min(1.0, max(tx_kib, rx_kib) * 1024 / self.peak_bytes_per_s)


def make_link_monitor(device) -> MeasuredLinkMonitor:
    if getattr(device, "type", "cpu") == "cuda":
        try:
            import pynvml

            pynvml.nvmlInit()
            return NvmlLinkMonitor(device.index or 0)
        except Exception:  # NVMLError_LibraryNotFound, no driver, no permission
            pass
    return MeasuredLinkMonitor()
