"""Durations and sizes that always carry a unit.

Config files and CLI flags spell durations as ``"250ms"``, ``"30s"``, ``"5m"``, ``"24h"`` or ``"7d"``
and sizes as ``"512B"``, ``"256KiB"``, ``"1MiB"``, ``"8GiB"``. A bare number is rejected: the unit
is exactly the part people get wrong (a DLRover expiry was documented in ms and checked as seconds).
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_DURATION_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|TiB)\s*$")
_SIZE_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


def parse_duration(value: Any) -> timedelta:
    """Parse ``"30s"``-style text (or pass a ``timedelta`` through). Raises ``ValueError`` otherwise."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or isinstance(value, (int, float)):
        raise ValueError(f"duration needs a unit (ms, s, m, h, d), e.g. '{value}s'; got bare number {value!r}")
    if not isinstance(value, str):
        raise ValueError(f"duration must be text such as '30s', got {type(value).__name__}")
    match = _DURATION_RE.match(value)
    if not match:
        raise ValueError(f"invalid duration {value!r}: expected a number and a unit (ms, s, m, h, d), e.g. '30s'")
    return timedelta(seconds=float(match.group(1)) * _DURATION_UNITS_S[match.group(2)])


def format_duration(value: timedelta) -> str:
    """The shortest exact spelling that ``parse_duration`` reads back."""
    total_ms = round(value.total_seconds() * 1000)
    for unit, factor_ms in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if total_ms and total_ms % factor_ms == 0:
            return f"{total_ms // factor_ms}{unit}"
    return f"{total_ms}ms"


def parse_size(value: Any) -> int:
    """Parse ``"256KiB"``-style text into bytes. A bare number is rejected."""
    if isinstance(value, bool) or isinstance(value, (int, float)):
        raise ValueError(f"size needs a unit (B, KiB, MiB, GiB, TiB), e.g. '{value}B'; got bare number {value!r}")
    if not isinstance(value, str):
        raise ValueError(f"size must be text such as '256KiB', got {type(value).__name__}")
    match = _SIZE_RE.match(value)
    if not match:
        raise ValueError(f"invalid size {value!r}: expected an integer and a unit (B, KiB, MiB, GiB, TiB)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def format_size(num_bytes: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        factor = _SIZE_UNITS[unit]
        if num_bytes and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return f"{num_bytes}B"


Duration = Annotated[timedelta, BeforeValidator(parse_duration), PlainSerializer(format_duration, return_type=str)]
"""A pydantic field type: a ``timedelta`` read from text with a unit."""

ByteSize = Annotated[int, BeforeValidator(parse_size), PlainSerializer(format_size, return_type=str)]
"""A pydantic field type: a byte count read from text with a unit."""
