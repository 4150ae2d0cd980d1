"""Live progress of a run: what is in flight, its phase and clock, counts and an ETA.

Every process that runs items publishes its current task and phase to ``<run dir>/.progress/<worker>.json`` (small
atomic files: nothing goes through xdist's channel, so a crashed worker leaves a file whose dead pid says so). The
controller polls those files, adds the agent's tokens so far from the relay's ``model-requests.jsonl``, keeps
``summary.json``'s ``in_flight`` current and shows a compact view: redrawn in place below pytest's own output on a
terminal, periodic plain lines otherwise (CI logs), one line under ``-q``; ``--pb-progress off`` turns it all off.

Phases come from the pipeline (``TaskPipeline.phase``), from the evaluation's progress log records (compile,
branch k/n) and from the item's call (verdict). Slow engine calls (``docker_engine``) arrive as log records too and
are said once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import pytest

from pytest_programbench.results.artifacts import atomic_write_text

if TYPE_CHECKING:
    from pytest_programbench.session import ProgramBenchSession

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
            self._state.update(phase=name, phase_started=time.time())
            self._write(event=name)

    def task_finished(self, instance_id: str) -> None:
        with self._lock:
            if self._state["task"] == instance_id:
                self._write(event="finished")
                self._state.update(task=None, phase=None, task_started=None, phase_started=None)
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
        # container_layer's progress lines: "[%s] compile (...)" and "[%s] branch %d/%d: %s%s".
        if record.msg.startswith("[%s] compile"):
            self.publisher.phase(str(args[0]), "compile")
        elif record.msg.startswith("[%s] branch %d/%d") and len(args) >= 3:
            serial = " (serial retry)" if len(args) >= 5 and args[4] else ""
            self.publisher.phase(str(args[0]), f"branch {args[1]}/{args[2]}{serial}")


# -- the reading side (the controller) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class InFlight:
    task: str
    worker: str
    phase: str
    task_elapsed: float
    phase_elapsed: float
    tokens: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "phase": self.phase, "task_elapsed": round(self.task_elapsed, 1),
                "phase_elapsed": round(self.phase_elapsed, 1), "tokens": self.tokens}


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
        in_flight.append(InFlight(str(task), worker, str(state.get("phase") or "?"), now - task_started,
                                  now - phase_started, meter.tokens(str(task))))
    return Snapshot(sorted(in_flight, key=lambda f: f.worker), slow, max(1, workers))


@dataclass(frozen=True)
class Counts:
    selected: int
    passed: int
    failed: int
    errors: int
    durations: tuple[float, ...]  # of the settled tasks, for the ETA


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
            + ("-" if left is None else clock(left)))


def task_line(flight: InFlight) -> str:
    tokens = "" if flight.tokens is None else f"  {flight.tokens:,} tokens"
    return (f"  [{flight.worker}] {flight.task}  {flight.phase} {clock(flight.phase_elapsed)}"
            f"  (task {clock(flight.task_elapsed)}){tokens}")


def render(counts: Counts, snapshot: Snapshot, elapsed: float, *, quiet: bool) -> list[str]:
    head = status_line(counts, snapshot, elapsed)
    if quiet:
        brief = ", ".join(f"{f.task} {f.phase} {clock(f.phase_elapsed)}" for f in snapshot.in_flight)
        return [head + (f" | {brief}" if brief else "")]
    return [head, *map(task_line, snapshot.in_flight)]


class ProgressView:
    """The controller's view: a polling thread, and a pytest plugin that keeps pytest's own writes intact."""

    def __init__(self, run_dir: Path, *, mode: str, interval: float | None, quiet: bool,
                 terminal: Any, counts: Callable[[], Counts | None],
                 on_in_flight: Callable[[dict[str, dict[str, Any]]], None]) -> None:
        self.run_dir = run_dir
        self.terminal = terminal  # the TerminalReporter
        if mode == "auto":
            mode = "live" if getattr(terminal, "isatty", False) else "lines"
        self.mode = mode
        self.interval = interval if interval is not None else DEFAULT_INTERVAL[mode]
        self.quiet = quiet
        self.counts = counts
        self.on_in_flight = on_in_flight
        self.meter = TokenMeter(run_dir)
        self.snapshot = Snapshot([], {}, 1)
        self.started = time.monotonic()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said: set[str] = set()
        self._drawn = 0  # lines of the live block below pytest's current line
        self._column = 0
        self._last_in_flight: dict[str, Any] | None = None

    # -- lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pb-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with self._lock:
            self._clear()

    def _run(self) -> None:
        next_show = time.monotonic() + (self.interval if self.mode == "lines" else 0.0)
        while not self._stop.is_set():
            try:
                self.poll()
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
                self._say(f"programbench: slow Docker engine call: {call} took {seconds:.1f} s (on {worker}; "
                          "said once)")
            if in_flight != self._last_in_flight:
                self._last_in_flight = in_flight
                self.on_in_flight({f.task: f.as_dict() for f in snapshot.in_flight})

    def lines(self) -> list[str]:
        counts = self.counts()
        if counts is None:
            return []
        return render(counts, self.snapshot, time.monotonic() - self.started, quiet=self.quiet)

    # -- writing

    def show(self) -> None:
        with self._lock:
            if self.mode == "live":
                self._clear()
                self._draw()
            else:
                for line in self.lines():
                    self._line(line)

    def _line(self, line: str, **markup: bool) -> None:
        """A line of its own, even after pytest's dots (under xdist its reporter does not end their line)."""
        if self.terminal._tw.width_of_current_line:
            self.terminal.write("\n")
        self.terminal.write_line(line, **markup)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Around pytest's own writes: the live block is taken away, then drawn again below them (plain lines
        only wait: the two threads never write at once)."""
        with self._lock:
            self._clear()
            try:
                yield
            finally:
                if not self._stop.is_set():
                    self._draw()

    def _say(self, line: str) -> None:
        with self.paused():
            self._line(line, yellow=True)

    def _stream(self) -> TextIO:
        writer = self.terminal._tw  # the reporter's writer: its column and width place the block
        return writer._file  # type: ignore[no-any-return]

    def _draw(self) -> None:
        if self.mode != "live" or self._drawn:
            return
        lines = self.lines()
        if not lines or (not self.snapshot.in_flight and self._nothing_settled()):
            return
        writer = self.terminal._tw
        width = max(20, int(writer.fullwidth) - 1)  # a wrapped line would break the count of lines to erase
        self._column = int(writer.width_of_current_line)
        stream = self._stream()
        stream.write("".join("\n" + line[:width] for line in lines))
        stream.flush()
        self._drawn = len(lines)

    def _nothing_settled(self) -> bool:
        counts = self.counts()
        return counts is None or not counts.durations

    def _clear(self) -> None:
        if self.mode != "live" or not self._drawn:
            return
        stream = self._stream()
        back = f"\r\x1b[{self._drawn}A" + (f"\x1b[{self._column}C" if self._column else "") + "\x1b[J"
        stream.write(back)
        stream.flush()
        self._drawn = 0


class ProgressPlugin:
    """Registered on the controller: pytest's terminal writes happen with the live block taken away."""

    def __init__(self, view: ProgressView) -> None:
        self.view = view

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> Generator[None, Any, Any]:
        with self.view.paused():
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> Generator[None, Any, Any]:
        with self.view.paused():
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> Generator[None, Any, Any]:
        with self.view.paused():
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collectreport(self, report: pytest.CollectReport) -> Generator[None, Any, Any]:
        with self.view.paused():
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True, optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> Generator[None, Any, Any]:
        with self.view.paused():
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True, optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: Any, sched: Any) -> Generator[None, Any, Any]:
        with self.view.paused():
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, Any, Any]:
        self.view.start()
        try:
            return (yield)
        finally:  # before the terminal summary, Ctrl-C included
            self.view.stop()


