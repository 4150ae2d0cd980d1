"""``--pb-gold N``: the reference evaluated as its own submission, N times per task, and what that says about the
hidden tests (``gold-ledger.json``); ``--pb-gold-ledger FILE``: a ledger read back on a normal run.

The gold submission is the reference's bytes (read out of the task image, where the official images keep it at
``/workspace/executable``) behind a one-line header (``reference.gold``), a ``compile.sh`` that strips the header
into ``./executable`` and checks its sha256, and ``.pb-gold-run`` holding the run's number (no real hidden test reads
it; a fixture task uses it to flake deterministically). The header is why it works on real tasks: the official
deletes every workspace file whose sha256 is in ``eval_clean_hashes`` (161 of the 200 list the reference's) before
``compile.sh``, so the raw bytes would never get there. It goes through the very same evaluation as any submission,
at the run's ``--pb-cpus``, branch workers and clocks; the official hash check and our ``reference_executable`` flag
fire by design and are recorded, never a failure. A gold run whose build is not the reference (compile failed, another
hash) measured nothing: :func:`require_reference_built` makes it an error, never a score or a ledger entry.

A test of a task's active branches that is not ignored upstream and that the reference passes in none of the N runs
is *impossible*; in some but not all, *flaky*. The task's *ceiling* is its mean gold score: what a perfect clone
reaches on this machine. The ledger also carries both lists in the shape of tests.json's ``ignored_tests`` (reason
``gold_flaky``), ready to propose upstream.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from programbench.eval.eval import EvaluationResult
from programbench.utils.load_data import get_active_branches, get_ignored_tests

from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.engine.archive_out import REGULAR, first_member
from pytest_programbench.results import task_meta

LEDGER = "gold-ledger.json"
REASON = "gold_flaky"
REFERENCE_PATH = "/workspace/executable"
REFERENCE_MAX_BYTES = 2 << 30
MARKER = ".pb-gold-run"
SHIPPED = "reference.gold"
# Any header will do: it only has to make the shipped file's sha256 differ from the reference's.
HEADER = b"pytest-programbench --pb-gold: the task's reference binary follows this line\n"
# coreutils only (tail, sha256sum: the official itself runs sha256sum in the task image), no gzip or python needed.
COMPILE_SH = """#!/bin/sh
# The reference's own bytes as the executable (pytest-programbench --pb-gold). They come behind a header so that
# no shipped file has the reference's sha256: the official removes such files (eval_clean_hashes) before this runs.
set -e
tail -c +{skip} {shipped} > executable
chmod 755 executable
got=$(sha256sum executable | cut -d' ' -f1)
if [ "$got" != "{sha256}" ]; then
  echo "pytest-programbench --pb-gold: ./executable has sha256 $got, the reference's is {sha256}" >&2
  exit 1
fi
"""
MESSAGES_KEPT = 3  # distinct failure messages per test
MESSAGE_CHARS = 500


class GoldError(Exception):
    """The reference could not be read out of the task image."""


def reference_bytes(api: Any, image_id: str, labels: Mapping[str, str]) -> bytes:
    """``/workspace/executable`` of the task image, from a created (never started) container of it."""
    container = api.create_container(image_id, command=["true"], labels=dict(labels), network_disabled=True)
    try:
        stream, _stat = api.get_archive(container["Id"], REFERENCE_PATH)
        member = first_member(iter(stream), REFERENCE_MAX_BYTES)
    except Exception as exc:
        raise GoldError(f"reading {REFERENCE_PATH} of image {image_id[:19]}: {exc}") from exc
    finally:
        api.remove_container(container["Id"], force=True)
    if member is None or member.kind != REGULAR or member.data is None:
        raise GoldError(f"{REFERENCE_PATH} of image {image_id[:19]} is not a regular file of at most "
                        f"{REFERENCE_MAX_BYTES} bytes ({member.kind if member else 'absent'})")
    return member.data


def write_submission(target: Path, reference: bytes, *, run: int, clean_hashes: Iterable[str] = ()) -> str:
    """submission.tar.gz: ``reference.gold`` (header + the reference), ``compile.sh`` (restores it as ./executable),
    ``.pb-gold-run``; returns the reference's sha256. ``clean_hashes``: the task's ``eval_clean_hashes``, none of
    which a shipped file may have (the official would delete it before compile.sh)."""
    sha256 = hashlib.sha256(reference).hexdigest()
    compile_sh = COMPILE_SH.format(skip=len(HEADER) + 1, shipped=SHIPPED, sha256=sha256).encode()
    files = ((SHIPPED, HEADER + reference, 0o644), ("compile.sh", compile_sh, 0o755),
             (MARKER, f"{run}\n".encode(), 0o644))
    listed = {h.lower() for h in clean_hashes}
    removed = [name for name, data, _mode in files if hashlib.sha256(data).hexdigest() in listed]
    if removed:
        raise GoldError(f"the gold submission's {', '.join(removed)} would be removed by eval_clean_hashes")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data, mode in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(target)
    return sha256


def require_reference_built(error_code: str | None, executable_hash: str | None, reference_sha256: str | None, *,
                            details: str = "") -> None:
    """A gold run's evaluation built the reference, or it measured nothing: raises :class:`GoldError` (the caller
    makes it an infrastructure error) when compile failed or ./executable is not the reference's bytes."""
    if executable_hash is None:
        last = details.strip().splitlines()[-1][:300] if details.strip() else ""
        raise GoldError(f"the reference did not reach ./executable ({error_code or 'no executable hash'}"
                        f"{': ' + last if last else ''}): this gold run measured nothing, so it is unscored and not "
                        "in the ledger")
    if reference_sha256 is not None and executable_hash != reference_sha256:
        raise GoldError(f"./executable has sha256 {executable_hash[:12]}, not the reference's {reference_sha256[:12]}:"
                        " this gold run measured another program, so it is unscored and not in the ledger")


