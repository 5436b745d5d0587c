"""Throughput figures per log interval and per run: samples/s, MFU, data-wait share."""

from __future__ import annotations

import pytest

from clipforge.train.reporting import PerfMeter


def test_interval_figures_come_from_step_times_and_reset_while_the_run_totals_go_on():
    meter = PerfMeter(
        128, flops_per_sample=1e9, peak_flops_per_rank=1e11, world_size=2, device="cpu"
    )
    meter.step_done(seconds=2.0, data_wait_seconds=0.5)
    meter.step_done(seconds=2.0, data_wait_seconds=0.5)
    first = meter.interval()
    assert first["samples_per_s"] == pytest.approx(64.0)  # 2 x 128 samples in 4 s
    assert first["mfu"] == pytest.approx(64 * 1e9 / (1e11 * 2))  # both ranks' peaks
    assert first["data_wait_share"] == pytest.approx(0.25) and first["step_s"] == pytest.approx(2.0)
    assert first["peak_mem_gb"] > 0
    meter.step_done(seconds=1.0, data_wait_seconds=0.0)
    assert meter.interval()["samples_per_s"] == pytest.approx(128.0)  # only the new step
    assert meter.run()["samples_per_s"] == pytest.approx(3 * 128 / 5.0)  # all three


def test_no_peak_no_mfu():
    meter = PerfMeter(
        128, flops_per_sample=1e9, peak_flops_per_rank=None, world_size=1, device="cpu"
    )
    meter.step_done(1.0, 0.0)
    assert meter.interval()["mfu"] is None
