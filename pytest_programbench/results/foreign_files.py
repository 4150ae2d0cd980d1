"""Files of a run directory or entry given to ``--pb-compare``/``--pb-report``: untrusted input, read here and only
here. Anyone can hand over such a directory (a registry entry, a colleague's run), so nothing in it is believed:

* a file is read only inside the directory (resolved, symlinks followed, then checked for containment), only when it
  is a regular file (a FIFO would block, ``/dev/zero`` never ends), and only up to a cap known before reading: its
  size is checked with ``fstat`` on the opened file (a sparse 6 GiB file is refused without a byte read) and the read
  itself stops one byte past the cap (a file that grows meanwhile is refused too);
* JSON and YAML are parsed from those bytes, deep nesting refused; YAML with the safe loader and no aliases (an alias
  bomb expands a few hundred bytes into gigabytes; ``submit package`` renders ``submission.yaml`` from a template
  and ``register`` dumps ``pointer.yaml`` with ``safe_dump`` of plain values, so no entry needs one);
* an id names a task only when it has a task id's shape (:func:`is_task_id`) and the catalogue knows it
  (foreign_runs.py): never a path, a scheme or a control byte;
* a link is a relative path (percent-quoted, so a ``name:`` reads ``name%3A``, never a scheme; never starting
  with ``/``) to a regular file inside.

Every refusal is a :class:`ForeignFileError`, one line naming the file (printable: the name may hold any byte).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from pytest_programbench.text.printable import printable
from pytest_programbench.text.sizes import human

# Caps, each well above what the benchmark's largest honest file holds (the full benchmark's per-test score.json is
# about 20 MiB; an eval.json keeps its tests' output, which the official caps).
JSON_MAX = 64 << 20  # score.json, cost.json, summary.json, ignored_tests.json
RECORD_MAX = 1 << 20  # pb-run.json
EVAL_JSON_MAX = 256 << 20  # <id>.eval.json, <id>.eval.log.json
YAML_MAX = 1 << 20  # submission.yaml
NESTING_MAX = 64  # JSON/YAML depth: the deepest honest file (eval.json) nests 5

# A task id as programbench writes them (``owner__repo.commit``): no separator, no scheme, no control byte.
TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


class ForeignFileError(Exception):
    """A file of a foreign directory refused: why, naming the file, on one printable line."""

    def __init__(self, path: Path | str, why: str) -> None:
        super().__init__(printable(f"{path}: {why}"))


def is_task_id(name: str) -> bool:
    return TASK_ID.fullmatch(name) is not None and ".." not in name


def inside(root: Path, path: Path) -> Path:
    """``path`` resolved, when it lies inside ``root`` (resolved too); a ForeignFileError otherwise."""
    try:
        resolved = path.resolve()
        base = root.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise ForeignFileError(path, f"cannot be resolved ({type(exc).__name__})") from None
    if not resolved.is_relative_to(base):
        raise ForeignFileError(path, f"leads outside {base} (to {resolved}); a run's files are read only inside it")
    return resolved


def read_bytes(path: Path, *, root: Path, limit: int) -> bytes:
    """The bytes of ``path``, a regular file inside ``root`` of at most ``limit`` bytes."""
    resolved = inside(root, path)
    try:  # non-blocking: opening a FIFO must not wait for a writer
        fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise ForeignFileError(path, f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    with os.fdopen(fd, "rb", buffering=0) as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ForeignFileError(path, "is not a regular file")
        if info.st_size > limit:
            raise ForeignFileError(path, f"holds {human(info.st_size)}, above the {human(limit)} such a file may "
                                         "hold; not read")
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0 and (chunk := handle.read(min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    data = b"".join(chunks)
    if len(data) > limit:
        raise ForeignFileError(path, f"grew past the {human(limit)} such a file may hold while read; not read")
    return data


def _depth(value: Any, limit: int = NESTING_MAX) -> int:
    """How deep ``value`` nests, counted up to ``limit + 1`` (iterative: a deep value cannot exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, dict | list):
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            break
        stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_json(path: Path, *, root: Path, limit: int = JSON_MAX) -> Any:
    """``path`` parsed as JSON, read as :func:`read_bytes` reads."""
    data = read_bytes(path, root=root, limit=limit)
    try:
        value = json.loads(data)
    except RecursionError:
        raise ForeignFileError(path, f"is not readable JSON (nested deeper than {NESTING_MAX})") from None
    except ValueError as exc:
        raise ForeignFileError(path, f"is not readable JSON ({exc})") from None
    if _depth(value) > NESTING_MAX:
        raise ForeignFileError(path, f"is not readable JSON (nested deeper than {NESTING_MAX})")
    return value


class _NoAliases(yaml.SafeLoader):
    """The safe loader that refuses an alias (``*name``) where the composer would follow one."""

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(None, None, "an alias (*name), which no entry needs: refused",
                                              event.start_mark)
        return super().compose_node(parent, index)


def read_yaml(path: Path, *, root: Path, limit: int = YAML_MAX) -> Any:
    """``path`` parsed as YAML by the safe loader with aliases refused, read as :func:`read_bytes` reads."""
    data = read_bytes(path, root=root, limit=limit)
    try:
        value = yaml.load(data, Loader=_NoAliases)  # noqa: S506 - _NoAliases is SafeLoader, aliases refused
    except RecursionError:
        raise ForeignFileError(path, f"is not readable YAML (nested deeper than {NESTING_MAX})") from None
    except yaml.YAMLError as exc:
        raise ForeignFileError(path, f"is not readable YAML ({' '.join(str(exc).split())})") from None
    if _depth(value) > NESTING_MAX:
        raise ForeignFileError(path, f"is not readable YAML (nested deeper than {NESTING_MAX})")
    return value


def link(root: Path, relative: str) -> str | None:
    """A page's link to ``relative`` (a file under ``root``, the page's directory), percent-quoted so it can only be
    a relative path (``:`` as ``%3A``: no scheme; no leading ``/``: no host); None when the file is not a regular file
    inside ``root``."""
    target = root / relative
    if Path(relative).is_absolute() or not target.is_file():
        return None
    try:
        inside(root, target)
    except ForeignFileError:
        return None
    return quote(relative)