class WorkerProgress:
    """Registered in every process that runs items: the task starts, its verdict, its end."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        if nodeid.startswith("programbench::"):
            self.publisher.task_started(nodeid.removeprefix("programbench::"))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        if item.nodeid.startswith("programbench::"):
            self.publisher.phase(item.nodeid.removeprefix("programbench::"), "verdict")

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        if nodeid.startswith("programbench::"):
            self.publisher.task_finished(nodeid.removeprefix("programbench::"))


def attach(pb_session: ProgramBenchSession, session: pytest.Session) -> Callable[[], None]:
    """Start publishing (a process that runs items) and viewing (the controller); returns the closer."""
    config = session.config
    settings = pb_session.settings
    run_dir = pb_session.identity.path
    closers: list[Callable[[], None]] = []
    runs_items = hasattr(config, "workerinput") or config.pluginmanager.get_plugin("dsession") is None
    if runs_items:
        publisher = Publisher(run_dir, pb_session.worker_id)
        pb_session.progress = publisher
        tap = LogTap(publisher)
        tap.install()
        worker_plugin = WorkerProgress(publisher)
        config.pluginmanager.register(worker_plugin, "programbench-progress-worker")

        def close_publisher() -> None:
            config.pluginmanager.unregister(worker_plugin)
            tap.uninstall()
            pb_session.progress = None
            publisher.close()

        closers.append(close_publisher)
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if not hasattr(config, "workerinput") and terminal is not None:
        def counts() -> Counts | None:
            summary = pb_session.summary
            if summary is None:
                return None
            records = list(summary.records.values())
            return Counts(len(records), sum(r.outcome == "passed" for r in records),
                          sum(r.outcome == "failed" for r in records), sum(r.outcome == "error" for r in records),
                          tuple(r.duration for r in records if r.outcome))

        def on_in_flight(in_flight: dict[str, dict[str, Any]]) -> None:
            if pb_session.summary is not None:
                pb_session.summary.set_in_flight(in_flight)

        mode = settings.progress
        if mode == "auto" and (config.getoption("log_cli_level", None) or config.getini("log_cli")):
            mode = "lines"  # live log lines would land inside a block drawn in place
        view = ProgressView(run_dir, mode=mode, interval=settings.progress_interval,
                            quiet=config.get_verbosity() < 0, terminal=terminal, counts=counts,
                            on_in_flight=on_in_flight)
        view_plugin = ProgressPlugin(view)
        config.pluginmanager.register(view_plugin, "programbench-progress-view")

        def close_view() -> None:
            view.stop()
            config.pluginmanager.unregister(view_plugin)
            with contextlib.suppress(OSError):  # the workers' current-state files; progress.jsonl stays
                for leftover in progress_dir(run_dir).glob("*.json"):
                    leftover.unlink()
                progress_dir(run_dir).rmdir()

        closers.insert(0, close_view)

    def close() -> None:
        for closer in closers:
            closer()

    return close
