"""One container's exec path: commands with a deadline and sinks, files in and out, the kill and the removal.

The agent's sandbox (:mod:`pytest_programbench.sandbox.sandbox`) and the official evaluator's container layer
(:mod:`pytest_programbench.evaluation.container_layer`) each need the same few things of a running container, and
each used to do them its own way. They are done here once:

* :class:`ExecReader` reads one exec's frames in a thread and hands them to sinks until EOF or a deadline. A
  command's window ends when it exits or its own clock fires, never because its connection was quiet, whatever the
  transport (a socket, ssh's pipes): the deadline is the caller's, the reading has no timeout (:mod:`.exec_stream`).
* :class:`OutputCap` is the one output cap: the first ``head`` and last ``tail`` bytes of a stream kept, the rest
  counted, every byte checked as strict UTF-8 (the official decodes with ``text=True``; a bad byte in the omitted
  middle still counts).
* :class:`Container` is a container id on an API client: start an exec, poll its exit status, put a tar, stream a
  path out (:mod:`.archive_out`, the response closed on every path so an early stop never leaves the engine holding
  the container's lock), read one file within a cap and a timeout, kill, remove idempotently, and thaw a frozen
  gVisor container before either (the engine's own way leaks its containerd shim).

What each caller adds stays with it: the sandbox its proxy, users and layout; the evaluation layer what the
official ``Evaluator`` expects (``bash -lc``, its result dicts, its timeout teardown, ``docker cp``'s messages).
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any

from docker.errors import APIError, NotFound

from pytest_programbench.engine import runtimes
from pytest_programbench.engine.archive_out import Archive, Member, first_member
from pytest_programbench.engine.exec_stream import ExecStream
from pytest_programbench.engine.tar_in import TarIn

log = logging.getLogger(__name__)

OMITTED_MARKER = "\n[pytest-programbench: {n} bytes of {stream} omitted from this log]\n"
SEND_CHUNK = 1 << 20

Sinks = Mapping[int, Callable[[bytes], object]]


class OutputCap:
    """Keeps the first ``head`` and the last ``tail`` bytes of a stream (``tail`` defaults to ``head``) and counts
    what lies between.

    Every byte (kept or not) also goes through a strict incremental UTF-8 decoder, so a stream the official
    evaluator could not decode is known even when its bad bytes fall in the omitted middle.
    """

    def __init__(self, head: int, tail: int | None = None) -> None:
        self.cap = head
        self.tail_cap = head if tail is None else tail
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
        self.decode_error: UnicodeDecodeError | None = None

    def write(self, data: bytes) -> None:
        self._check(data, final=False)
        self.total += len(data)
        room = self.cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_cap:
            self.tail += data[-self.tail_cap:]
            if len(self.tail) > self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def _check(self, data: bytes, *, final: bool) -> None:
        if self.decode_error is not None:
            return
        try:
            self._decoder.decode(data, final)
        except UnicodeDecodeError as exc:
            self.decode_error = exc

    def finish(self) -> UnicodeDecodeError | None:
        """End of stream: the first decoding error, if any (a truncated sequence at the end counts)."""
        self._check(b"", final=True)
        return self.decode_error

    @property
    def omitted(self) -> int:
        return self.total - len(self.head) - len(self.tail)

    def text(self, stream: str) -> str:
        head = decode_for_display(bytes(self.head))
        if not self.tail:
            return head
        marker = OMITTED_MARKER.format(n=self.omitted, stream=stream) if self.omitted else ""
        return head + marker + decode_for_display(bytes(self.tail))


def decode_for_display(data: bytes) -> str:
    """Universal newlines as ``subprocess.run(text=True)``; for display only, so bytes that are not UTF-8 show as
    ``\\xNN`` escapes (whether a command's output decodes is decided by :meth:`OutputCap.finish`)."""
    return data.decode("utf-8", errors="backslashreplace").replace("\r\n", "\n").replace("\r", "\n")


class ExecReader:
    """One exec's connection (:class:`ExecStream`: no socket timeout, the bytes buffered with the 101 kept, sockets
    and ssh's pipes alike) read in a thread, so a deadline holds whatever the transport."""

    def __init__(self, sock: Any) -> None:
        self.stream = ExecStream(sock)
        self._frames: queue.Queue[tuple[int, bytes] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="pb-exec-reader", daemon=True)
        self._reader.start()
        self.eof = False

    def _read(self) -> None:
        try:
            for frame in self.stream.frames():
                self._frames.put(frame)
        finally:
            self._frames.put(None)

    def pump(self, deadline: float, sinks: Sinks, *, until: Callable[[], bool] | None = None) -> bool:
        """Hand frames to ``sinks`` (by stream; stdout's sink for any other) until EOF (True), ``until()`` holds
        after a frame (True) or ``deadline`` (False). A silent command is read until it exits or its own clock
        fires."""
        while not self.eof:
            if until is not None and until():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                item = self._frames.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if item is None:
                self.eof = True
                break
            kind, payload = item
            sink = sinks.get(kind) or sinks.get(1)
            if sink is not None and payload:
                sink(payload)
        return True

    def send_file(self, source: IO[bytes], deadline: float) -> str | None:
        """Write ``source`` to the exec's stdin and half-close it; an error text when the reader went away."""
        # A receiver that stops reading without exiting would block the write forever: the deadline cuts it.
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), self.stream.shutdown)
        watchdog.daemon = True
        watchdog.start()
        try:
            while True:
                if time.monotonic() > deadline:
                    return "timed out while sending"
                data = source.read(SEND_CHUNK)
                if not data:
                    break
                self.stream.write(data)
        except OSError as exc:  # the receiver exited early (a bad archive): its stderr says why
            return "timed out while sending" if time.monotonic() > deadline else f"stream interrupted: {exc}"
        finally:
            watchdog.cancel()
            self.stream.close_stdin()
        return None

    def send(self, data: bytes) -> None:
        """Write ``data`` to the command's stdin and close it (EOF); ``OSError`` when the other side is gone."""
        self.stream.send(data)

    def shutdown(self) -> None:
        """Unblock the reader: the frames end (EOF)."""
        self.stream.shutdown()

    def close(self) -> None:
        self.stream.close()
        self._reader.join(5)


