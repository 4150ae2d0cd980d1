"""Text that can leave the process: every string headed for a report, a JUnit property, a message, a JSON file or
the terminal.

File names are bytes; Python decodes the ones that are not UTF-8 with lone surrogates (``surrogateescape``), and
such a string cannot be encoded again: xdist then fails to send the report (``UnicodeEncodeError: surrogates not
allowed``) and every remaining task is "not run". :func:`printable` writes the undecodable bytes as ``\\xNN``
escapes, as the evaluation log writes undecodable output (``errors="backslashreplace"``).
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte, as surrogateescape keeps it
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with every lone surrogate escaped (``\\xNN`` for an undecodable byte): always encodable."""
    return _SURROGATE.sub(_escape, text)


def sanitise(value: Any) -> Any:
    """``value`` with :func:`printable` applied to every string in it (tuples, lists and dicts walked)."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, tuple):
        return tuple(sanitise(v) for v in value)
    if isinstance(value, list):
        return [sanitise(v) for v in value]
    if isinstance(value, dict):
        return {sanitise(k): sanitise(v) for k, v in value.items()}
    return value
