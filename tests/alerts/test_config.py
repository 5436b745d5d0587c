"""AlertsConfig: defaults, keyword-only construction, and validation that names the key."""

from __future__ import annotations

import dataclasses

import pytest

from clipforge.alerts.config import AlertsConfig


def test_defaults_are_valid_and_follow_the_seed():
    """The defaults construct, and the temperature threshold is the seed's 85 °C."""
    config = AlertsConfig()
    assert config.gpu_temp_celsius == 85.0
    assert config.max_consecutive_nonfinite >= 1


def test_fields_are_keyword_only():
    """Positional construction is refused, so a reordered field cannot shift values silently."""
    with pytest.raises(TypeError):
        AlertsConfig(3.0)  # type: ignore[misc]


def test_every_field_has_a_documented_default():
    """Every field has a default (params.yaml may omit the section) and documentation."""
    for field in dataclasses.fields(AlertsConfig):
        assert field.default is not dataclasses.MISSING, field.name
        assert field.metadata["doc"].strip(), f"{field.name} has no documentation"


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("loss_spike_factor", 1.0, "must be > 1.0"),
        ("loss_ema_beta", 1.0, "must be > 0.0 and < 1.0"),
        ("loss_ema_beta", 0.0, "must be > 0.0 and < 1.0"),
        ("loss_spike_warmup_steps", 0, ">= 1"),
        ("loss_spike_warmup_steps", 2.5, "must be an integer"),
        ("max_consecutive_nonfinite", 0, ">= 1"),
        ("max_consecutive_nonfinite", True, "must be an integer"),
        ("gpu_temp_celsius", 200.0, "must be >= 40.0 and <= 120.0"),
        ("gpu_poll_seconds", 0.0, "must be > 0.0 and <= 3600.0"),
        ("stall_timeout_seconds", -1.0, "> 0"),
        ("stall_timeout_seconds", float("nan"), "must be a finite number"),
        ("min_seconds_between_repeats", -1.0, ">= 0"),
        ("max_messages_per_window", 0, ">= 1"),
        ("rate_window_seconds", 0.0, "> 0"),
        ("max_retries", -1, ">= 0"),
        ("retry_backoff_seconds", -0.5, ">= 0"),
        ("http_timeout_seconds", 0.0, "> 0"),
        ("queue_size", 0, ">= 1"),
        ("flush_timeout_seconds", "30", "must be a number"),
    ],
)
def test_invalid_value_names_the_key_and_the_allowed_range(field, value, allowed):
    """A bad value raises ValueError naming alerts.<field> and what is allowed."""
    with pytest.raises(ValueError) as error:
        AlertsConfig(**{field: value})
    assert f"alerts.{field}" in str(error.value)
    assert allowed in str(error.value)


def test_integers_are_accepted_for_float_fields():
    """YAML `gpu_temp_celsius: 80` (an int) is a valid float setting."""
    assert AlertsConfig(gpu_temp_celsius=80).gpu_temp_celsius == 80
