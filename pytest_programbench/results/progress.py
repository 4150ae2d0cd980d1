"""Live progress of a run: what is in flight, its phase and clock, counts and an ETA.

Every process that runs items publishes its current task and phase to ``<run dir>/.progress/<worker>.json`` (small
atomic files: nothing goes through xdist's channel, so a crashed worker leaves a file whose dead pid says so). The
controller polls those files, adds the agent's tokens so far from the relay's ``model-requests.jsonl``, keeps
``summary.json``'s ``in_flight`` current and shows a compact view: drawn in place below pytest's own output on a
terminal (rich's ``Live``), periodic plain lines otherwise (CI logs), one line under ``-q``; ``--pb-progress off`` turns
it all off. With or without xdist it is the same path: the process that runs items publishes, a thread of the
controller reads and shows (without xdist, beside the item's fixtures in the same process).

Phases come from the pipeline (``TaskPipeline.phase``), from the evaluation's progress log records (compile,
branch k/n) and from the item's call (verdict). Slow engine calls (``docker_engine``) arrive as log records too and
are said once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from pytest_programbench.core import environment
from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.results.live_page import LivePage
from pytest_programbench.text.printable import printable

PROGRESS_DIR = ".progress"
HISTORY = "progress.jsonl"  # every phase change of the run, one JSON line each (a timeline to read afterwards)
PROGRESS_LOGGER = "pytest_programbench"  # the pipeline's and the evaluation's progress records
DEFAULT_INTERVAL = {"live": 1.0, "lines": 60.0}
POLL = 1.0  # seconds between reads of the workers' files (summary.json's in_flight follows at this pace)


def progress_dir(run_dir: Path) -> Path:
    return run_dir / PROGRESS_DIR


def clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# -- the publishing side (every process that runs items) ----------------------------------------------------------


class Publisher:
    """This process's current task and phase, rewritten atomically on every change (threads may call it)."""

    def __init__(self, run_dir: Path, worker: str) -> None:
        self.path = progress_dir(run_dir) / f"{worker}.json"
        self.history = run_dir / HISTORY
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {"worker": worker, "pid": os.getpid(), "task": None, "phase": None,
                                       "task_started": None, "phase_started": None, "slow_calls": {}}
        self._write()

    def task_started(self, instance_id: str) -> None:
        now = time.time()
        with self._lock:
            self._state.update(task=instance_id, phase="starting", task_started=now, phase_started=now)
            self._write(event="starting")

    def phase(self, instance_id: str, name: str) -> None:
        with self._lock:
            if self._state["task"] != instance_id:  # a late record of a task that already ended
                return
            self._state.update(phase=name, phase_started=time.time(), note=None)
            self._write(event=name)

    def note(self, instance_id: str, text: str) -> None:
        """A word on the current phase shown beside it ("rate-limited 40 s"); a new phase clears it."""
        with self._lock:
            if self._state["task"] != instance_id:
                return
            self._state["note"] = text
            self._write()

    def task_finished(self, instance_id: str) -> None:
        with self._lock:
            if self._state["task"] == instance_id:
                self._write(event="finished")
                self._state.update(task=None, phase=None, task_started=None, phase_started=None, note=None)
                self._write()

    def slow_call(self, call: str, seconds: float) -> None:
        with self._lock:
            self._state["slow_calls"].setdefault(call, seconds)
            self._write()

    def close(self) -> None:
        with self._lock:
            self.path.unlink(missing_ok=True)

    def _write(self, event: str | None = None) -> None:
        self._state["updated"] = time.time()
        try:
            atomic_write_text(self.path, json.dumps(self._state))
            if event is not None:
                line = json.dumps({"at": round(self._state["updated"], 3), "worker": self._state["worker"],
                                   "task": self._state["task"], "phase": event})
                with self.history.open("a") as handle:  # one short append per line: workers do not interleave
                    handle.write(line + "\n")
        except OSError as exc:  # progress is a view: it never fails a task
            logging.getLogger(__name__).debug("progress file %s: %s", self.path, exc)


