"""Durations as operators write them: a number of seconds, or a number with a unit.

``10``, ``10s``, ``500ms``, ``1.5m``, ``1h``: exactly what the chart's values schema accepts
(``^[0-9]+(\\.[0-9]+)?(ms|s|m|h)?$``), so a value that passes there runs here. No sign, no
exponent, no NaN or infinity, ASCII digits only; the caller bounds the result to its range.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

_DURATION = re.compile(r"([0-9]{1,20}(?:\.[0-9]{1,20})?)(ms|s|m|h)?", re.ASCII)
_SECONDS_PER = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
N = TypeVar("N", int, float)
SYNTAX = "a number of seconds or a number with ms, s, m or h (500ms, 10s, 1m)"


def parse_seconds(text: str) -> float:
    """``text`` in seconds; ValueError naming the accepted forms when it is none of them."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"must be {SYNTAX}, got {text[:40]!r}")
    return float(match.group(1)) * _SECONDS_PER[match.group(2)]


def show(seconds: float) -> str:
    """``seconds`` as a duration an operator would write: 500ms, 10s, 1m, 1.5h."""
    for unit, size in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and (seconds / size) * 10 == int((seconds / size) * 10):
            return f"{seconds / size:g}{unit}"
    return f"{seconds * 1000:g}ms"


def within(parse: Callable[[str], N], low: N, high: N, what: str) -> Callable[[str], N]:
    """``parse`` bounded to [low, high] (both inclusive): a value it refuses or one out of range
    is a ValueError saying it ``must be <what>`` and quoting a bounded prefix of the text."""

    def bounded(text: str) -> N:
        try:
            value: N | None = parse(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise ValueError(f"must be {what}, got {text[:40]!r}")
        return value

    return bounded


def seconds_range(low: float, high: float) -> Callable[[str], float]:
    """A parser of durations within [low, high] seconds (both inclusive)."""
    return within(parse_seconds, low, high, f"a duration from {show(low)} to {show(high)} ({SYNTAX})")