# ---------------------------------------------------------------------------------------------- the ledger


@dataclass
class TestTally:
    passes: int = 0
    runs: int = 0
    messages: list[str] = field(default_factory=list)

    def add(self, status: str, message: str) -> None:
        self.runs += 1
        if status == "passed":
            self.passes += 1
        elif message and message not in self.messages and len(self.messages) < MESSAGES_KEPT:
            self.messages.append(message)


def _message(test: Any) -> str:
    extra = test.extra or {}
    text = extra.get("message") or extra.get("text") or extra.get("details") or test.status
    return str(text).strip()[:MESSAGE_CHARS]


def task_entry(results: Sequence[Any], instance: dict[str, Any], flags: Sequence[Sequence[str]]) -> dict[str, Any]:
    """One task's ledger entry from its gold runs' official results (``EvaluationResult``; None: that run has none,
    every scored test counts as not passed there)."""
    branches = get_active_branches(instance)
    ignored = get_ignored_tests(instance)
    names = [f"{b}/{t}" for b in branches for t in instance["branches"][b].get("tests", [])
             if f"{b}/{t}" not in ignored]
    tallies = {name: TestTally() for name in names}
    scores = [_tally_run(result, branches, ignored, tallies) for result in results]
    n = len(results)
    impossible = [name for name, t in tallies.items() if t.passes == 0]
    flaky = [name for name, t in tallies.items() if 0 < t.passes < n]

    def listed(names_: list[str]) -> list[dict[str, Any]]:
        return [{"test": name, "passes": tallies[name].passes, "runs": n, "messages": tallies[name].messages}
                for name in names_]

    return {
        "runs": n,
        "ceiling": round(sum(scores) / n, 6) if n else None,
        "scores": [round(s, 6) for s in scores],
        "flags": [list(f) for f in flags],
        "tests": {name: {"passes": t.passes, "runs": t.runs} for name, t in tallies.items()},
        "impossible": listed(impossible),
        "flaky": listed(flaky),
        "ignore_lists": _ignore_lists(tallies, impossible, flaky, n),
    }


def _tally_run(result: Any, branches: Sequence[str], ignored: Collection[str],
               tallies: Mapping[str, TestTally]) -> float:
    """One gold run's result added to each scored test's tally (a test it lacks, or a run without a result, counts
    as not run); its official score (0.0 without a result)."""
    scoped = result.for_branches(branches).without_ignored(ignored) if result is not None else None
    by_name = {t.full_name: t for t in scoped.test_results} if scoped is not None else {}
    for name, tally in tallies.items():
        test = by_name.get(name)
        tally.add(test.status if test is not None else "not_run",
                  _message(test) if test is not None else "no result in this run")
    return scoped.score if scoped is not None else 0.0


def _ignore_lists(tallies: Mapping[str, TestTally], impossible: Sequence[str], flaky: Sequence[str],
                  n: int) -> dict[str, dict[str, Any]]:
    """The impossible and flaky tests as the task's ignore lists would hold them, per branch, each with its note."""
    ignore_lists: dict[str, dict[str, Any]] = {}
    for name in [*impossible, *flaky]:
        branch, _, test = name.partition("/")
        note = (f"the reference passed it in {tallies[name].passes} of {n} gold runs "
                f"({'impossible' if name in impossible else 'flaky'}; pytest-programbench --pb-gold)")
        ignore_lists.setdefault(branch, {"ignored_tests": []})["ignored_tests"].append(
            {"name": test, "reasons": [{"id": REASON, "note": note}]})
    return ignore_lists


