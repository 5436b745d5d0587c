"""`fab compare RUN_A RUN_B`: two runs side by side, and a verdict on whether they agree.

Pure: two read run folders (clipforge.repro.run_folder) in, a Comparison out; `format_report`
words it. The order is the order of causes: params, data and environment differences first, since
they explain the rest; then the metrics with their deltas; then the final weights.

The verdict: `identical` when the final weights are bit-identical (what a rerun on the same stack
and world size gives: training is deterministic on CPU and in clipforge's GPU settings);
`within tolerance` (given a tolerance above 0) when they are not, but every metric of both runs differs by at most the given
absolute tolerance (the band to allow across stacks or hardware, which the user states; clipforge
does not guess it); else `different`. Only the first two pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from clipforge.repro.run_folder import RunFolder
from clipforge.util import flatten

# Environment fields that describe the machine's name, not what decides the numbers.
_NOT_COMPARED = ("process",)
IDENTICAL, WITHIN, DIFFERENT = "identical", "within tolerance", "different"


@dataclass(frozen=True)
class Difference:
    key: str
    a: object
    b: object


@dataclass(frozen=True)
class MetricRow:
    key: str
    a: float | None
    b: float | None

    @property
    def delta(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    params: list[Difference]
    data: Difference | None
    environment: list[Difference]
    metrics: list[MetricRow]
    weights_identical: bool
    tolerance: float
    verdict: str
    reason: str

    @property
    def passed(self) -> bool:
        return self.verdict in (IDENTICAL, WITHIN)


def differences(a: dict, b: dict) -> list[Difference]:
    """Key by key (dotted), every key of either whose values differ."""
    flat_a, flat_b = flatten(a), flatten(b)
    return [
        Difference(key, flat_a.get(key), flat_b.get(key))
        for key in sorted(set(flat_a) | set(flat_b))
        if flat_a.get(key) != flat_b.get(key)
    ]


def compare(a: RunFolder, b: RunFolder, tolerance: float = 0.0) -> Comparison:
    env_a = {k: v for k, v in (a.environment or {}).items() if k not in _NOT_COMPARED}
    env_b = {k: v for k, v in (b.environment or {}).items() if k not in _NOT_COMPARED}
    data = None
    if a.data_manifest_sha256 != b.data_manifest_sha256:
        data = Difference("data_manifest_sha256", a.data_manifest_sha256, b.data_manifest_sha256)
    env_a.pop("data_manifest_sha256", None)
    env_b.pop("data_manifest_sha256", None)
    rows = [
        MetricRow(key, a.metrics.get(key), b.metrics.get(key))
        for key in sorted(set(a.metrics) | set(b.metrics))
    ]
    weights_identical = a.weights_sha256 == b.weights_sha256
    verdict, reason = _verdict(rows, weights_identical, tolerance)
    return Comparison(
        a=str(a.path),
        b=str(b.path),
        params=differences(a.params, b.params),
        data=data,
        environment=differences(env_a, env_b),
        metrics=rows,
        weights_identical=weights_identical,
        tolerance=tolerance,
        verdict=verdict,
        reason=reason,
    )


def _verdict(rows: list[MetricRow], weights_identical: bool, tolerance: float) -> tuple[str, str]:
    if weights_identical:
        return IDENTICAL, "the final weights are bit-identical"
    missing = [r.key for r in rows if r.delta is None]
    if missing:
        return DIFFERENT, f"the weights differ, and only one run has {', '.join(missing)}"
    worst = max(rows, key=lambda r: abs(r.delta or 0.0), default=None)
    if worst is None:
        return DIFFERENT, "the weights differ, and neither run has metrics"
    gap = abs(worst.delta or 0.0)
    if tolerance > 0 and math.isfinite(gap) and gap <= tolerance:
        return (
            WITHIN,
            f"the weights differ; every metric within {tolerance:g} (worst: {worst.key} {gap:.3g})",
        )
    return DIFFERENT, (
        f"the weights differ, and {worst.key} by {gap:.3g} (tolerance {tolerance:g})"
    )


def format_report(result: Comparison) -> str:
    lines = [f"A: {result.a}", f"B: {result.b}", ""]
    lines += _section("params", result.params)
    lines += _section("data", [result.data] if result.data else [])
    lines += _section("environment", result.environment)
    lines += ["", "metrics:"]
    width = max((len(r.key) for r in result.metrics), default=6)
    lines.append(f"  {'':{width}}  {'A':>12}  {'B':>12}  {'delta':>12}")
    for row in result.metrics:
        lines.append(
            f"  {row.key:{width}}  {_number(row.a):>12}  {_number(row.b):>12}  "
            f"{_number(row.delta, signed=True):>12}"
        )
    lines += ["", f"weights: {'bit-identical' if result.weights_identical else 'differ'}"]
    lines.append(f"verdict: {result.verdict}: {result.reason}")
    return "\n".join(lines)


def _section(name: str, items: list[Difference]) -> list[str]:
    if not items:
        return [f"{name}: same"]
    lines = [f"{name}: {len(items)} differ{'s' if len(items) == 1 else ''}"]
    return lines + [f"  {d.key}: {_value(d.a)} -> {_value(d.b)}" for d in items]


def _value(value: object) -> str:
    return "(none)" if value is None else str(value)


def _number(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.6g}" if signed else f"{value:.6g}"
