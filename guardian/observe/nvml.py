"""NVML, for what it can tell on this box. Missing NVML (tests, CI, no GPU) is normal, and so
is NOT_SUPPORTED for device memory on GB10 (per-process memory still works there)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..core.fit import startfit
from ..core.observations import GpuLife


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

    def life(self) -> tuple[GpuLife, ...]:
        """Each device's power draw and utilization, each None where the driver does not report it;
        () without NVML, or when no device reports either."""
        if not self.available:
            return ()
        out = [self._life_of(i) for i in range(self.count)]
        return tuple(g for g in out if g is not None and (g.power_w is not None or g.util_pct is not None))

    def _life_of(self, index: int) -> GpuLife | None:
        n = self._n
        try:
            h = n.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001 - a device NVML cannot open says nothing
            return None
        power_w = _asked(lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0)  # milliwatts
        util_pct = _asked(lambda: n.nvmlDeviceGetUtilizationRates(h).gpu)
        return GpuLife(index, power_w, util_pct)


def _asked(query: Callable[[], float]) -> float | None:
    try:
        return float(query())
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and its siblings: not reported
        return None


# Devices whose memory is the box's: NVML answers NOT_SUPPORTED for their memory on most drivers
# (nvidia-smi "Not Supported"), but not on every one (a GB10 driver was seen answering it): the name
# decides too. Per-process memory (usedGpuMemory) is reported on GB10 (nvidia-smi
# --query-compute-apps=used_memory returns real values there).
UNIFIED_NAMES = ("GB10",)


@functools.cache
def shared() -> Nvml:
    """One NVML handle for the process (nvmlInit once)."""
    return Nvml()


@functools.cache
def unified_memory_gpu() -> bool:
    """Device 0's memory is the box's own: NVML answers NOT_SUPPORTED for it, or it is a device known
    to share the box's memory (UNIFIED_NAMES). False for a GPU with memory of its own, and where
    there is no NVML or no GPU."""
    n = shared()
    if not n.available or not n.count:
        return False
    try:
        handle = n._n.nvmlDeviceGetHandleByIndex(0)
        name = n._n.nvmlDeviceGetName(handle)
        if any(u in (name.decode() if isinstance(name, bytes) else str(name)) for u in UNIFIED_NAMES):
            return True
        n._n.nvmlDeviceGetMemoryInfo(handle)
    except n._n.NVMLError_NotSupported:
        return True
    except Exception:  # noqa: BLE001 - any other NVML failure says nothing about the memory
        return False
    return False


def describe(unified: bool | str) -> str:
    """Which source guardian's memory figures come from on this box, for the journal at start."""
    n = shared()
    if unified is True or unified is False:
        setting = f"memory.unified = {'true' if unified else 'false'}"
        what = "the GPU's memory is the box's" if unified else "the GPU has memory of its own"
        return f"{n.note}; {what} ({setting}): MemFree, MemAvailable and the page cache from /proc/meminfo"
    if unified_memory_gpu():
        return (
            f"{n.note}; device 0's memory is the box's (unified: NVML does not report it): MemFree, MemAvailable and "
            "the page cache from /proc/meminfo, each process's memory from NVML where the driver reports it; a "
            f"start's fit is judged ({startfit.FITS.id}-{startfit.NO_FIT.id})"
        )
    if n.device_total_bytes() is not None:
        return f"{n.note}; device 0 has memory of its own: a start's fit is not judged ({startfit.NOT_UNIFIED.id})"
    how = "memory.unified = true to judge it"
    return f"{n.note}; no GPU seen: a start's fit is not judged ({startfit.NOT_UNIFIED.id}; {how})"