class LogTap(logging.Handler):
    """Reads the evaluation's progress records (compile, branch k/n) and slow engine calls into a publisher.

    Those INFO records exist only if the ``pytest_programbench`` logger is enabled for INFO, so while installed the
    logger is set to INFO, stops propagating, and this handler passes on to the root logger exactly the records the
    original levels would have let through: what pytest shows and captures does not change.
    """

    def __init__(self, publisher: Publisher) -> None:
        super().__init__(logging.NOTSET)
        self.publisher = publisher
        self.logger = logging.getLogger(PROGRESS_LOGGER)
        self._saved: tuple[int, bool] | None = None

    def install(self) -> None:
        self._saved = (self.logger.level, self.logger.propagate)
        self.logger.addHandler(self)
        if self.logger.getEffectiveLevel() > logging.INFO:
            self.logger.setLevel(logging.INFO)
        self.logger.propagate = False

    def uninstall(self) -> None:
        self.logger.removeHandler(self)
        if self._saved is not None:
            self.logger.setLevel(self._saved[0])
            self.logger.propagate = self._saved[1]
            self._saved = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._observe(record)
        except Exception:  # a view must never break logging
            self.handleError(record)
        if self._saved is not None and record.levelno >= self._original_level(record.name):
            logging.getLogger().handle(record)

    def _original_level(self, name: str) -> int:
        """The effective level the record's logger had before install (our logger at its saved level)."""
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None:
            level = self._saved[0] if logger is self.logger and self._saved else logger.level
            if level:
                return level
            logger = logger.parent
        return logging.WARNING

    def _observe(self, record: logging.LogRecord) -> None:
        call = getattr(record, "pb_slow_call", None)
        if isinstance(call, str):
            self.publisher.slow_call(call, float(getattr(record, "pb_seconds", 0.0)))
            return
        args = record.args if isinstance(record.args, tuple) else ()
        if not isinstance(record.msg, str) or not args:
            return
        # container_layer's progress lines: "[%s] compile (...)" and "[%s] %s %d/%d: %s%s", the %s a branch run's
        # word ("branch"; the audit's "audit").
        if record.msg.startswith("[%s] compile"):
            self.publisher.phase(str(args[0]), "compile")
        elif record.msg.startswith("[%s] %s %d/%d") and len(args) >= 4:
            serial = " (serial retry)" if len(args) >= 6 and args[5] else ""
            self.publisher.phase(str(args[0]), f"{args[1]} {args[2]}/{args[3]}{serial}")


