"""The daemon's control connection (tierfs/fs/control_conn.py): direct socket calls
that still let the rest of the event loop run, and trio's errors."""
from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from tierfs.fs.control_conn import MAX_STREAK, ControlConn


def run(conn: ControlConn, main):
    """trio.run(main), closing the connection inside the loop (as the daemon does)."""
    async def wrapped():
        try:
            return await main()
        finally:
            conn.close()
    return trio.run(wrapped)


def test_a_client_that_never_lets_its_socket_run_dry_cannot_starve_the_loop():
    ours, theirs = socket.socketpair()
    messages = 20 * MAX_STREAK
    theirs.sendall(b"x" * messages)  # everything is there before the first read
    conn = ControlConn(ours)
    turns = []

    async def main():
        async def other_task():
            while True:
                turns.append(len(got))
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_task)
            await trio.lowlevel.checkpoint()  # let it start
            started = len(turns)
            while len(got) < messages:
                got.append(await conn.receive_some(1))
            ran = len(turns) - started
            nursery.cancel_scope.cancel()
        return ran

    got: list[bytes] = []
    try:
        ran = run(conn, main)
    finally:
        theirs.close()
    assert b"".join(got) == b"x" * messages
    # One turn for the other task at least every MAX_STREAK reads, never a wait.
    assert ran >= messages // MAX_STREAK - 1
    assert ran <= messages // MAX_STREAK + 1


def test_a_receive_waits_until_data_comes():
    ours, theirs = socket.socketpair()
    conn = ControlConn(ours)

    async def main():
        async with trio.open_nursery() as nursery:
            async def later():
                await trio.sleep(0.05)
                theirs.sendall(b"hello\n")
            nursery.start_soon(later)
            with trio.fail_after(10):
                return await conn.receive_some(100)

    try:
        assert run(conn, main) == b"hello\n"
    finally:
        theirs.close()


def test_a_peer_gone_is_trios_broken_resource_error():
    ours, theirs = socket.socketpair()
    conn = ControlConn(ours)
    theirs.close()

    async def main():
        assert await conn.receive_some(10) == b""  # an orderly end, as for a trio stream
        with pytest.raises(trio.BrokenResourceError):
            await conn.send_all(b"answer\n")

    run(conn, main)


def test_two_tasks_sending_at_once_is_an_error_not_mixed_bytes():
    ours, theirs = socket.socketpair()
    conn = ControlConn(ours)
    big = b"y" * (64 << 20)  # more than the socket buffer holds: the first send waits

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.send_all, big)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await conn.send_all(b"second\n")
            nursery.cancel_scope.cancel()

    try:
        run(conn, main)
    finally:
        theirs.close()


def test_a_send_larger_than_the_socket_buffer_arrives_whole():
    ours, theirs = socket.socketpair()
    conn = ControlConn(ours)
    data = bytes(range(256)) * (16 << 10)  # 4 MiB
    received = bytearray()

    def drain():
        while len(received) < len(data):
            chunk = theirs.recv(1 << 20)
            if not chunk:
                return
            received.extend(chunk)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, drain)
            with trio.fail_after(30):
                await conn.send_all(data)

    try:
        run(conn, main)
    finally:
        theirs.close()
    assert bytes(received) == data
