"""GPU health: readings from NVML (`nvidia-ml-py`, module `pynvml`) and the pure rules on them.

The rules are edge-triggered per GPU: they alert when a condition starts (temperature reaches
the threshold, a throttle reason appears, the uncorrected ECC count grows), not on every poll
while it lasts. NVML covers the GPUs of the whole node, so only each node's local rank 0 polls.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from clipforge.alerts import events
from clipforge.alerts.events import Finding

# Clock-event reasons (NVML bit masks, nvmlClocksEventReason*) that mean the GPU is slowed by
# heat or a hardware fault. Left out on purpose: SwPowerCap (0x4), which a busy A800/H100 hits
# all day long at its power limit, and idle / application-clock / sync-boost reasons.
THROTTLE_REASONS = {
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power-brake slowdown",
}

# A GPU at the threshold hovers around it; it must cool this much before a new alert can fire.
_TEMP_HYSTERESIS_CELSIUS = 5.0


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str
    temperature_celsius: float | None
    """None where the GPU does not report it."""
    clock_event_reasons: int | None
    """NVML bit mask of why clocks are reduced."""
    uncorrected_ecc_errors: int | None
    """Volatile (since driver load) uncorrected ECC errors; None without ECC."""


def throttle_reason_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


class GpuHealthRules:
    """Temperature, throttling and ECC rules. Pure: fed readings, returns findings."""

    def __init__(self, *, temp_celsius: float) -> None:
        self._temp_limit = temp_celsius
        self._hot: set[int] = set()
        self._throttle: dict[int, frozenset[str]] = {}
        self._ecc: dict[int, int] = {}

    def evaluate(self, readings: Sequence[GpuReading]) -> list[Finding]:
        findings: list[Finding] = []
        for reading in readings:
            findings += self._temperature(reading)
            findings += self._throttling(reading)
            findings += self._ecc_errors(reading)
        return findings

    def _temperature(self, r: GpuReading) -> list[Finding]:
        if r.temperature_celsius is None:
            return []
        if r.temperature_celsius < self._temp_limit - _TEMP_HYSTERESIS_CELSIUS:
            self._hot.discard(r.index)
        if r.temperature_celsius < self._temp_limit or r.index in self._hot:
            return []
        self._hot.add(r.index)
        return [
            Finding(
                events.GPU_TEMPERATURE,
                "warning",
                f"GPU {r.index} ({r.name}) at {r.temperature_celsius:g} °C, "
                f"threshold {self._temp_limit:g} °C (alerts.gpu_temp_celsius)",
                key=f"gpu{r.index}",
                details={"gpu": r.index, "temperature_celsius": r.temperature_celsius},
            )
        ]

    def _throttling(self, r: GpuReading) -> list[Finding]:
        if r.clock_event_reasons is None:
            return []
        now = frozenset(throttle_reason_names(r.clock_event_reasons))
        new = now - self._throttle.get(r.index, frozenset())
        self._throttle[r.index] = now
        if not new:
            return []
        return [
            Finding(
                events.GPU_THROTTLE,
                "warning",
                f"GPU {r.index} ({r.name}) clocks reduced: {', '.join(sorted(now))}",
                key=f"gpu{r.index}",
                details={"gpu": r.index, "reasons": sorted(now)},
            )
        ]

    def _ecc_errors(self, r: GpuReading) -> list[Finding]:
        if r.uncorrected_ecc_errors is None:
            return []
        before = self._ecc.get(r.index, 0)
        self._ecc[r.index] = r.uncorrected_ecc_errors
        if r.uncorrected_ecc_errors <= before:
            return []
        return [
            Finding(
                events.GPU_ECC,
                "critical",
                f"GPU {r.index} ({r.name}) has {r.uncorrected_ecc_errors} uncorrected ECC error(s) "
                f"since driver load (+{r.uncorrected_ecc_errors - before}); this run's results "
                f"may be corrupt and the GPU may need a reset or replacement",
                key=f"gpu{r.index}",
                details={"gpu": r.index, "uncorrected_ecc_errors": r.uncorrected_ecc_errors},
            )
        ]


class GpuReader(Protocol):
    def read(self) -> list[GpuReading]: ...
    def close(self) -> None: ...


class NvmlReader:
    """Reads every GPU of this node through NVML."""

    def __init__(self, pynvml) -> None:  # the pynvml module, imported by open_nvml
        self._nvml = pynvml
        self._handles = [
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
        ]

    def read(self) -> list[GpuReading]:
        nvml = self._nvml
        readings = []
        for index, handle in enumerate(self._handles):
            name = self._optional(nvml.nvmlDeviceGetName, handle)
            readings.append(
                GpuReading(
                    index=index,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    temperature_celsius=self._optional(
                        nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU
                    ),
                    clock_event_reasons=self._optional(_clock_event_reasons(nvml), handle),
                    uncorrected_ecc_errors=self._optional(
                        nvml.nvmlDeviceGetTotalEccErrors,
                        handle,
                        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        nvml.NVML_VOLATILE_ECC,
                    ),
                )
            )
        return readings

    def _optional(self, function: Callable, *args: object):
        # Consumer GPUs have no ECC, some boards no temperature: NotSupported is a normal answer.
        try:
            return function(*args)
        except self._nvml.NVMLError_NotSupported:
            return None

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def _clock_event_reasons(nvml) -> Callable:
    # Renamed from "throttle reasons" in newer NVML; older bindings only have the old name.
    return (
        getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    )


def open_nvml() -> GpuReader | str:
    """An NVML reader, or the reason there is none (no bindings, no driver, no GPU)."""
    try:
        import pynvml
    except ImportError:
        return "the nvidia-ml-py package (module pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return f"NVML cannot start: {error}"
    try:
        return NvmlReader(pynvml)
    except pynvml.NVMLError as error:
        pynvml.nvmlShutdown()
        return f"NVML cannot list the GPUs: {error}"


class GpuPoller:
    """Polls a reader every `poll_seconds` on its own thread and hands findings on."""

    def __init__(
        self,
        reader: GpuReader,
        rules: GpuHealthRules,
        *,
        poll_seconds: float,
        on_findings: Callable[[list[Finding]], None],
        log: logging.Logger,
    ) -> None:
        self._reader, self._rules, self._poll = reader, rules, poll_seconds
        self._on_findings, self._log = on_findings, log
        self._last_error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="alerts-gpu-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._reader.close()

    def poll_once(self) -> None:
        try:
            findings = self._rules.evaluate(self._reader.read())
        except Exception as error:
            # Say each distinct failure once: a GPU that fell off the bus fails every poll.
            if repr(error) != self._last_error:
                self._last_error = repr(error)
                message = (
                    f"reading the GPUs through NVML failed: {error!r} (a GPU may have fallen "
                    f"off the bus); said once per distinct error"
                )
                self._on_findings([Finding(events.GPU_READ_FAILED, "critical", message)])
            return
        self._last_error = ""
        if findings:
            self._on_findings(findings)

    def _run(self) -> None:
        self.poll_once()
        while not self._stop.wait(self._poll):
            self.poll_once()