# -- the reading side (the controller) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class InFlight:
    task: str
    worker: str
    phase: str
    task_elapsed: float
    phase_elapsed: float
    tokens: int | None = None
    note: str | None = None  # beside the phase: "rate-limited 40 s"

    def as_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "phase": self.phase, "task_elapsed": round(self.task_elapsed, 1),
                "phase_elapsed": round(self.phase_elapsed, 1), "tokens": self.tokens, "note": self.note}


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class TokenMeter:
    """Tokens so far per task, read incrementally from the relay's ``model-requests.jsonl``."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._seen: dict[str, tuple[int, int | None]] = {}  # task -> (bytes read, tokens)

    def tokens(self, task: str) -> int | None:
        offset, total = self._seen.get(task, (0, None))
        path = self.run_dir / task / "model-requests.jsonl"
        try:
            with path.open("rb") as handle:
                handle.seek(offset)
                data = handle.read()
        except OSError:
            return total
        complete = data.rfind(b"\n") + 1  # a line being written is read next time
        for line in data[:complete].splitlines():
            try:
                usage = json.loads(line).get("usage") or {}
            except ValueError:
                continue
            count = usage.get("total_tokens")
            if not isinstance(count, int):
                parts = [usage.get(k) for k in ("input_tokens", "output_tokens")]
                count = sum(p for p in parts if isinstance(p, int)) if any(isinstance(p, int) for p in parts) \
                    else None
            if count is not None:
                total = (total or 0) + count
        self._seen[task] = (offset + complete, total)
        return total


@dataclass
class Snapshot:
    in_flight: list[InFlight]
    slow_calls: dict[str, tuple[float, str]]  # call -> (seconds, worker)
    workers: int


def read_snapshot(run_dir: Path, meter: TokenMeter, now: float | None = None) -> Snapshot:
    now = time.time() if now is None else now
    in_flight: list[InFlight] = []
    slow: dict[str, tuple[float, str]] = {}
    workers = 0
    try:
        files = sorted(progress_dir(run_dir).glob("*.json"))
    except OSError:
        files = []
    for path in files:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced while read: next poll
        if not isinstance(state, dict) or not _alive(state.get("pid")):
            continue  # a crashed worker's last words: xdist reports its task
        workers += 1
        worker = str(state.get("worker"))
        for call, seconds in (state.get("slow_calls") or {}).items():
            slow.setdefault(str(call), (float(seconds), worker))
        task = state.get("task")
        if not task:
            continue
        task_started = float(state.get("task_started") or now)
        phase_started = float(state.get("phase_started") or now)
        note = state.get("note")
        in_flight.append(InFlight(str(task), worker, str(state.get("phase") or "?"), now - task_started,
                                  now - phase_started, meter.tokens(str(task)),
                                  str(note)[:80] if note else None))
    return Snapshot(sorted(in_flight, key=lambda f: f.worker), slow, max(1, workers))


@dataclass(frozen=True)
class Counts:
    selected: int
    passed: int
    failed: int
    errors: int
    durations: tuple[float, ...]  # of the settled tasks, for the ETA
    budget: str = ""  # --pb-budget: "budget $0.0123 of $0.05 (projected $0.0300)"


def eta(counts: Counts, snapshot: Snapshot) -> float | None:
    """Mean settled-task duration times the work left, spread over the workers; None until a task settled."""
    if not counts.durations:
        return None
    mean = sum(counts.durations) / len(counts.durations)
    queued = max(0, counts.selected - counts.passed - counts.failed - counts.errors - len(snapshot.in_flight))
    left = queued * mean + sum(max(mean - f.task_elapsed, 0.0) for f in snapshot.in_flight)
    return left / snapshot.workers


def status_line(counts: Counts, snapshot: Snapshot, elapsed: float) -> str:
    done = counts.passed + counts.failed
    running = len(snapshot.in_flight)
    queued = max(0, counts.selected - done - counts.errors - running)
    left = eta(counts, snapshot)
    return (f"programbench {done + counts.errors}/{counts.selected}: {counts.passed} passed, {counts.failed} failed, "
            f"{counts.errors} errors | {running} running, {queued} queued | {clock(elapsed)} elapsed | ETA "
            + ("after the first task" if left is None else clock(left))
            + (f" | {counts.budget}" if counts.budget else ""))


def task_line(flight: InFlight) -> str:
    tokens = "" if flight.tokens is None else f"  {flight.tokens:,} tokens"
    phase = f"{flight.phase} ({flight.note})" if flight.note else flight.phase
    return (f"  [{flight.worker}] {flight.task}  {phase} {clock(flight.phase_elapsed)}"
            f"  (task {clock(flight.task_elapsed)}){tokens}")


def render(counts: Counts, snapshot: Snapshot, elapsed: float, *, quiet: bool) -> list[str]:
    """The view's lines, printable: they hold what the workers' files say (a task's name, a phase, a note)."""
    head = status_line(counts, snapshot, elapsed)
    if quiet:
        brief = ", ".join(f"{f.task} {f.phase} {clock(f.phase_elapsed)}" for f in snapshot.in_flight)
        return [printable(head + (f" | {brief}" if brief else ""))]
    return [printable(line) for line in (head, *map(task_line, snapshot.in_flight))]


# -- the screen: where pytest's writes and the view's meet --------------------------------------------------------

_OSC = re.compile(r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")  # pytest's terminal-progress sequences: they move no cursor


def _own_stream(file: Any) -> tuple[TextIO, bool]:
    """A stream of our own on the terminal's descriptor. pytest's output capture points fd 1 at a file while an
    item runs (the whole agent window without -n): writes through pytest's stream then land in the item's
    captured output, not on the terminal."""
    try:
        fd = os.dup(file.fileno())
    except (AttributeError, OSError, ValueError):  # no descriptor (an in-process pytester run): pytest's stream
        return file, False
    encoding = getattr(file, "encoding", None) or "utf-8"
    return open(fd, "w", encoding=encoding, errors="backslashreplace", buffering=1), True


def _after_rewrites(line: str) -> str:
    """What carriage-return rewrites (pytest's and xdist's "collecting ..." lines) leave on a line."""
    parts = [part for part in line.split("\r") if part]
    return parts[-1] if parts else ""


class Screen:
    """Stands in for the terminal reporter's file while the view runs: pytest's writes and the view's go through
    one lock to one stream, in order. This one prints the view as plain lines (a log); ``LiveScreen`` draws it in
    place."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer  # pytest's TerminalWriter
        self.original = writer._file
        self.stream, self._owned = _own_stream(self.original)
        self.lock = threading.RLock()
        self.closed = False
        self._line_started = False  # pytest left an unfinished line (its dots, a node id waiting for its outcome)

    def install(self) -> None:
        with self.lock:
            self.original.flush()
            self._line_started = bool(self.writer.width_of_current_line)
            self.writer._file = self

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self._finish()
            self.stream.flush()
            self.writer._file = self.original
            if self._owned:
                self.stream.close()

    # -- the file interface pytest's TerminalWriter uses

    def write(self, text: str) -> int:
        with self.lock:
            self._pytest_text(text)
        return len(text)

    def flush(self) -> None:
        with self.lock:
            self.stream.flush()

    # -- the view's side

    def show(self, lines: list[str]) -> None:
        """The view's current lines: printed each time, on lines of their own (pytest's line is broken off)."""
        with self.lock:
            if self.closed or not lines:
                return
            self.stream.write(("\n" if self._line_started else "") + "\n".join(lines) + "\n")
            self.stream.flush()
            self._line_started = False

    def say(self, line: str) -> None:
        self.show([self.writer.markup(printable(line), yellow=True)])

    def _pytest_text(self, text: str) -> None:
        self.stream.write(text)
        if text:
            self._line_started = not text.endswith("\n")

    def _finish(self) -> None:
        pass


class LiveScreen(Screen):
    """The view drawn in place by rich's ``Live`` in the region below pytest's output. pytest's complete lines
    are printed above the region; its unfinished line is the region's first line, so pytest never writes into
    the region and no cursor position is ever guessed; closing erases the region and leaves pytest's unfinished
    line where pytest expects it."""

    def __init__(self, writer: Any) -> None:
        super().__init__(writer)
        self.partial = ""
        self.lines: list[str] = []
        self.console = Console(file=self.stream, force_terminal=True, force_interactive=True, highlight=False,
                               color_system="truecolor" if writer.hasmarkup else None, emoji=False, markup=False)
        self.live = Live(console=self.console, get_renderable=self._renderable, auto_refresh=False,
                         transient=True, redirect_stdout=False, redirect_stderr=False)

    def install(self) -> None:
        with self.lock:
            super().install()
            if self._line_started:  # already on the terminal: the region starts at the line's beginning
                self.partial = self.writer._current_line
                self.stream.write("\r")
            self._fit()
            self.live.start(refresh=True)

    def show(self, lines: list[str]) -> None:
        with self.lock:
            if not self.closed:
                self.lines = lines
                self._refresh()

    def say(self, line: str) -> None:
        with self.lock:
            if not self.closed:
                self._fit()
                self.console.print(Text(line, style="yellow"), soft_wrap=True)

    def _pytest_text(self, text: str) -> None:
        for sequence in _OSC.findall(text):  # the terminal's tab progress: passed on as is
            self.stream.write(sequence)
        *done, self.partial = (self.partial + _OSC.sub("", text)).split("\n")
        self._fit()
        if done:  # above the region (rich takes it away, prints, draws it again below)
            self.console.print(Text("\n").join(Text.from_ansi(_after_rewrites(line)) for line in done),
                               soft_wrap=True)
        self.live.refresh()

    def _finish(self) -> None:
        partial, self.partial, self.lines = self.partial, "", []
        self._fit()
        self.live.stop()  # drawn one last time empty, then erased: the cursor is where the region began
        self.stream.write(partial)

    def _refresh(self) -> None:
        self._fit()
        self.live.refresh()

    def _fit(self) -> None:
        """The terminal's size now (rich would ask fds 0-2, which pytest's capture has taken while items run)."""
        try:
            size = os.get_terminal_size(self.stream.fileno())
        except (OSError, ValueError):
            size = shutil.get_terminal_size()
        self.console.size = (size.columns, size.lines)

    def _renderable(self) -> RenderableType:
        parts: list[RenderableType] = []
        if self.partial:
            parts.append(Text.from_ansi(_after_rewrites(self.partial)))
        parts.extend(Text(line, no_wrap=True, overflow="ellipsis") for line in self.lines)
        return Group(*parts) if parts else Text("")


class ProgressView:
    """The controller's view: a polling thread (it runs beside the item's fixtures without xdist, beside xdist's
    loop with it) and the screen that pytest's terminal writes go through while the run loop runs."""

    def __init__(self, run_dir: Path, *, mode: str, interval: float | None, quiet: bool,
                 terminal: Any, counts: Callable[[], Counts | None],
                 on_in_flight: Callable[[dict[str, dict[str, Any]]], None]) -> None:
        self.run_dir = run_dir
        self.terminal = terminal  # the TerminalReporter
        if mode == "auto":
            capable = getattr(terminal, "isatty", False) and environment.TERM.raw() not in ("dumb", "unknown")
            mode = "live" if capable else "lines"
        self.mode = mode
        self.interval = interval if interval is not None else DEFAULT_INTERVAL[mode]
        self.quiet = quiet
        self.counts = counts
        self.on_in_flight = on_in_flight
        self.meter = TokenMeter(run_dir)
        self.snapshot = Snapshot([], {}, 1)
        self.started = time.monotonic()
        self.screen: Screen | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said: set[str] = set()
        self._last_in_flight: dict[str, Any] | None = None
        self.page = LivePage(run_dir)  # live.html: the same view for a browser (results/live_page.py)

    # -- lifecycle

    def start(self) -> None:
        writer = self.terminal._tw
        self.screen = LiveScreen(writer) if self.mode == "live" else Screen(writer)
        self.screen.install()
        self._thread = threading.Thread(target=self._run, name="pb-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with contextlib.suppress(Exception):  # the page never stops a run
            self.poll()
            self.page.write(self.page_lines(), finished=True)
        if self.screen is not None:
            self.screen.close()
            self.screen = None

    def _run(self) -> None:
        next_show = time.monotonic() + (self.interval if self.mode == "lines" else 0.0)
        while not self._stop.is_set():
            try:
                self.poll()
                self.page.write(self.page_lines())
                if time.monotonic() >= next_show:
                    self.show()
                    next_show = time.monotonic() + self.interval
            except Exception as exc:  # the view never stops a run
                logging.getLogger(__name__).debug("progress view: %s", exc)
            self._stop.wait(min(POLL, self.interval))

    # -- reading

    def poll(self) -> None:
        snapshot = read_snapshot(self.run_dir, self.meter)
        in_flight = {f.task: {"worker": f.worker, "phase": f.phase, "tokens": f.tokens}
                     for f in snapshot.in_flight}
        with self._lock:
            self.snapshot = snapshot
            news = [(call, s) for call, s in snapshot.slow_calls.items() if call not in self._said]
            for call, (seconds, worker) in news:
                self._said.add(call)
                if self.screen is not None:
                    self.screen.say(f"programbench: slow Docker engine call: {call} took {seconds:.1f} s "
                                    f"(on {worker}; said once)")
            if in_flight != self._last_in_flight:
                self._last_in_flight = in_flight
                self.on_in_flight({f.task: f.as_dict() for f in snapshot.in_flight})

    def page_lines(self) -> list[str]:
        """live.html's lines: the full view, whatever the terminal shows (-q, off)."""
        counts = self.counts()
        if counts is None:
            return []
        return render(counts, self.snapshot, time.monotonic() - self.started, quiet=False)

    def lines(self) -> list[str]:
        counts = self.counts()
        if counts is None:
            return []
        return render(counts, self.snapshot, time.monotonic() - self.started, quiet=self.quiet)

    # -- writing

    def show(self) -> None:
        with self._lock:
            if self.screen is None:
                return
            if self.mode == "live" and not self.snapshot.in_flight and self._nothing_settled():
                self.screen.show([])  # nothing to say yet (the run loop starting, xdist's workers collecting)
            else:
                self.screen.show(self.lines())

    def _nothing_settled(self) -> bool:
        counts = self.counts()
        return counts is None or not counts.durations
