"""tierfs.sdnotify against real AF_UNIX datagram sockets, as systemd's manager listens."""
from __future__ import annotations

import os
import socket
import uuid

import pytest

from tierfs import sdnotify


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)  # a datagram that never came fails the test instead of hanging it
    return sock


def test_sends_the_state_to_a_path_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    with _receiver(path) as rx:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert sdnotify.notify("READY=1") is True
        assert rx.recv(4096) == b"READY=1"
        assert sdnotify.notify("STOPPING=1\nSTATUS=unmounting") is True
        assert rx.recv(4096) == b"STOPPING=1\nSTATUS=unmounting"


def test_sends_the_state_to_an_abstract_socket(monkeypatch):
    name = f"tierfs-test-{os.getpid()}-{uuid.uuid4().hex}"
    with _receiver("\0" + name) as rx:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("READY=1") is True
        assert rx.recv(4096) == b"READY=1"


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_variable_sends_nothing(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    else:
        monkeypatch.setenv("NOTIFY_SOCKET", value)

    def no_socket(*args, **kwargs):
        raise AssertionError("notify opened a socket without NOTIFY_SOCKET")

    monkeypatch.setattr(sdnotify.socket, "socket", no_socket)
    assert sdnotify.notify("READY=1") is False


def test_missing_socket_returns_false(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "no-such-socket"))
    assert sdnotify.notify("READY=1") is False


def test_socket_nobody_listens_on_returns_false(tmp_path, monkeypatch):
    path = str(tmp_path / "closed")
    _receiver(path).close()  # the file stays, nobody reads it: ECONNREFUSED
    assert os.path.exists(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sdnotify.notify("READY=1") is False


@pytest.mark.parametrize("value", ["/" + "x" * 200, "@", "vsock:2:1234", "relative/path"])
def test_unusable_addresses_return_false(monkeypatch, value):
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.notify("READY=1") is False
