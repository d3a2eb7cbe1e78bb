"""Energy counters: monotonic across NVML restarts, RAPL wrap-around, the no-GPU path."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_shim.service.power import (
    GpuReading,
    MonotonicEnergy,
    NvmlCollector,
    RaplCollector,
    WrappingEnergy,
    find_rapl_zones,
)


def samples(collector) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value for family in collector.collect() for s in family.samples
    }


def test_monotonic_energy_survives_a_driver_reload():
    energy = MonotonicEnergy()
    exported = [energy.update(r) for r in (100.0, 150.0, 10.0, 40.0, 5.0, 5.0)]
    assert exported == [100.0, 150.0, 160.0, 190.0, 195.0, 195.0]
    assert all(b >= a for a, b in zip(exported, exported[1:]))


def test_rapl_energy_handles_wrap_around():
    energy = WrappingEnergy(max_range=1000.0)
    assert [energy.update(r) for r in (900.0, 950.0, 50.0, 60.0, 990.0, 10.0)] == [
        900.0,
        950.0,
        1050.0,
        1060.0,
        1990.0,
        2010.0,
    ]


class ScriptedNvml:
    """Readings from a script; None stands for an NVML error (no driver, driver reloading)."""

    def __init__(self, script: list[list[GpuReading] | None]) -> None:
        self.script = script

    def __call__(self) -> list[GpuReading]:
        step = self.script.pop(0)
        if step is None:
            raise RuntimeError("NVML Shared Library Not Found")
        return step


def test_nvml_collector_exports_power_and_monotonic_energy_and_recovers():
    gpu = lambda power, energy: [GpuReading(0, "GPU-abc", power, energy)]  # noqa: E731
    clock = [0.0]
    collector = NvmlCollector(
        ScriptedNvml([gpu(300.0, 1000.0), None, gpu(250.0, 20.0)]), retry_seconds=60, clock=lambda: clock[0]
    )
    labels = (("gpu", "0"), ("uuid", "GPU-abc"))
    first = samples(collector)
    assert first[("layerwatch_nvml_up", ())] == 1
    assert first[("layerwatch_gpu_power_watts", labels)] == 300.0
    assert first[("layerwatch_gpu_energy_joules_total", labels)] == 1000.0
    failed = samples(collector)
    assert failed[("layerwatch_nvml_up", ())] == 0 and ("layerwatch_gpu_power_watts", labels) not in failed
    clock[0] = 30.0
    assert samples(collector)[("layerwatch_nvml_up", ())] == 0  # not retried before retry_seconds
    clock[0] = 61.0
    recovered = samples(collector)  # the driver came back with its counter restarted at 20 J
    assert recovered[("layerwatch_nvml_up", ())] == 1
    assert recovered[("layerwatch_gpu_energy_joules_total", labels)] == 1020.0


def test_nvml_collector_on_this_host():
    up = samples(NvmlCollector())[("layerwatch_nvml_up", ())]
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception:
        assert up == 0  # no GPU here: a normal state, not an error
    else:
        assert up == 1


def write_zone(root: Path, name: str, directory: str, energy: int, max_range: int = 1000) -> Path:
    zone = root / directory
    zone.mkdir(parents=True)
    (zone / "name").write_text(name + "\n")
    (zone / "max_energy_range_uj").write_text(f"{max_range}\n")
    (zone / "energy_uj").write_text(f"{energy}\n")
    return zone / "energy_uj"


def test_rapl_collector_reads_package_zones_and_wraps(tmp_path):
    package = write_zone(tmp_path, "package-0", "intel-rapl:0", energy=900)
    write_zone(tmp_path, "core", "intel-rapl:0:0", energy=5)  # a sub-zone: inside the package already
    unreadable = write_zone(tmp_path, "package-1", "intel-rapl:1", energy=1)
    unreadable.write_text("not a number")
    zones = find_rapl_zones(tmp_path)
    assert [z.name for z in zones] == ["package-0"]
    collector = RaplCollector(zones)
    key = ("layerwatch_cpu_energy_joules_total", (("zone", "package-0"),))
    assert samples(collector)[key] == pytest.approx(900e-6)
    package.write_text("100\n")  # wrapped past max_energy_range_uj = 1000
    assert samples(collector)[key] == pytest.approx(1100e-6)


def test_rapl_collector_without_rapl(tmp_path):
    assert find_rapl_zones(tmp_path / "absent") == []
    families = list(RaplCollector([]).collect())
    assert [f.name for f in families] == ["layerwatch_cpu_energy_joules"] and families[0].samples == []
