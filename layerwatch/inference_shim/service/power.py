"""Power, energy and thermals, read at scrape time: GPUs through NVML, CPU packages through RAPL.

No GPU (or no NVIDIA driver) is a normal state: `layerwatch_nvml_up` is 0 and the GPU series are
absent. A listed GPU's readings fail one by one: a reading the GPU does not offer (a passively cooled
GPU has no fans) is marked in `layerwatch_gpu_reading_unsupported`, one that errors is counted in
`layerwatch_gpu_reading_errors_total`, and the others are exported. Both energy sources are turned
into counters that never go backwards:
  - NVML's total-energy reading restarts at 0 when the driver reloads (`MonotonicEnergy`);
  - RAPL's `energy_uj` wraps around at `max_energy_range_uj` (`WrappingEnergy`). A wrap is seen as
    long as scrapes come more often than one full range (about 262 kJ: over 20 minutes at 200 W).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.core import Metric

from layerwatch.inference_shim.service.metrics import ShimCollector, family

log = logging.getLogger(__name__)

NVML_RETRY_SECONDS = 60.0  # how long to wait before trying nvmlInit again after it failed
RAPL_ROOT = Path("/sys/class/powercap")

T = TypeVar("T")


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

# The label values of `layerwatch_gpu_reading_*`: every reading NVML is asked for, per GPU.
GPU_READINGS = ("power", "energy", "temperature", "fan_speed", "sm_clock", "memory_used")


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one scrape. A reading NVML could not give is None (no fans: empty), and is named in
    `unsupported` (the device does not offer it) or `failed` (any other NVML error)."""

    index: int
    uuid: str
    power_watts: float | None
    energy_joules: float | None  # as NVML reports it: since the driver loaded
    temperature_celsius: float | None = None
    fan_speed_ratios: tuple[float, ...] = ()  # one per fan
    sm_clock_hertz: float | None = None
    memory_used_bytes: float | None = None
    unsupported: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()


class NvmlReader:
    """Reads every GPU through pynvml (nvidia-ml-py).

    Raises pynvml.NVMLError when NVML itself does not work: no driver, a GPU that cannot be listed,
    or a lost GPU. Each reading of a listed GPU fails on its own, whatever it raises: a GPU without
    fans still reports its temperature, power and clocks.
    """

    def __init__(self) -> None:
        import pynvml  # imported here so that the rest of the module works without the package

        self._nvml = pynvml
        self._initialised = False
        self._logged: set[tuple[str, str]] = set()  # (uuid, reading) whose failure was logged

    def __call__(self) -> list[GpuReading]:
        nvml = self._nvml
        try:
            if not self._initialised:
                nvml.nvmlInit()
                self._initialised = True
            return [self._read_gpu(index) for index in range(nvml.nvmlDeviceGetCount())]
        except nvml.NVMLError:
            self._shutdown()
            raise

    def _read_gpu(self, index: int) -> GpuReading:
        """One GPU's readings, converted from NVML's units (mW, mJ, MHz, percent) to base units."""
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        unsupported: set[str] = set()
        failed: set[str] = set()

        def read(reading: str, call: Callable[[], T]) -> T | None:
            try:
                return call()
            except nvml.NVMLError as exc:
                if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
                    raise  # not one reading: the whole device is gone, and NVML must start over
                if exc.value in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                    unsupported.add(reading)  # this GPU (or this driver) does not offer it
                else:
                    failed.add(reading)
                self._log_once(uuid, reading, exc)
            except Exception as exc:  # e.g. nvidia-ml-py without the call, or a value that does not convert
                failed.add(reading)  # NVML answered: only this reading is lost, not every GPU's for a minute
                self._log_once(uuid, reading, exc)
            return None

        return GpuReading(
            index=index,
            uuid=uuid,
            power_watts=read("power", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1e3),
            energy_joules=read("energy", lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3),
            temperature_celsius=read(
                "temperature", lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
            ),
            fan_speed_ratios=read("fan_speed", lambda: _fan_speed_ratios(nvml, handle)) or (),
            sm_clock_hertz=read("sm_clock", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM) * 1e6),
            memory_used_bytes=read("memory_used", lambda: float(nvml.nvmlDeviceGetMemoryInfo(handle).used)),
            unsupported=frozenset(unsupported),
            failed=frozenset(failed),
        )

    def _log_once(self, uuid: str, reading: str, exc: Exception) -> None:
        if (uuid, reading) not in self._logged:
            self._logged.add((uuid, reading))
            log.info(
                "NVML reading %s of GPU %s unavailable (%s: %s); its other readings are exported",
                reading,
                uuid,
                type(exc).__name__,
                exc,
            )

    def _shutdown(self) -> None:
        # After a driver reload the old handles are stale: start over with a fresh nvmlInit.
        if self._initialised:
            self._initialised = False
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()


