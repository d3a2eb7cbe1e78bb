"""Power and energy, read at scrape time: GPUs through NVML, CPU packages through RAPL.

No GPU (or no NVIDIA driver) is a normal state: `layerwatch_nvml_up` is 0 and the GPU series are
absent. Both energy sources are turned into counters that never go backwards:
  - NVML's total-energy reading restarts at 0 when the driver reloads (`MonotonicEnergy`);
  - RAPL's `energy_uj` wraps around at `max_energy_range_uj` (`WrappingEnergy`). A wrap is seen as
    long as scrapes come more often than one full range (about 262 kJ: over 20 minutes at 200 W).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import Metric

from inference_shim.service.metrics import ShimCollector, family

log = logging.getLogger(__name__)

NVML_RETRY_SECONDS = 60.0  # how long to wait before trying nvmlInit again after it failed
RAPL_ROOT = Path("/sys/class/powercap")


class MonotonicEnergy:
    """A counter from a reading that may restart at zero: a drop means a restart, not negative energy."""

    def __init__(self) -> None:
        self._offset = 0.0
        self._last: float | None = None

    def update(self, reading: float) -> float:
        if self._last is not None and reading < self._last:
            self._offset += self._last  # energy after the last reading before the restart is lost
        self._last = reading
        return self._offset + reading


class WrappingEnergy:
    """A counter from a reading that wraps to zero after `max_range` (RAPL's energy_uj)."""

    def __init__(self, max_range: float) -> None:
        self._max_range = max_range
        self._total = 0.0
        self._last: float | None = None

    def update(self, reading: float) -> float:
        if self._last is None:
            self._total = reading
        elif reading >= self._last:
            self._total += reading - self._last
        else:
            self._total += self._max_range - self._last + reading
        self._last = reading
        return self._total


# --- NVML -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str
    power_watts: float
    energy_joules: float  # as NVML reports it: since the driver loaded


class NvmlReader:
    """Reads every GPU through pynvml (nvidia-ml-py); raises pynvml.NVMLError when NVML does not work."""

    def __init__(self) -> None:
        import pynvml  # imported here so that the rest of the module works without the package

        self._nvml = pynvml
        self._initialised = False

    def __call__(self) -> list[GpuReading]:
        nvml = self._nvml
        try:
            if not self._initialised:
                nvml.nvmlInit()
                self._initialised = True
            readings = []
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                readings.append(
                    GpuReading(
                        index=index,
                        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                        power_watts=nvml.nvmlDeviceGetPowerUsage(handle) / 1e3,  # mW
                        energy_joules=nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3,  # mJ
                    )
                )
            return readings
        except nvml.NVMLError:
            self._shutdown()
            raise

    def _shutdown(self) -> None:
        # After a driver reload the old handles are stale: start over with a fresh nvmlInit.
        if self._initialised:
            self._initialised = False
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class NvmlCollector(ShimCollector):
    """layerwatch_nvml_up, layerwatch_gpu_power_watts and layerwatch_gpu_energy_joules_total."""

    metric_names = ("layerwatch_nvml_up", "layerwatch_gpu_power_watts", "layerwatch_gpu_energy_joules_total")

    def __init__(
        self,
        reader: Callable[[], list[GpuReading]] | None = None,
        retry_seconds: float = NVML_RETRY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reader = reader
        self._retry_seconds = retry_seconds
        self._clock = clock
        self._next_try = 0.0
        self._energy: dict[str, MonotonicEnergy] = {}
        self._logged_failure = False

    def collect(self) -> Iterator[Metric]:
        readings = self._read()
        up, power, energy = map(family, self.metric_names)
        up.add_metric([], 1 if readings is not None else 0)
        yield up
        for r in readings or ():
            labels = [str(r.index), r.uuid]
            power.add_metric(labels, r.power_watts)
            energy.add_metric(labels, self._energy.setdefault(r.uuid, MonotonicEnergy()).update(r.energy_joules))
        yield power
        yield energy

    def _read(self) -> list[GpuReading] | None:
        if self._clock() < self._next_try:
            return None
        try:
            if self._reader is None:
                self._reader = NvmlReader()
            readings = self._reader()
        except Exception as exc:  # pynvml.NVMLError, or the package missing: both mean "no readings"
            self._next_try = self._clock() + self._retry_seconds
            if not self._logged_failure:
                log.info(
                    "NVML readings unavailable (%s); layerwatch_nvml_up=0, retrying every %.0f s",
                    exc,
                    self._retry_seconds,
                )
                self._logged_failure = True
            return None
        self._logged_failure = False
        return readings


# --- RAPL -------------------------------------------------------------------------------------------

_PACKAGE_ZONE = re.compile(r"intel-rapl:\d+$")  # top-level zones; sub-zones (core, dram) are inside them


@dataclass(frozen=True)
class RaplZone:
    name: str  # e.g. "package-0"
    energy_path: Path
    max_range_uj: float


def find_rapl_zones(root: Path = RAPL_ROOT) -> list[RaplZone]:
    """Top-level RAPL zones whose energy is readable (reading needs root on most kernels)."""
    zones = []
    for directory in sorted(root.glob("intel-rapl:*")):
        if not _PACKAGE_ZONE.match(directory.name):
            continue
        try:
            name = (directory / "name").read_text().strip()
            max_range = float((directory / "max_energy_range_uj").read_text())
            float((directory / "energy_uj").read_text())
        except (OSError, ValueError):
            continue
        zones.append(RaplZone(name, directory / "energy_uj", max_range))
    return zones


class RaplCollector(ShimCollector):
    """layerwatch_cpu_energy_joules_total{zone}; no samples where RAPL cannot be read."""

    metric_names = ("layerwatch_cpu_energy_joules_total",)

    def __init__(self, zones: list[RaplZone] | None = None) -> None:
        self._zones = find_rapl_zones() if zones is None else zones
        self._energy = {z.name: WrappingEnergy(z.max_range_uj) for z in self._zones}

    def collect(self) -> Iterator[Metric]:
        energy = family("layerwatch_cpu_energy_joules_total")
        for zone in self._zones:
            try:
                microjoules = float(zone.energy_path.read_text())
            except (OSError, ValueError):
                continue
            energy.add_metric([zone.name], self._energy[zone.name].update(microjoules) / 1e6)
        yield energy
