"""The FUSE request wait: returns at once while requests are queued, lets trio
wait when none are, and still yields to trio every MAX_STREAK requests."""
import socket

import pyfuse3
import pytest
import trio

from tierfs.fs import request_wait
from tierfs.tier.stats import Stats


@pytest.fixture
def trio_waits(monkeypatch):
    """Record trio's own waits instead of blocking in them."""
    calls = []

    async def fake_wait_readable(fd):
        calls.append(fd)
    monkeypatch.setattr(trio.lowlevel, "wait_readable", fake_wait_readable)
    return calls


@pytest.fixture
def fuse_fd():
    """A stand-in for /dev/fuse: (the fd to wait on, its writing end)."""
    a, b = socket.socketpair()
    with a, b:
        yield a.fileno(), b


def test_queued_requests_skip_trio_wait_up_to_streak(trio_waits, fuse_fd):
    fd, peer = fuse_fd
    waiter = request_wait.RequestWaiter(Stats())
    peer.send(b"request")  # fd is readable from now on

    async def main():
        for _ in range(request_wait.MAX_STREAK + 1):
            await waiter.wait_readable(fd)
    trio.run(main)
    assert waiter.stats.counters["fuse_requests_queued"] == request_wait.MAX_STREAK
    assert trio_waits == [fd]  # the one turn given back to trio


def test_empty_queue_waits_in_trio(trio_waits, fuse_fd):
    fd, _peer = fuse_fd
    waiter = request_wait.RequestWaiter(Stats())
    trio.run(waiter.wait_readable, fd)
    assert trio_waits == [fd]
    assert waiter.stats.counters["fuse_requests_queued"] == 0


def test_install_changes_pyfuse3_only(monkeypatch):
    monkeypatch.setattr(pyfuse3, "trio", pyfuse3.trio)  # restored after the test
    real_wait = trio.lowlevel.wait_readable
    waiter = request_wait.install(Stats())
    assert pyfuse3.trio.lowlevel.wait_readable == waiter.wait_readable
    assert pyfuse3.trio.Lock is trio.Lock  # the rest of trio is the real one
    assert trio.lowlevel.wait_readable is real_wait
