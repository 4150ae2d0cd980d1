"""Exploration coverage: the options the hidden tests pass to the program against the options the agent passed to the
reference through the proxy.

The hidden side is read on the host, after the evaluation, from the task's hidden test archives (the ``BlobSet`` the
pipeline resolved; never shown to the agent, never copied into its sandbox): every ``*.py`` member of each active
branch's archive is parsed with :mod:`ast` and every string (or bytes) literal that reads as an option counts, ``-n``,
``--width`` (``--width=80`` is ``--width``), including the literal parts of f-strings. A literal reads as an option
when it is ``-`` or ``--`` followed by a letter and then letters, digits, ``_`` or ``-`` only: ``-``, ``--``, ``-3``
(a negative number) and ``--foo bar`` (a shell line) are not options.

The agent's side is ``binary-calls.jsonl``: every argument of every proxied call read the same way, up to a ``--``.

What it cannot see, so what it may miss or count wrongly: options built at run time (``"-" + flag``, a list from a
loop, a value read from a data file or a fixture); options in non-Python files of the tests (shell scripts, data);
options the tests pass through stdin, a config file or an environment variable; combined short flags (``-nE`` is
one option to this count, not ``-n`` and ``-E``); options of ignored tests count like the rest (the archive's sources
are read whole, not test by test); options the agent passed to a program it built itself (only the reference's calls
are recorded). Every walk is bounded (members, bytes per source, bytes per task, options kept) and total: a problem is a
note, never an error or a score.
"""

from __future__ import annotations

import ast
import json
import re
import tarfile
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OPTION = re.compile(r"--?[A-Za-z][A-Za-z0-9_-]*")
SOURCE_MAX = 2 << 20  # bytes of one test source parsed (a larger one is skipped, said in a note)
SOURCES_MAX = 16 << 20  # bytes of a task's test sources parsed in all
MEMBERS_MAX = 50_000  # archive members looked at per branch
OPTIONS_MAX = 5_000  # distinct options kept per side
CALL_LINES_MAX = 2_000_000  # lines of binary-calls.jsonl read (the proxy's log is capped far below)
NAMES_SHOWN = 200  # option names listed per task in summary.json (the counts are always whole)


def option_of(text: str) -> str | None:
    """The option a literal or an argument spells (``--width=80`` -> ``--width``), or None."""
    head = text.split("=", 1)[0]
    return head if OPTION.fullmatch(head) else None


@dataclass
class HiddenOptions:
    """The options in a task's hidden test sources: each with the number of literals spelling it."""

    options: Counter[str] = field(default_factory=Counter)
    sources: int = 0  # Python sources parsed
    notes: list[str] = field(default_factory=list)


def _literals(tree: ast.AST) -> Iterable[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):
                yield node.value
            elif isinstance(node.value, bytes):
                yield node.value.decode("ascii", "replace")


def hidden_options(archives: Iterable[Path]) -> HiddenOptions:
    """Every option literal of the Python sources in ``archives`` (gzip tars), bounded; never raises."""
    found = HiddenOptions()
    budget = SOURCES_MAX
    for archive in archives:
        try:
            with tarfile.open(archive, mode="r|gz") as tar:  # streamed: one pass, no seeking
                for count, member in enumerate(tar):
                    if count >= MEMBERS_MAX:
                        found.notes.append(f"{archive.name}: only the first {MEMBERS_MAX} members read")
                        break
                    if not member.isfile() or not member.name.endswith(".py"):
                        continue
                    if member.size > SOURCE_MAX or member.size > budget:
                        found.notes.append(f"{archive.name}: {member.name} not read ({member.size} bytes)")
                        continue
                    handle = tar.extractfile(member)
                    if handle is None:
                        continue
                    data = handle.read(member.size)
                    budget -= len(data)
                    _parse_into(found, data, f"{archive.name}: {member.name}")
        except (OSError, EOFError, tarfile.TarError, zlib.error) as exc:
            found.notes.append(f"{archive.name}: cannot be read ({exc})")
    return found


