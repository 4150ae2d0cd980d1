"""The suite's own schedule, as the plugin schedules tasks: modules longest first, from a committed durations file.

``tests/durations.json`` maps each test module (``tests/test_x.py``) to the seconds its tests took in a run (setup,
call and teardown of every test case, summed), written from that run's JUnit XML by this module::

    python -m tests.durations .ci/out/junit.xml .ci/out/junit-*.xml   # rewrites tests/durations.json

Modules a given XML does not cover keep their recorded figure (a partial run refreshes what it ran). The suite's
conftest orders collection by it (``order_modules``): under ``--dist loadfile --no-loadscope-reorder`` xdist hands
out whole modules in collection order, so the longest start first and the short ones fill in at the end. A module
the file does not know yet is placed as the median module.
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent
DURATIONS = Path(__file__).resolve().parent / "durations.json"

T = TypeVar("T")


def module_of(classname: str, root: Path = REPO) -> str | None:
    """``tests.test_x`` or ``tests.test_x.TestY`` (a JUnit classname) as the module's path ``tests/test_x.py``."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end]) + ".py"
        if (root / candidate).is_file():
            return candidate
    return None


def read_junit(paths: Iterable[Path], root: Path = REPO) -> dict[str, float]:
    """Seconds per module over every test case of the given JUnit XML files."""
    seconds: dict[str, float] = {}
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            module = module_of(case.get("classname", ""), root)
            if module is not None:
                seconds[module] = seconds.get(module, 0.0) + float(case.get("time") or 0)
    return seconds


def load(path: Path = DURATIONS) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def write(seconds: dict[str, float], path: Path = DURATIONS) -> None:
    ordered = dict(sorted(((k, round(v, 1)) for k, v in seconds.items()), key=lambda kv: (-kv[1], kv[0])))
    path.write_text(json.dumps(ordered, indent=1) + "\n")


def order_modules(items: Sequence[T], module: dict[str, float], path_of: dict[int, str]) -> list[T]:
    """``items`` longest module first (by ``module``, seconds per module path); stable within a module and between
    equal figures. ``path_of`` maps ``id(item)`` to its module path. Unknown modules weigh as the median module."""
    default = statistics.median(module.values()) if module else 0.0
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(path_of[id(item)], len(first_seen))

    def key(item: T) -> tuple[float, int]:
        path = path_of[id(item)]
        return (-module.get(path, default), first_seen[path])

    return sorted(items, key=key)


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    seconds = load()
    seconds.update(read_junit(Path(a) for a in argv))
    write(seconds)
    total = sum(seconds.values())
    print(f"{DURATIONS}: {len(seconds)} modules, {total:.0f} s in all; longest: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])[:5]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