class Container:
    """A container id on an engine's API client (``docker.APIClient``): the exec path and the file path."""

    def __init__(self, api: Any, container_id: str) -> None:
        self.api = api
        self.id = container_id

    # ------------------------------------------------------------------------------------------------ commands

    def start_exec(self, argv: Sequence[str], *, user: str | None = None, workdir: str | None = None,
                   environment: Mapping[str, str] | None = None, stdin: bool = False) -> tuple[str, ExecReader]:
        """Create and start an exec; its id and its reader. Engine errors (``APIError``) propagate."""
        kwargs: dict[str, Any] = {"stdin": stdin, "environment": dict(environment) if environment else None,
                                  "workdir": workdir}
        if user is not None:
            kwargs["user"] = user
        exec_id = str(self.api.exec_create(self.id, list(argv), **kwargs)["Id"])
        return exec_id, ExecReader(self.api.exec_start(exec_id, socket=True))

    def exec_info(self, exec_id: str) -> dict[str, Any]:
        return dict(self.api.exec_inspect(exec_id))

    def running(self, exec_id: str) -> bool:
        return bool(self.exec_info(exec_id).get("Running", False))

    def exit_code(self, exec_id: str, *, wait: float) -> int:
        """The exec's exit status once the daemon recorded it (the CLI's ``getExecExitStatus``), polled for at most
        ``wait`` seconds after its stream ended; 0 when the daemon records none."""
        deadline = time.monotonic() + wait
        delay = 0.005
        while True:
            info = self.exec_info(exec_id)
            if not info.get("Running") or time.monotonic() > deadline:
                code = info.get("ExitCode")
                return int(code) if code is not None else 0
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def kill(self, signal: str | None = None) -> None:
        """Signal the container's init from the host (``docker kill``); SIGKILL by default."""
        if signal is None:
            self.api.kill(self.id)
        else:
            self.api.kill(self.id, signal)

    def thaw_under_gvisor(self) -> bool:
        """Thaw this paused container when it runs under gVisor (its runtime, or the engine's default, named
        ``runsc`` or at a path of that name); whether it did. Asked to kill or remove a frozen runsc container,
        dockerd cannot signal it, waits 10 s, kills the sandbox's host process itself and cannot delete its
        containerd task, whose shim then stays for good. The caller kills or removes it at once after."""
        try:
            if not runtimes.is_gvisor(self.api, self.api.inspect_container(self.id)["HostConfig"].get("Runtime")):
                return False
        except (APIError, KeyError):
            return False
        with contextlib.suppress(APIError):
            self.api.unpause(self.id)
        return True

    def remove(self, *, paused: bool = False) -> bool:
        """``docker rm -f -v``; True when it is gone (also when it was already, or its removal is under way).
        ``paused``: the caller knows it frozen, and it is thawed first under gVisor (:meth:`thaw_under_gvisor`).
        Other engine errors propagate (a 409 of another kind among them: the caller decides)."""
        if paused:
            self.thaw_under_gvisor()
        try:
            self.api.remove_container(self.id, force=True, v=True)
        except NotFound:
            return True
        except APIError as exc:
            if "already in progress" in str(getattr(exc, "explanation", None) or exc):
                return True
            raise
        return True

    # ------------------------------------------------------------------------------------------------ files

    def put(self, archive: TarIn, directory: str) -> bool:
        """Extract ``archive`` into ``directory`` (``PUT /containers/{id}/archive``)."""
        return archive.put(self.api, self.id, directory)

    @contextlib.contextmanager
    def archive(self, path: str) -> Iterator[tuple[Iterator[bytes], dict[str, Any] | None]]:
        """``GET /containers/{id}/archive``: the tar stream and the path's stat; the response is closed on exit.

        (docker-py's ``get_archive`` returns a bare generator, whose response stays open when a reader stops early:
        the engine then holds the container's lock, and removing the container blocks for the API timeout.)
        """
        opened = Archive(self.api, self.id, path)
        try:
            stat = opened.check()
            yield opened.chunks(), stat
        finally:
            opened.close()

    def first_member(self, path: str, *, timeout: float, max_bytes: int | None) -> Member | str | None:
        """The first member of ``path``'s archive (what ``docker cp`` would bring out), read in a thread within
        ``timeout`` (a string saying so when it passed); its bytes only for a regular file within ``max_bytes``.

        Raises what the reading raised: ``NotFound``/``APIError``, :class:`TooLarge`, ``tarfile.TarError``,
        ``EOFError``, connection errors."""
        box: list[Member | None] = []
        failures: list[BaseException] = []
        opened: list[Archive] = []

        def fetch() -> None:
            try:
                archive = Archive(self.api, self.id, path)
                opened.append(archive)
                archive.check()
                box.append(first_member(archive.chunks(), max_bytes))
            except BaseException as exc:  # re-raised in the caller's thread
                failures.append(exc)
            finally:
                for archive in opened:
                    with contextlib.suppress(Exception):
                        archive.close()

        worker = threading.Thread(target=fetch, name="pb-read-file", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            for archive in list(opened):  # the reader stops at its next chunk
                with contextlib.suppress(Exception):
                    archive.close()
            return f"timed out after {timeout:g}s"
        if failures:
            raise failures[0]
        return box[0]