def _parse_into(found: HiddenOptions, data: bytes, where: str) -> None:
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        found.notes.append(f"{where}: not parsed ({type(exc).__name__})")
        return
    found.sources += 1
    for text in _literals(tree):
        option = option_of(text)
        if option is not None and (option in found.options or len(found.options) < OPTIONS_MAX):
            found.options[option] += 1


@dataclass
class AgentOptions:
    """The options the agent passed to the reference: each with the number of calls passing it."""

    options: Counter[str] = field(default_factory=Counter)
    calls: int = 0
    notes: list[str] = field(default_factory=list)


def agent_options(calls_log: Path) -> AgentOptions | None:
    """The options in ``binary-calls.jsonl``'s argvs (``argv[0]`` and what follows ``--`` left out); None without
    the file (no agent ran here: an evaluate-only run). Never raises."""
    found = AgentOptions()
    try:
        with calls_log.open(encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle):
                if number >= CALL_LINES_MAX:
                    found.notes.append(f"only the first {CALL_LINES_MAX} calls read")
                    break
                _count_call(found, line)
    except FileNotFoundError:
        return None
    except OSError as exc:
        found.notes.append(f"{calls_log.name} cannot be read ({exc})")
    return found


def _count_call(found: AgentOptions, line: str) -> None:
    try:
        record = json.loads(line)
    except ValueError:
        return
    argv = record.get("argv") if isinstance(record, dict) else None
    if not isinstance(argv, list):
        return
    found.calls += 1
    seen: set[str] = set()
    for arg in argv[1:]:
        if arg == "--":
            break
        option = option_of(arg) if isinstance(arg, str) else None
        if option is not None and option not in seen and (option in found.options
                                                          or len(found.options) < OPTIONS_MAX):
            seen.add(option)
            found.options[option] += 1


def measure(hidden: HiddenOptions, agent: AgentOptions | None) -> dict[str, Any]:
    """A task's coverage as pb-meta.json and summary.json hold it: the hidden options (``total``), how many the agent
    passed (``covered``; None when no agent ran), which it never tried and which it did (each list capped at
    ``NAMES_SHOWN``, the counts whole), and how much each side read."""
    options = sorted(hidden.options)
    tried = [] if agent is None else [o for o in options if o in agent.options]
    never = [o for o in options if agent is None or o not in agent.options]
    return {
        "total": len(options),
        "covered": None if agent is None else len(tried),
        "never_tried": never[:NAMES_SHOWN],
        "tried": tried[:NAMES_SHOWN],
        "agent_options": None if agent is None else len(agent.options),
        "calls": None if agent is None else agent.calls,
        "sources": hidden.sources,
        "notes": [*hidden.notes[:20], *(agent.notes if agent is not None else [])],
    }


def measure_task(archives: Iterable[Path], calls_log: Path) -> dict[str, Any]:
    """:func:`measure` of a task's active branches' archives and its call log; a failure of ours is a note."""
    try:
        return measure(hidden_options(archives), agent_options(calls_log))
    except Exception as exc:  # a probe of ours never breaks a task: what went wrong is said instead
        return {"total": None, "covered": None, "never_tried": [], "tried": [], "agent_options": None,
                "calls": None, "sources": 0, "notes": [f"coverage not measured: {type(exc).__name__}: {exc}"]}


def fraction(row: Mapping[str, Any] | None) -> float | None:
    """covered / total of a coverage record, None when not measured or the tests pass no option."""
    if not isinstance(row, Mapping):
        return None
    total, covered = row.get("total"), row.get("covered")
    if not isinstance(total, int) or not total or not isinstance(covered, int | float):
        return None
    return covered / total