def _fan_speed_ratios(nvml: Any, handle: Any) -> tuple[float, ...]:
    """Each fan's speed as a fraction of its maximum (NVML gives percent); raises NOT_SUPPORTED for
    a GPU without fans. A driver older than the per-fan calls gives one figure for the board."""
    try:
        fans = nvml.nvmlDeviceGetNumFans(handle)
    except nvml.NVMLError as exc:
        if exc.value != nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            raise
        return (nvml.nvmlDeviceGetFanSpeed(handle) / 100,)
    if fans == 0:
        raise nvml.NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)  # passively cooled (data-centre boards)
    return tuple(nvml.nvmlDeviceGetFanSpeed_v2(handle, fan) / 100 for fan in range(fans))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# Gauges with one value per GPU: (GpuReading attribute, metric name).
_GPU_GAUGES = (
    ("power_watts", "layerwatch_gpu_power_watts"),
    ("temperature_celsius", "layerwatch_gpu_temperature_celsius"),
    ("sm_clock_hertz", "layerwatch_gpu_sm_clock_hertz"),
    ("memory_used_bytes", "layerwatch_gpu_memory_used_bytes"),
)


class NvmlCollector(ShimCollector):
    """layerwatch_nvml_up and the per-GPU series: power, energy, temperature, fans, SM clock, memory
    used, and which readings are unsupported or failing."""

    metric_names = (
        "layerwatch_nvml_up",
        "layerwatch_gpu_energy_joules_total",
        "layerwatch_gpu_fan_speed_ratio",
        "layerwatch_gpu_reading_unsupported",
        "layerwatch_gpu_reading_errors_total",
        *(name for _, name in _GPU_GAUGES),
    )

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
        self._reading_errors: Counter[tuple[str, str]] = Counter()  # (uuid, reading) -> failed scrapes
        self._logged_failure = False

    def collect(self) -> Iterator[Metric]:
        readings = self._read()
        up = family("layerwatch_nvml_up")
        up.add_metric([], 1 if readings is not None else 0)
        energy = family("layerwatch_gpu_energy_joules_total")
        fans = family("layerwatch_gpu_fan_speed_ratio")
        unsupported = family("layerwatch_gpu_reading_unsupported")
        errors = family("layerwatch_gpu_reading_errors_total")
        gauges = [(attribute, family(name)) for attribute, name in _GPU_GAUGES]
        for r in readings or ():
            labels = [str(r.index), r.uuid]
            for attribute, gauge in gauges:
                value = getattr(r, attribute)
                if value is not None:
                    gauge.add_metric(labels, value)
            if r.energy_joules is not None:
                energy.add_metric(labels, self._energy.setdefault(r.uuid, MonotonicEnergy()).update(r.energy_joules))
            for fan, ratio in enumerate(r.fan_speed_ratios):
                fans.add_metric([*labels, str(fan)], ratio)
            for reading in GPU_READINGS:
                self._reading_errors[r.uuid, reading] += reading in r.failed
                unsupported.add_metric([*labels, reading], 1 if reading in r.unsupported else 0)
                errors.add_metric([*labels, reading], self._reading_errors[r.uuid, reading])
        yield from (up, energy, fans, unsupported, errors)
        yield from (gauge for _, gauge in gauges)

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

_PACKAGE_ZONE = re.compile(r"intel-rapl:[0-9]+")  # top-level zones; sub-zones (core, dram) are inside them


@dataclass(frozen=True)
class RaplZone:
    name: str  # e.g. "package-0"
    energy_path: Path
    max_range_uj: float


def find_rapl_zones(root: Path = RAPL_ROOT) -> list[RaplZone]:
    """Top-level RAPL zones whose energy is readable (reading needs root on most kernels)."""
    zones = []
    for directory in sorted(root.glob("intel-rapl:*")):
        if not _PACKAGE_ZONE.fullmatch(directory.name):
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
