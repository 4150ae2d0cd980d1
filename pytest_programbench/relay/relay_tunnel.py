"""The model relay's way into a sandbox on any engine: one ``docker exec`` whose stdin/stdout carry the connections.

Inside, ``relay_bridge.py --stdio`` (as root, so the agent user can neither stop nor trace it) listens on the
sandbox's loopback and turns every connection into a numbered channel on its stdout. Here, each channel gets its own
connection to the relay's private Unix socket on this host. Nothing is bind-mounted, so the sandbox's files stay
readable by the engine whatever happens to the relay, and a remote engine (``ssh://``, ``tcp://``) works the same.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from pytest_programbench.engine.exec_stream import STDERR, STDOUT, ExecStream
from pytest_programbench.engine.tar_in import TarIn
from pytest_programbench.relay.relay_bridge import (
    ACK,
    ACK_PAYLOAD,
    CLOSE,
    DATA,
    EOF,
    OPEN,
    READY,
    WINDOW,
    FrameReader,
    frame,
)
from pytest_programbench.sandbox.layout import RELAY_BRIDGE_PATH

log = logging.getLogger(__name__)

READY_TIMEOUT = 60.0
BUFFER = 65536
# The bridge sends no more than its window of unacknowledged bytes per channel (plus the read that crossed it): a
# channel holding more is not the bridge we started, and is dropped. So the agent's bytes held here are at most
# MAX_CONNECTIONS * MAX_QUEUED, whatever it sends.
MAX_QUEUED = WINDOW + BUFFER
# Seconds an agent's bytes are still taken (and dropped) after the relay stopped reading them (see _pump_downstream).
DISCARD_S = 60.0


class TunnelError(RuntimeError):
    """The tunnel could not be opened: the sandbox is unusable for a relay (an infrastructure error)."""


_HALF_CLOSE = b""  # queued after the agent's last bytes: pass its half-close on to the relay


class _Channel:
    """One agent connection: its bytes to the relay go through a queue and a writer thread of their own, so a
    relay that is slow to read one request never holds up the tunnel's other channels."""

    def __init__(self, upstream: socket.socket) -> None:
        self.upstream = upstream
        self.ended: set[str] = set()  # "in" (the agent's side ended), "out" (the relay's side ended)
        self.outbox: queue.Queue[bytes] = queue.Queue()
        self.queued = 0  # bytes in the outbox, at most MAX_QUEUED (the bridge's window)
        self.count_lock = threading.Lock()  # queued is changed by the reader and by the writer