def mean_coverage(rows: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """A task's coverage over its attempts: ``covered`` the mean over the attempts measured, ``never_tried`` what no
    attempt tried, ``tried`` what any did, ``by_attempt`` each attempt's count (None: not measured)."""
    measured = [r for r in rows if isinstance(r, Mapping) and isinstance(r.get("covered"), int)]
    known = [r for r in rows if isinstance(r, Mapping) and isinstance(r.get("total"), int)]
    if not known:
        return None
    base = dict(known[-1])
    if measured:
        never = set(measured[0].get("never_tried") or [])
        tried: set[str] = set()
        for row in measured:
            never &= set(row.get("never_tried") or [])
            tried |= set(row.get("tried") or [])
        base.update(covered=round(sum(int(r["covered"]) for r in measured) / len(measured), 3),
                    never_tried=sorted(never), tried=sorted(tried),
                    calls=round(sum(int(r.get("calls") or 0) for r in measured) / len(measured), 3))
    base["by_attempt"] = [r.get("covered") if isinstance(r, Mapping) else None for r in rows]
    return base


def run_figure(rows: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """The run's figure: options covered of the options the hidden tests pass, summed over the tasks measured, and
    the mean of the tasks' fractions (tasks whose tests pass no option left out of the mean)."""
    covered = total = tasks = 0.0
    fractions = []
    for row in rows:
        if not isinstance(row, Mapping) or not isinstance(row.get("covered"), int | float) \
                or not isinstance(row.get("total"), int):
            continue
        tasks += 1
        covered += row["covered"]
        total += row["total"]
        value = fraction(row)
        if value is not None:
            fractions.append(value)
    return {"tasks": int(tasks), "covered": round(covered, 3), "total": int(total),
            "fraction": round(covered / total, 6) if total else None,
            "mean_fraction": round(sum(fractions) / len(fractions), 6) if fractions else None}


def _measured(row: Any) -> bool:
    return isinstance(row, Mapping) and isinstance(row.get("covered"), int | float) \
        and isinstance(row.get("total"), int)


def compare_task(base: Any, new: Any) -> dict[str, Any]:
    """One task's coverage in two runs (summary.json's ``coverage``): the counts, their delta, and the options the new
    run tried that the base did not (and the other way round)."""
    b = base if _measured(base) else None
    n = new if _measured(new) else None
    total = next((r["total"] for r in (n, b, new, base) if isinstance(r, Mapping) and isinstance(r.get("total"), int)),
                 None)
    out: dict[str, Any] = {"total": total, "base": None if b is None else b["covered"],
                           "new": None if n is None else n["covered"], "delta": None, "newly_tried": [],
                           "no_longer_tried": []}
    if b is not None and n is not None:
        out["delta"] = round(float(n["covered"]) - float(b["covered"]), 3)
        before, after = set(b.get("tried") or []), set(n.get("tried") or [])
        out["newly_tried"] = sorted(after - before)[:NAMES_SHOWN]
        out["no_longer_tried"] = sorted(before - after)[:NAMES_SHOWN]
    return out


def compare_runs(tasks: Mapping[str, Mapping[str, Any]], base: Iterable[Any], new: Iterable[Any]) -> dict[str, Any]:
    """The runs' figures (each over its own tasks) and, over the tasks both measured, how many the new run explored
    more, less or as much (``tasks``: compare_task of each task in both runs)."""
    deltas = [row["delta"] for row in tasks.values() if row.get("delta") is not None]
    return {"base": run_figure(base), "new": run_figure(new), "paired": len(deltas),
            "more": sum(d > 0 for d in deltas), "fewer": sum(d < 0 for d in deltas),
            "same": sum(d == 0 for d in deltas)}


def compare_line(result: Mapping[str, Any]) -> str | None:
    """The terminal's line on exploration: both runs' figures and the tasks explored more or less; None when neither
    run measured any."""
    base, new = result["base"], result["new"]
    if not base["tasks"] and not new["tasks"]:
        return None

    def figure(fig: Mapping[str, Any]) -> str:
        if not fig["tasks"]:
            return "not measured"
        covered = fig["covered"]
        return f"{covered:g}/{fig['total']}" + (f" ({100 * fig['fraction']:.0f}%)" if fig["fraction"] is not None
                                                else "")

    return (f"options the hidden tests pass, tried by the agent: {figure(base)} -> {figure(new)}; over the "
            f"{result['paired']} task(s) both measured, {result['more']} explored more, {result['fewer']} less, "
            f"{result['same']} as much")
