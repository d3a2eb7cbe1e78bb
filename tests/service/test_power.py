"""Energy counters: monotonic across NVML restarts, RAPL wrap-around, the no-GPU path; the GPU
thermals through the real NVML reader on a simulated device, each reading failing on its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerwatch.inference_shim.service.power import (
    GPU_READINGS,
    GpuReading,
    MonotonicEnergy,
    NvmlCollector,
    RaplCollector,
    WrappingEnergy,
    find_rapl_zones,
)
from tests.service.simulated_nvml import SimulatedNvml
from tests.support import Sample, collector_samples


def samples(collector) -> dict[Sample, float]:
    return collector_samples(collector)


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


GPU = (("gpu", "0"), ("uuid", SimulatedNvml.UUID))


def gpu_samples(samples: dict[tuple[str, tuple], float]) -> dict[str, float]:
    """The simulated GPU's series, by name (with the fan or reading label where there is one)."""
    out = {}
    for (name, labels), value in samples.items():
        rest = tuple(kv for kv in labels if kv not in GPU)
        if len(rest) == len(labels) - len(GPU):
            out[name + "".join(f"{{{k}={v}}}" for k, v in rest)] = value
    return out


def unavailable(samples: dict[str, float]) -> dict[str, list[str]]:
    """The readings marked unsupported, and those with errors counted."""
    return {
        kind: [r for r in GPU_READINGS if samples[f"layerwatch_gpu_reading_{metric}{{reading={r}}}"] > 0]
        for kind, metric in (("unsupported", "unsupported"), ("errors", "errors_total"))
    }


@pytest.fixture
def pynvml():
    return pytest.importorskip("pynvml")


def test_thermals_of_a_gpu_with_fans_in_base_units(pynvml, monkeypatch):
    SimulatedNvml(pynvml, fans_percent=(30, 45)).install(monkeypatch)
    seen = gpu_samples(samples(NvmlCollector()))
    assert seen["layerwatch_gpu_temperature_celsius"] == 61.0
    assert (seen["layerwatch_gpu_fan_speed_ratio{fan=0}"], seen["layerwatch_gpu_fan_speed_ratio{fan=1}"]) == (0.3, 0.45)
    assert seen["layerwatch_gpu_sm_clock_hertz"] == 1.98e9
    assert seen["layerwatch_gpu_memory_used_bytes"] == 81 * 2**30
    assert (seen["layerwatch_gpu_power_watts"], seen["layerwatch_gpu_energy_joules_total"]) == (250.0, 5001.0)
    assert unavailable(seen) == {"unsupported": [], "errors": []}


@pytest.mark.parametrize(
    "errors",
    [{}, {"nvmlDeviceGetNumFans": "NVML_ERROR_NOT_SUPPORTED"}],
    ids=["zero fans", "fans not supported"],
)
def test_a_gpu_without_fans_exports_its_other_readings(pynvml, monkeypatch, errors):
    """A passively cooled board (H100, H200, A100 SXM): NVML counts no fans, or refuses the question."""
    SimulatedNvml(pynvml, errors=errors).install(monkeypatch)
    collector = NvmlCollector()
    for _ in range(2):  # unsupported is a state, not an error: nothing is counted
        everything = samples(collector)
        seen = gpu_samples(everything)
        assert everything[("layerwatch_nvml_up", ())] == 1
        assert not [name for name in seen if name.startswith("layerwatch_gpu_fan_speed_ratio")]
        assert seen["layerwatch_gpu_temperature_celsius"] == 61.0 and seen["layerwatch_gpu_power_watts"] == 250.0
        assert unavailable(seen) == {"unsupported": ["fan_speed"], "errors": []}


