"""Sizes as people write them (``10g``, ``512m``, bytes) and as they read them (``3.0 GiB``)."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: str) -> int:
    match = _SIZE.match(value.strip())
    if not match:
        raise ValueError(f"{value!r} is not a size (examples: 10g, 512m, 1073741824)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover - the loop returns
