"""The FUSE request wait: returns at once while requests are queued, lets trio
wait when none are, and still yields to trio every MAX_STREAK requests."""
import os
import socket

import pyfuse3
import pytest
import trio
import trio.testing

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


def _drain(sock) -> None:
    sock.setblocking(False)
    sock.recv(4096)


def test_background_gives_way_until_queued_requests_are_read(trio_waits, fuse_fd):
    fd, peer = fuse_fd
    waiter = request_wait.RequestWaiter(Stats())
    order = []

    async def background():
        await waiter.give_way()
        order.append("background")

    async def main():
        await waiter.wait_readable(fd)  # the reader is known, the queue empty
        peer.send(b"request")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(background)
            await trio.testing.wait_all_tasks_blocked()
            assert order == []  # a request waits unread: background holds off
            order.append("request read")
            _drain(socket.socket(fileno=os.dup(fd)))
            await waiter.wait_readable(fd)  # finds the queue empty: background goes on
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=1))
    assert order == ["request read", "background"]
    assert waiter.stats.counters["background_gave_way"] == 1


def test_background_waits_for_queued_requests_a_bounded_time(trio_waits, fuse_fd):
    fd, peer = fuse_fd
    waiter = request_wait.RequestWaiter(Stats())

    async def main():
        await waiter.wait_readable(fd)
        peer.send(b"request")  # never read: a reader stuck in a long handler
        t0 = trio.current_time()
        await waiter.give_way()
        return trio.current_time() - t0
    waited = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert waited == pytest.approx(request_wait.GIVE_WAY_MAX_S)


def test_background_goes_on_at_once_with_no_request_queued(trio_waits, fuse_fd):
    fd, _peer = fuse_fd
    waiter = request_wait.RequestWaiter(Stats())

    async def main():
        await waiter.wait_readable(fd)
        t0 = trio.current_time()
        await waiter.give_way()
        return trio.current_time() - t0
    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == 0
    assert "background_gave_way" not in waiter.stats.counters


def test_a_closed_device_holds_no_requests(trio_waits):
    a, b = socket.socketpair()
    waiter = request_wait.RequestWaiter(Stats())
    with b:
        trio.run(waiter.wait_readable, a.fileno())
        b.send(b"request")
        assert waiter.requests_queued()
        a.close()  # the session ended: poll says POLLNVAL, not POLLIN
        assert not waiter.requests_queued()
