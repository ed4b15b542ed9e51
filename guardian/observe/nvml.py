"""NVML, for what it can tell on this box. Missing NVML (tests, CI, no GPU) is normal, and so
is NOT_SUPPORTED for device memory on GB10 (per-process memory still works there)."""

from __future__ import annotations

import functools


class Nvml:
    def __init__(self) -> None:
        self.available = False
        self.note = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            self._n = pynvml
            self.count = pynvml.nvmlDeviceGetCount()
            self.available = True
            self.note = f"NVML: {self.count} device(s)"
        except Exception as e:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            self.note = f"NVML not available ({type(e).__name__}: {e}): memory from /proc only"

    def device_total_bytes(self) -> int | None:
        """Total memory of device 0, or None (no NVML, or NOT_SUPPORTED as on GB10)."""
        if not self.available or not self.count:
            return None
        try:
            return int(self._n.nvmlDeviceGetMemoryInfo(self._n.nvmlDeviceGetHandleByIndex(0)).total)
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported (GB10) and its siblings: NVML cannot say
            return None

    def process_memory(self) -> dict[int, int] | None:
        """PID -> bytes of device memory, from every device; None when NVML cannot say."""
        if not self.available:
            return None
        out: dict[int, int] = {}
        try:
            for i in range(self.count):
                h = self._n.nvmlDeviceGetHandleByIndex(i)
                for p in self._n.nvmlDeviceGetComputeRunningProcesses(h):
                    if p.usedGpuMemory is not None:
                        out[p.pid] = out.get(p.pid, 0) + int(p.usedGpuMemory)
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported (GB10) and its siblings: NVML cannot say
            return None
        return out


@functools.cache
def unified_memory_gpu() -> bool:
    """Device 0's memory is the box's own: NVML answers NOT_SUPPORTED for it, as on GB10. False for a
    GPU with memory of its own, and where there is no NVML or no GPU."""
    n = Nvml()
    if not n.available or not n.count:
        return False
    try:
        n._n.nvmlDeviceGetMemoryInfo(n._n.nvmlDeviceGetHandleByIndex(0))
    except n._n.NVMLError_NotSupported:
        return True
    except Exception:  # noqa: BLE001 - any other NVML failure says nothing about the memory
        return False
    return False
