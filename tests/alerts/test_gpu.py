"""GPU health rules fed readings, the poller thread, and the node without NVML."""

from __future__ import annotations

import logging

import pytest

from clipforge.alerts.gpu import (
    GpuHealthRules,
    GpuPoller,
    GpuReading,
    NvmlReader,
    open_nvml,
    throttle_reason_names,
)
from clipforge.alerts.monitor import AlertMonitor
from clipforge.alerts.targets import parse_targets
from tests.support.webhooks import eventually, fast_config

LOG = logging.getLogger("clipforge.alerts.test")
HW_THERMAL, SW_POWER_CAP, HW_SLOWDOWN = 0x40, 0x4, 0x8


def reading(index=0, temp=60.0, reasons=0, ecc=0) -> GpuReading:
    return GpuReading(
        index=index,
        name="NVIDIA A800 80GB",
        temperature_celsius=temp,
        clock_event_reasons=reasons,
        uncorrected_ecc_errors=ecc,
    )


def rules_of(findings):
    return [(f.rule, f.key) for f in findings]


def test_temperature_at_threshold_alerts_once_until_it_cools():
    """85 °C alerts; staying hot does not repeat; back under threshold - 5 °C re-arms it."""
    rules = GpuHealthRules(temp_celsius=85.0)
    assert rules.evaluate([reading(temp=84.0)]) == []
    hot = rules.evaluate([reading(temp=85.0)])
    assert rules_of(hot) == [("gpu_temperature", "gpu0")] and "85 °C" in hot[0].message
    assert rules.evaluate([reading(temp=90.0)]) == []
    assert rules.evaluate([reading(temp=82.0)]) == [], "within hysteresis: still the same episode"
    assert rules.evaluate([reading(temp=86.0)]) == []
    rules.evaluate([reading(temp=70.0)])
    assert rules_of(rules.evaluate([reading(temp=86.0)])) == [("gpu_temperature", "gpu0")]


def test_each_gpu_is_judged_on_its_own():
    """GPU 1 overheating is reported as GPU 1, with GPU 0 fine."""
    findings = GpuHealthRules(temp_celsius=85.0).evaluate([reading(0, 60.0), reading(1, 91.0)])
    assert rules_of(findings) == [("gpu_temperature", "gpu1")]


def test_power_cap_alone_is_not_throttling_worth_an_alert():
    """A busy GPU at its power limit (SwPowerCap) is normal; thermal slowdown is not."""
    rules = GpuHealthRules(temp_celsius=85.0)
    assert rules.evaluate([reading(reasons=SW_POWER_CAP)]) == []
    findings = rules.evaluate([reading(reasons=SW_POWER_CAP | HW_THERMAL)])
    assert rules_of(findings) == [("gpu_throttle", "gpu0")]
    assert "hardware thermal slowdown" in findings[0].message


def test_throttle_alerts_when_a_reason_appears_not_while_it_lasts():
    """Same reasons on the next poll: quiet. A new reason: alert again, listing both."""
    rules = GpuHealthRules(temp_celsius=85.0)
    rules.evaluate([reading(reasons=HW_THERMAL)])
    assert rules.evaluate([reading(reasons=HW_THERMAL)]) == []
    again = rules.evaluate([reading(reasons=HW_THERMAL | HW_SLOWDOWN)])
    assert throttle_reason_names(HW_THERMAL | HW_SLOWDOWN) == [
        "hardware slowdown",
        "hardware thermal slowdown",
    ]
    assert "hardware slowdown, hardware thermal slowdown" in again[0].message


def test_uncorrected_ecc_growth_is_critical():
    """A rising uncorrected ECC count is a critical alert; an unchanged count is not."""
    rules = GpuHealthRules(temp_celsius=85.0)
    assert rules.evaluate([reading(ecc=0)]) == []
    findings = rules.evaluate([reading(ecc=2)])
    assert rules_of(findings) == [("gpu_ecc", "gpu0")] and findings[0].severity == "critical"
    assert rules.evaluate([reading(ecc=2)]) == []


def test_unsupported_readings_are_ignored():
    """A GPU without temperature, clock reasons or ECC support yields no findings."""
    blank = GpuReading(
        index=0,
        name="x",
        temperature_celsius=None,
        clock_event_reasons=None,
        uncorrected_ecc_errors=None,
    )
    assert GpuHealthRules(temp_celsius=85.0).evaluate([blank]) == []


