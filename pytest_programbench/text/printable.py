"""Text that can leave the process: every string from a sandbox or a submission (file names, program output, an
agent's log, the official result's error details, test names) headed for the terminal, a log, a report, a JUnit
property, a message or a JSON file.

:func:`printable` is the one escaper; each boundary calls it once, as the text is shown, never where it is stored
(eval.json keeps the official's values). It writes as visible escapes:

* C0 controls, DEL and C1 controls (U+0080-U+009F): ESC, BEL and NUL reach a terminal as a title change, a
  clipboard write (OSC 52), an erased line or a fake green ``PASSED``; an 8-bit terminal reads C1 as CSI and OSC.
  ``\\t`` and ``\\n`` are kept only with ``multiline=True`` (a message, a log, a report's text); ``\\r`` never is (it
  rewrites the line it ends).
* bidi embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069): they reorder what a reader sees.
* undecodable bytes. File names are bytes; Python decodes the ones that are not UTF-8 with lone surrogates
  (``surrogateescape``), and such a string cannot be encoded again: xdist then fails to send the report
  (``UnicodeEncodeError: surrogates not allowed``) and every remaining task is "not run". They are written as
  ``\\xNN``, as the evaluation log writes undecodable output (``errors="backslashreplace"``).

Backslashes are left alone (a Windows path reads as typed), so the function is idempotent: escaping twice, at two
boundaries a text happens to cross, shows the same text. An undecodable byte and the C1 control of the same value
read alike (``\\x9b``); both are escaped, which is what matters.
"""

from __future__ import annotations

import logging
import re
from typing import Any

_UNSAFE = r"\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE_IN_LINES = re.compile(f"[{_UNSAFE}]")  # \t and \n kept
_UNSAFE_IN_A_LINE = re.compile(f"[\t\n{_UNSAFE}]")


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    if char in "\t\n\r":
        return repr(char)[1:-1]
    if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte, as surrogateescape keeps it
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, multiline: bool = False) -> str:
    """``text`` safe for a terminal, a log, JUnit or HTML-as-text, and always encodable: control characters, bidi
    overrides and undecodable bytes as visible escapes (``\\x1b``, ``\\u202e``, ``\\xff``); tabs and newlines kept
    with ``multiline``."""
    return (_UNSAFE_IN_LINES if multiline else _UNSAFE_IN_A_LINE).sub(_escape, text)


def sanitise(value: Any, *, multiline: bool = True) -> Any:
    """``value`` with :func:`printable` applied to every string in it (tuples, lists and dicts walked)."""
    if isinstance(value, str):
        return printable(value, multiline=multiline)
    if isinstance(value, tuple):
        return tuple(sanitise(v, multiline=multiline) for v in value)
    if isinstance(value, list):
        return [sanitise(v, multiline=multiline) for v in value]
    if isinstance(value, dict):
        return {sanitise(k, multiline=multiline): sanitise(v, multiline=multiline) for k, v in value.items()}
    return value


def html_text(value: Any) -> Any:
    """Jinja's ``finalize`` for a report page: every value a template prints, escaped as :func:`printable` before
    autoescape turns markup into entities (a value already marked safe markup is left as it is)."""
    if isinstance(value, str) and not hasattr(value, "__html__"):
        return printable(value, multiline=True)
    return value


class PrintableRecords(logging.Filter):
    """On a handler that writes to the terminal or a file (pytest's live log and ``--log-file``): the record's
    message and traceback made :func:`printable` (multi-line) before any handler formats it. Records of every logger
    pass one handler, so this covers the official evaluator's ``Output: ...`` lines too. It never drops a record and
    never raises (a filter that raised would break the caller's log call)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: the handler reports it as logging does
            return True
        record.msg, record.args = printable(message, multiline=True), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = printable(record.exc_text, multiline=True)
        if record.stack_info:
            record.stack_info = printable(record.stack_info, multiline=True)
        return True