def test_each_reading_fails_on_its_own(pynvml, monkeypatch):
    """Energy unsupported (a GPU older than Volta) and a temperature sensor that errors: power,
    clocks, memory and fans are still exported, the failing reading is counted at every scrape."""
    errors = {
        "nvmlDeviceGetTotalEnergyConsumption": "NVML_ERROR_NOT_SUPPORTED",
        "nvmlDeviceGetTemperature": "NVML_ERROR_UNKNOWN",
    }
    device = SimulatedNvml(pynvml, fans_percent=(50,), errors=errors)
    device.install(monkeypatch)
    collector = NvmlCollector()
    samples(collector)
    everything = samples(collector)
    seen = gpu_samples(everything)
    assert everything[("layerwatch_nvml_up", ())] == 1
    assert "layerwatch_gpu_energy_joules_total" not in seen and "layerwatch_gpu_temperature_celsius" not in seen
    assert seen["layerwatch_gpu_power_watts"] == 250.0 and seen["layerwatch_gpu_fan_speed_ratio{fan=0}"] == 0.5
    assert seen["layerwatch_gpu_sm_clock_hertz"] == 1.98e9 and seen["layerwatch_gpu_memory_used_bytes"] > 0
    assert unavailable(seen) == {"unsupported": ["energy"], "errors": ["temperature"]}
    assert seen["layerwatch_gpu_reading_errors_total{reading=temperature}"] == 2
    del device.errors["nvmlDeviceGetTemperature"]  # the sensor answers again; the counter keeps its count
    seen = gpu_samples(samples(collector))
    assert seen["layerwatch_gpu_temperature_celsius"] == 61.0
    assert seen["layerwatch_gpu_reading_errors_total{reading=temperature}"] == 2


@pytest.mark.parametrize("broken", ["a call that raises", "a call the package lacks"])
def test_a_reading_failing_outside_nvml_costs_only_that_reading(pynvml, monkeypatch, broken):
    """Not an NVMLError (a value that does not convert, an nvidia-ml-py without the per-fan calls):
    NVML answered, so only that reading is lost and counted, at every scrape, not every reading of
    every GPU until the next try a minute later."""
    if broken == "a call that raises":
        errors: dict[str, str | Exception] = {"nvmlDeviceGetMemoryInfo": TypeError("unexpected struct")}
        reading = "memory_used"
    else:
        errors, reading = {}, "fan_speed"
    SimulatedNvml(pynvml, fans_percent=(50,), errors=errors).install(monkeypatch)
    if broken == "a call the package lacks":
        monkeypatch.delattr(pynvml, "nvmlDeviceGetNumFans")
    collector = NvmlCollector()
    for scrape in (1, 2):
        everything = samples(collector)
        seen = gpu_samples(everything)
        assert everything[("layerwatch_nvml_up", ())] == 1
        assert seen["layerwatch_gpu_power_watts"] == 250.0 and seen["layerwatch_gpu_temperature_celsius"] == 61.0
        assert seen["layerwatch_gpu_energy_joules_total"] > 0 and seen["layerwatch_gpu_sm_clock_hertz"] == 1.98e9
        assert unavailable(seen) == {"unsupported": [], "errors": [reading]}
        assert seen[f"layerwatch_gpu_reading_errors_total{{reading={reading}}}"] == scrape


def test_a_driver_without_per_fan_calls_reports_the_board_fan(pynvml, monkeypatch):
    SimulatedNvml(pynvml, fans_percent=(40,), errors={"nvmlDeviceGetNumFans": "NVML_ERROR_FUNCTION_NOT_FOUND"}).install(
        monkeypatch
    )
    seen = gpu_samples(samples(NvmlCollector()))
    assert seen["layerwatch_gpu_fan_speed_ratio{fan=0}"] == 0.4
    assert unavailable(seen) == {"unsupported": [], "errors": []}


def test_a_gpu_lost_in_one_reading_takes_nvml_down(pynvml, monkeypatch):
    """GPU_IS_LOST is not one reading's failure: nothing of the GPU is exported and NVML starts over."""
    SimulatedNvml(pynvml, errors={"nvmlDeviceGetTemperature": "NVML_ERROR_GPU_IS_LOST"}).install(monkeypatch)
    everything = samples(NvmlCollector())
    assert everything[("layerwatch_nvml_up", ())] == 0
    assert gpu_samples(everything) == {}


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