def build_ledger(run_dir: Path, instances: Mapping[str, dict[str, Any]], runs: int,
                 settings: Mapping[str, Any]) -> dict[str, Any]:
    """The ledger of a finished --pb-gold run directory (``gold/<n>/<id>/``), over the runs that were evaluated."""
    tasks: dict[str, Any] = {}
    for iid, instance in sorted(instances.items()):
        results: list[Any] = []
        flags: list[list[str]] = []
        for n in range(1, runs + 1):
            task_dir = run_dir / "gold" / str(n) / iid
            meta = task_meta.read(task_dir)
            outcome = meta.get("outcome") if meta else None
            if not isinstance(outcome, dict):
                continue  # not evaluated (an infrastructure error, or not run): no evidence either way
            try:
                result = EvaluationResult.model_validate_json((task_dir / f"{iid}.eval.json").read_text())
            except (OSError, ValueError):
                result = None  # evaluated, no official result (compile failed): every test not passed
            results.append(result)
            flags.append([str(f) for f in outcome.get("flags") or []])
        if results:
            tasks[iid] = task_entry(results, instance, flags)
    return {"gold_runs": runs, "settings": dict(settings), "tasks": tasks}


def write_ledger(run_dir: Path, ledger: Mapping[str, Any]) -> Path:
    path = run_dir / LEDGER
    atomic_write_text(path, json.dumps(ledger, indent=2, sort_keys=True))
    return path


def ledger_lines(ledger: Mapping[str, Any]) -> list[str]:
    lines = []
    for iid, entry in ledger["tasks"].items():
        lines.append(f"{iid}: ceiling {entry['ceiling']:.3f} over {entry['runs']} gold runs; "
                     f"{len(entry['impossible'])} impossible, {len(entry['flaky'])} flaky")
        for kind in ("impossible", "flaky"):
            for row in entry[kind]:
                why = f": {row['messages'][0][:120]}" if row["messages"] else ""
                lines.append(f"  {kind}: {row['test']} ({row['passes']}/{row['runs']}){why}")
    return lines


# ---------------------------------------------------------------------------------------------- a ledger read back


class LedgerError(Exception):
    pass


@dataclass(frozen=True)
class Ledger:
    """A gold-ledger.json read back (``--pb-gold-ledger``)."""

    path: Path
    tasks: Mapping[str, Mapping[str, Any]]

    @classmethod
    def load(cls, path: Path) -> Ledger:
        try:
            data = json.loads(path.read_text())
            tasks = data["tasks"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LedgerError(f"{path}: not a gold ledger ({exc})") from None
        if not isinstance(tasks, dict):
            raise LedgerError(f"{path}: not a gold ledger (its tasks are not an object)")
        return cls(path, tasks)

    def ceiling(self, instance_id: str) -> float | None:
        entry = self.tasks.get(instance_id)
        value = entry.get("ceiling") if entry else None
        return float(value) if isinstance(value, int | float) else None

    def unreliable(self, instance_id: str) -> frozenset[str]:
        """The task's impossible and flaky tests (``branch/test``)."""
        entry = self.tasks.get(instance_id) or {}
        return frozenset(row["test"] for kind in ("impossible", "flaky") for row in entry.get(kind, []))

    def is_flaky(self, instance_id: str, test: str) -> bool:
        """Whether the reference itself passed ``test`` (``branch/test``) only sometimes: its flip in a comparison
        says nothing about the agent (results/compare.py's ``FlakyTests``)."""
        entry = self.tasks.get(instance_id) or {}
        return any(row.get("test") == test for row in entry.get("flaky", []))

    def score_without_unreliable(self, instance_id: str, eval_json: Path,
                                 instance: dict[str, Any]) -> float | None:
        """--pb-ignore-flaky: the official score with the ledger's tests added to the task's ignore list
        (``EvaluationResult.for_branches(...).without_ignored(...).score``, the official functions)."""
        try:
            result = EvaluationResult.model_validate_json(eval_json.read_text())
        except (OSError, ValueError):
            return None
        ignored = set(get_ignored_tests(instance)) | self.unreliable(instance_id)
        return float(result.for_branches(get_active_branches(instance)).without_ignored(ignored).score)
