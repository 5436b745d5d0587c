"""Kubernetes resource quantities ("64Gi", "500m", "1.5T"), parsed strictly.

The API server would reject a malformed quantity only at `pulumi up` time, after the namespace and
volumes were created; parsing here lets a bad stack fail before anything is touched, naming the key.
"""

from __future__ import annotations

import re
from decimal import Decimal

from clipforge.errors import UserError
from clipforge.util import short_repr

_UNIT_FACTORS = {
    None: 1,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}

_BYTES_RE = re.compile(r"^(?P<number>[0-9]+(\.[0-9]+)?)(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_CPU_RE = re.compile(r"^(?P<number>[0-9]+(\.[0-9]+)?)(?P<milli>m)?$")


class QuantityError(UserError, ValueError):
    """A quantity that is malformed, negative or zero."""


def parse_bytes(text: str) -> int:
    """Bytes in a memory or storage quantity such as ``64Gi`` or ``500G``; must be > 0."""
    match = _BYTES_RE.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise QuantityError(
            f"{short_repr(text)} is not a size: write a positive number with an optional unit "
            "(Ki, Mi, Gi, Ti or k, M, G, T), e.g. 64Gi"
        )
    value = int(Decimal(match.group("number")) * _UNIT_FACTORS[match.group("suffix")])
    if value <= 0:
        raise QuantityError(f"{short_repr(text)} is not a positive size")
    return value


def parse_cpu_millicores(text: str) -> int:
    """Millicores in a CPU quantity such as ``8``, ``0.5`` or ``500m``; must be >= 1m."""
    match = _CPU_RE.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise QuantityError(
            f"{short_repr(text)} is not a CPU amount: write cores (8, 0.5) or millicores (500m)"
        )
    number = Decimal(match.group("number"))
    millicores = int(number if match.group("milli") else number * 1000)
    if millicores <= 0:
        raise QuantityError(f"{short_repr(text)} is not a positive CPU amount")
    return millicores
