"""The network guard, as a pytest plugin: any connection or datagram to a non-loopback address fails.

It raises before anything is sent. The project's own suite loads it, and so does every pytest session the suite
starts (``PYTEST_ADDOPTS=-p tests.network_guard``, set in conftest.py), where the plugin under test actually runs.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any


class NonLoopbackConnection(AssertionError):
    """A test tried to reach an address outside this machine's loopback."""


def is_loopback(address: Any) -> bool:
    host = address[0] if isinstance(address, tuple) else address
    if host in ("localhost", ""):
        return True
    try:
        return bool(ipaddress.ip_address(host).is_loopback)
    except ValueError:
        return False  # a hostname other than localhost would need DNS: not on this machine


def _check(sock: socket.socket, address: Any) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(address):
        raise NonLoopbackConnection(f"a test reached for non-loopback address {address!r}")


def install() -> None:
    """Patch the socket class for the whole process (idempotent)."""
    if getattr(socket.socket, "_pb_guarded", False):
        return
    connect, connect_ex, sendto = socket.socket.connect, socket.socket.connect_ex, socket.socket.sendto

    def guarded_connect(self: socket.socket, address: Any) -> None:
        _check(self, address)
        connect(self, address)

    def guarded_connect_ex(self: socket.socket, address: Any) -> int:
        _check(self, address)
        return connect_ex(self, address)

    def guarded_sendto(self: socket.socket, data: Any, *args: Any) -> int:
        _check(self, args[-1])
        return sendto(self, data, *args)  # type: ignore[call-overload,no-any-return]

    socket.socket.connect = guarded_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = guarded_connect_ex  # type: ignore[method-assign]
    socket.socket.sendto = guarded_sendto  # type: ignore[method-assign]
    socket.socket._pb_guarded = True  # type: ignore[attr-defined]


def pytest_configure() -> None:
    install()
