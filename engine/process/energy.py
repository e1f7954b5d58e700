"""The engine machine's energy counters, for the frontends' /energy_metrics (TensorRT-LLM's
route): CPU RAPL domains through Linux's powercap files, and NVIDIA GPUs through NVML
(nvidia-ml-py, where it is installed and a driver answers). Each counter is reported as it
reads, in joules; a scraper takes differences for power. A machine with neither (a VM, a
container without /sys/class/powercap, energy_uj readable by root only) reports nothing,
which the frontend answers with a 404.
"""

from __future__ import annotations

import glob
import logging
import os

from shared.protocol import EnergyReading

log = logging.getLogger("sluice.engine")

# Where the powercap zones are; tests (and unusual mounts) point it elsewhere.
POWERCAP_ENV = "SLUICE_POWERCAP_DIR"
POWERCAP_DIR = "/sys/class/powercap"


def rapl_readings(root: str | None = None) -> list[EnergyReading]:
    """Every RAPL zone with a readable counter (`intel-rapl:0` a package, `intel-rapl:0:0`
    its core domain, and so on; AMD's CPUs appear under the same names). Zones nest, so
    they are listed apart, never summed."""
    root = root or os.environ.get(POWERCAP_ENV) or POWERCAP_DIR
    readings = []
    for zone in sorted(glob.glob(os.path.join(root, "intel-rapl*"))):
        try:
            with open(os.path.join(zone, "energy_uj")) as f:
                microjoules = int(f.read().strip())
            with open(os.path.join(zone, "name")) as f:
                name = f.read().strip()
        except (OSError, ValueError):
            continue  # no counter here (the control folder), or root-only
        readings.append(EnergyReading(f"rapl:{os.path.basename(zone)}:{name}",
                                      microjoules / 1e6))
    return readings


class NvmlEnergy:
    """The GPUs' total energy since their driver loaded (Volta and later), once NVML is up."""

    def __init__(self) -> None:
        self._nvml = None
        self._handles: list | None = None  # None: not tried yet; []: no GPU answers

    def readings(self) -> list[EnergyReading]:
        if self._handles is None:
            self._handles = self._open()
        readings = []
        for i, handle in enumerate(self._handles):
            try:
                millijoules = self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            except Exception:  # noqa: BLE001 - an older GPU, or a lost one: no counter
                continue
            readings.append(EnergyReading(f"nvml:gpu-{i}", millijoules / 1e3))
        return readings

    def _open(self) -> list:
        try:
            import pynvml
        except ImportError:
            return []
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:  # noqa: BLE001 - pynvml's NVMLError: no driver here
            log.debug("NVML is not available: %s", exc)
            return []
        self._nvml = pynvml
        return handles


class EnergyMeters:
    """RAPL and NVML together: what one read_energy command answers."""

    def __init__(self) -> None:
        self.nvml = NvmlEnergy()

    def read(self) -> list[EnergyReading]:
        return rapl_readings() + self.nvml.readings()