class ScriptedReader:
    """Stands in for NVML, which needs a GPU: returns the given readings or raises, in order."""

    def __init__(self, script):
        self.script = list(script)
        self.closed = False

    def read(self):
        item = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(item, Exception):
            raise item
        return item

    def close(self):
        self.closed = True


def test_poller_reports_findings_and_read_failures_once():
    """The poller thread passes findings on; a repeated read error is reported once; the
    reader is closed at stop."""
    got = []
    reader = ScriptedReader([[reading(temp=95.0)], RuntimeError("GPU is lost")])
    poller = GpuPoller(
        reader,
        GpuHealthRules(temp_celsius=85.0),
        poll_seconds=0.01,
        on_findings=got.extend,
        log=LOG,
    )
    poller.start()
    eventually(lambda: len(got) >= 2, "two findings")
    for _ in range(5):
        poller.poll_once()
    poller.stop()
    assert [f.rule for f in got] == ["gpu_temperature", "gpu_read_failed"]
    assert reader.closed


def test_node_without_nvml_says_so_once_and_carries_on(caplog):
    """A node where NVML does not start (the reader seam answers as open_nvml does there, so
    this runs on any machine): the monitor logs that GPU monitoring is off exactly once, saying
    why, and the step rules keep working."""
    reason = "NVML cannot start: Driver Not Loaded"
    caplog.set_level(logging.INFO, logger="clipforge.alerts")
    config = fast_config(gpu_poll_seconds=0.01)
    with AlertMonitor(config, "run-1", open_gpu_reader=lambda: reason) as monitor:
        assert monitor.check_loss(0, 2.0).skip is False
        monitor.check_update(0, 1.0)
    lines = [r for r in caplog.records if "gpu_monitor_unavailable" in r.getMessage()]
    assert len(lines) == 1 and "monitoring is off" in lines[0].getMessage()
    assert reason in lines[0].getMessage()


def test_open_nvml_gives_a_reader_or_the_reason_there_is_none():
    """Whatever this machine has: open_nvml returns a reader that reads, or one line of why not
    (the string the monitor logs)."""
    reader = open_nvml()
    if isinstance(reader, str):
        assert reader and "\n" not in reader
    else:
        try:
            assert all(isinstance(r, GpuReading) for r in reader.read())
        finally:
            reader.close()


def test_gpu_findings_reach_the_webhook(webhook_server):
    """On local rank 0 a hot GPU read by the poller becomes a delivered alert naming the GPU."""
    monitor = AlertMonitor(
        fast_config(gpu_poll_seconds=0.01),
        "run-1",
        rank=1,
        local_rank=0,
        targets=parse_targets([webhook_server.url()], source="test"),
        open_gpu_reader=lambda: ScriptedReader([[reading(index=2, temp=97.0)]]),
    )
    with monitor:
        received = webhook_server.wait_for(1)
    assert received[0].body["rule"] == "gpu_temperature" and received[0].body["key"] == "gpu2"


def test_nvml_reader_maps_the_real_bindings_api():
    """NvmlReader calls functions and constants that exist in the installed nvidia-ml-py, and
    maps their answers (NotSupported -> None) into readings. NVML itself needs a GPU, so its
    answers are scripted here; names, constants and exception classes are the real module's."""
    import types

    pynvml = pytest.importorskip("pynvml")
    used = [
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetName",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlShutdown",
    ]
    assert all(hasattr(pynvml, name) for name in used)
    assert hasattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons") or hasattr(
        pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons"
    )

    def no_ecc(handle, error_type, counter_type):
        assert (error_type, counter_type) == (
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        )
        if handle == 1:
            raise pynvml.NVMLError_NotSupported()
        return 3

    def temperature(handle, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return 70 + handle

    scripted = types.SimpleNamespace(
        NVMLError_NotSupported=pynvml.NVMLError_NotSupported,
        NVML_TEMPERATURE_GPU=pynvml.NVML_TEMPERATURE_GPU,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        NVML_VOLATILE_ECC=pynvml.NVML_VOLATILE_ECC,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200" if h == 0 else "NVIDIA H200",
        nvmlDeviceGetTemperature=temperature,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: HW_THERMAL if h == 1 else 0,
        nvmlDeviceGetTotalEccErrors=no_ecc,
        nvmlShutdown=lambda: None,
    )
    assert NvmlReader(scripted).read() == [
        GpuReading(0, "NVIDIA H200", 70, 0, 3),
        GpuReading(1, "NVIDIA H200", 71, HW_THERMAL, None),
    ]
