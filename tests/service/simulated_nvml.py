"""A SIMULATED NVML device: there is no GPU on the test machine.

It stands in for every pynvml function NvmlReader calls (monkeypatched onto the real pynvml module),
accepts only the arguments the real function takes, and fails the way a real driver does, with
pynvml's own NVMLError and its error codes, so the real reader and collector run unchanged.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace


class SimulatedNvml:
    """One GPU. With no `fans` it is a passively cooled data-centre board (NVML counts 0 fans).

    `errors` maps a pynvml function name to the NVML error that call raises, by the name of its
    code (NVML_ERROR_NOT_SUPPORTED for a reading the GPU does not offer, NVML_ERROR_FUNCTION_NOT_FOUND
    for a driver without the function, ...), or to an exception it raises as it is (not an
    NVMLError: the binding itself failing); `fail()` loses the GPU: from then on every call raises
    GPU_IS_LOST, as after an Xid fault."""

    UUID = "GPU-simulated-0"
    POWER_MILLIWATTS = 250_000
    TEMPERATURE_CELSIUS = 61
    SM_CLOCK_MHZ = 1_980
    MEMORY_USED_BYTES = 81 * 2**30

    def __init__(
        self, pynvml, fans_percent: tuple[int, ...] = (), errors: dict[str, str | Exception] | None = None
    ) -> None:
        self.pynvml = pynvml
        self.fans_percent = fans_percent
        self.errors = dict(errors or {})
        self.failed = False
        self.energy_millijoules = 5_000_000

    def fail(self) -> None:
        self.failed = True

    def install(self, monkeypatch) -> None:
        def energy(_handle) -> int:
            self.energy_millijoules += 1000
            return self.energy_millijoules

        def fan_speed(_handle, fan: int = 0) -> int:
            return self.fans_percent[fan]

        def only(expected: int, value: int):
            """A reading that takes a sensor or clock id and knows only the one the reader must ask for."""

            def call(_handle, which: int) -> int:
                if which != expected:
                    raise self.pynvml.NVMLError(self.pynvml.NVML_ERROR_INVALID_ARGUMENT)
                return value

            return call

        functions = {
            "nvmlInit": lambda: None,
            "nvmlDeviceGetCount": lambda: 1,
            "nvmlDeviceGetHandleByIndex": lambda _index: "handle-0",
            "nvmlDeviceGetUUID": lambda _handle: self.UUID,
            "nvmlDeviceGetPowerUsage": lambda _handle: self.POWER_MILLIWATTS,
            "nvmlDeviceGetTotalEnergyConsumption": energy,
            "nvmlDeviceGetTemperature": only(self.pynvml.NVML_TEMPERATURE_GPU, self.TEMPERATURE_CELSIUS),
            "nvmlDeviceGetNumFans": lambda _handle: len(self.fans_percent),
            "nvmlDeviceGetFanSpeed": fan_speed,
            "nvmlDeviceGetFanSpeed_v2": fan_speed,
            "nvmlDeviceGetClockInfo": only(self.pynvml.NVML_CLOCK_SM, self.SM_CLOCK_MHZ),
            "nvmlDeviceGetMemoryInfo": lambda _handle: SimpleNamespace(used=self.MEMORY_USED_BYTES),
        }
        for name, function in functions.items():
            monkeypatch.setattr(self.pynvml, name, self._checked(name, function))
        monkeypatch.setattr(self.pynvml, "nvmlShutdown", lambda: None)

    def _checked(self, name: str, function):
        real = inspect.signature(getattr(self.pynvml, name))

        def call(*args):
            real.bind(*args)  # called as the real pynvml function must be (TypeError otherwise)
            if self.failed:
                raise self.pynvml.NVMLError(self.pynvml.NVML_ERROR_GPU_IS_LOST)
            error = self.errors.get(name)
            if isinstance(error, Exception):
                raise error
            if error is not None:
                raise self.pynvml.NVMLError(getattr(self.pynvml, error))
            return function(*args)

        return call