class RelayTunnel:
    """``RelayTunnel(api, container_id, connect).open(port)`` ... ``close()``.

    ``connect`` opens one connection to the relay (e.g. its Unix socket); it is called once per channel.
    """

    def __init__(self, api: Any, container_id: str, connect: Callable[[], socket.socket]) -> None:
        self.api = api
        self.container_id = container_id
        self.connect = connect
        self._stream: ExecStream | None = None
        self._write_lock = threading.Lock()
        self._channels: dict[int, _Channel] = {}
        self._lock = threading.Lock()
        self._settled = threading.Event()  # READY arrived, or the bridge ended before it
        self._listening = False
        self._stderr = bytearray()
        self._reader: threading.Thread | None = None

    def open(self, port: int, *, script: bytes) -> RelayTunnel:
        """Copy the bridge in, start it, and return once it listens on the sandbox's ``127.0.0.1:port``."""
        self._install(script)
        argv = ["python3", "-I", "-S", RELAY_BRIDGE_PATH, "--listen", f"127.0.0.1:{port}", "--stdio"]
        exec_id = self.api.exec_create(self.container_id, argv, stdin=True, stdout=True, stderr=True,
                                       user="0:0", workdir="/")["Id"]
        self._stream = ExecStream(self.api.exec_start(exec_id, socket=True))
        self._reader = threading.Thread(target=self._read, name="pb-relay-tunnel", daemon=True)
        self._reader.start()
        if not self._settled.wait(READY_TIMEOUT) or not self._listening:
            detail = self._stderr.decode("utf-8", "replace").strip()[-2000:] or "no output"
            self.close()
            raise TunnelError(f"the relay bridge did not start in the sandbox: {detail}")
        return self

    def _install(self, script: bytes) -> None:
        directory = RELAY_BRIDGE_PATH.rsplit("/", 1)[0]
        # root-owned, readable: nothing secret in it
        archive = TarIn().directory(directory, 0o755).file(RELAY_BRIDGE_PATH, script, 0o644)
        if not archive.put(self.api, self.container_id, "/"):
            raise TunnelError("could not copy the relay bridge into the sandbox")

    # -- the sandbox's side ------------------------------------------------------------------------------------

    def _send(self, channel: int, kind: int, payload: bytes = b"") -> None:
        stream = self._stream
        if stream is None:
            return
        with self._write_lock, contextlib.suppress(OSError):
            stream.write(frame(channel, kind, payload))

    def _read(self) -> None:
        assert self._stream is not None
        frames = FrameReader()
        try:
            for kind, payload in self._stream.frames():
                if kind == STDERR:
                    self._stderr += payload[-4096:]
                    del self._stderr[:-8192]
                    continue
                if kind != STDOUT:
                    continue
                for channel, what, data in frames.feed(payload):
                    self._dispatch(channel, what, data)
        except ValueError as exc:  # a malformed frame: the bridge is not ours to trust further
            log.warning("relay tunnel: %s", exc)
        finally:
            self._settled.set()
            self._drop_all()

    def _dispatch(self, channel: int, kind: int, data: bytes) -> None:
        if kind == READY:
            self._listening = True
            self._settled.set()
        elif kind == OPEN:
            self._open_channel(channel)
        else:
            with self._lock:
                state = self._channels.get(channel)
            if state is None:
                return
            if kind == DATA and data:
                with state.count_lock:
                    state.queued += len(data)
                    over = state.queued > MAX_QUEUED
                if over:
                    self._drop(channel)
                    self._send(channel, CLOSE)
                    return
                state.outbox.put(data)
            elif kind == EOF:
                state.outbox.put(_HALF_CLOSE)
            elif kind == CLOSE:
                self._drop(channel)

    def _open_channel(self, channel: int) -> None:
        try:
            upstream = self.connect()
        except OSError as exc:
            log.warning("relay tunnel: cannot reach the relay: %s", exc)
            self._send(channel, CLOSE)
            return
        state = _Channel(upstream)
        with self._lock:
            self._channels[channel] = state
        threading.Thread(target=self._pump_upstream, args=(channel, upstream), name=f"pb-relay-tunnel-{channel}",
                         daemon=True).start()
        threading.Thread(target=self._pump_downstream, args=(channel, state), name=f"pb-relay-tunnel-{channel}w",
                         daemon=True).start()

    def _pump_downstream(self, channel: int, state: _Channel) -> None:
        """The agent's bytes to the relay, in order; its half-close after them.

        A relay that stops reading (it answered a refused request and closed) ends only this direction: its answer
        is still read by ``_pump_upstream``, and the agent's remaining bytes are acknowledged and dropped for up to
        ``DISCARD_S``, so the agent finishes sending and reads the answer instead of a reset."""
        deadline: float | None = None  # set once the relay stopped reading
        while True:
            try:
                data = state.outbox.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:  # an agent still sending long after the relay closed: end the channel
                self._drop(channel)
                self._send(channel, CLOSE)
                return
            if not data:  # _HALF_CLOSE
                if deadline is None:
                    with contextlib.suppress(OSError):
                        state.upstream.shutdown(socket.SHUT_WR)
                self._ended_half(channel, "in")
                return
            if deadline is None:
                try:
                    state.upstream.sendall(data)
                except OSError:
                    deadline = time.monotonic() + DISCARD_S
            with state.count_lock:
                state.queued -= len(data)
            self._send(channel, ACK, ACK_PAYLOAD.pack(len(data)))  # the bridge may read that much more

    def _pump_upstream(self, channel: int, upstream: socket.socket) -> None:
        """The relay's answers go back into the sandbox as DATA frames, then EOF (or CLOSE on an error)."""
        try:
            while True:
                data = upstream.recv(BUFFER)
                if not data:
                    break
                self._send(channel, DATA, data)
        except OSError:
            self._send(channel, CLOSE)
            self._drop(channel)
            return
        self._send(channel, EOF)
        self._ended_half(channel, "out")

    def _ended_half(self, channel: int, direction: str) -> None:
        with self._lock:
            state = self._channels.get(channel)
            if state is None:
                return
            state.ended.add(direction)
            done = state.ended == {"in", "out"}
        if done:
            self._drop(channel)

    def _drop(self, channel: int) -> None:
        with self._lock:
            state = self._channels.pop(channel, None)
        if state is not None:
            with contextlib.suppress(OSError):
                state.upstream.shutdown(socket.SHUT_RDWR)  # wakes both pumps
            with contextlib.suppress(OSError):
                state.upstream.close()
            state.outbox.put(_HALF_CLOSE)  # ends the writer if it waits

    def _drop_all(self) -> None:
        with self._lock:
            channels = list(self._channels)
        for channel in channels:
            self._drop(channel)

    def close(self) -> None:
        """End the bridge (its stdin closes) and every channel. Idempotent."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        if self._reader is not None:
            self._reader.join(10)
        self._drop_all()
