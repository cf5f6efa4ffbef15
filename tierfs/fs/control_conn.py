"""One control connection on a plain non-blocking socket.

trio's socket methods pass through the scheduler twice per call (a cancel check
before, a yield after), and every pass costs an epoll_wait and a trip through
the run loop. A loader opening small files one by one sends one control request
per file, so those passes were most of the daemon's CPU per direct open
(docs/architecture.md, Round trips). Here a receive or send is first tried
directly; the task waits through trio only when the socket is not ready, and
yields at least every MAX_STREAK calls so that a client that never lets its
socket run dry cannot starve the mount. Errors are trio's, as a trio stream
raises them: BrokenResourceError for a peer gone, BusyResourceError for two
tasks sending at once.
"""
from __future__ import annotations

import socket

import trio

MAX_STREAK = 64


class ControlConn:
    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.socket = sock  # the stdlib socket: peer credentials, SCM_RIGHTS
        self._streak = 0
        self._sending = False

    async def _call(self, call, wait):
        """call() on the socket, waiting with `wait` while it would block; then a turn
        counted (a yield every MAX_STREAK calls made without waiting)."""
        while True:
            try:
                result = call()
            except BlockingIOError:
                self._streak = 0
                await wait(self.socket)
                continue
            except OSError as e:
                raise trio.BrokenResourceError(str(e)) from e
            self._streak += 1
            if self._streak >= MAX_STREAK:
                self._streak = 0
                await trio.lowlevel.checkpoint()
            return result

    async def receive_some(self, max_bytes: int) -> bytes:
        return await self._call(lambda: self.socket.recv(max_bytes),
                                trio.lowlevel.wait_readable)

    async def sendmsg(self, buffers: list, ancdata=()) -> int:
        """Bytes sent of `buffers` (the descriptors in `ancdata` go with the first
        byte; the caller sends what is left with send_all)."""
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this connection")
        self._sending = True
        try:
            return await self._call(lambda: self.socket.sendmsg(buffers, ancdata),
                                    trio.lowlevel.wait_writable)
        finally:
            self._sending = False

    async def send_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            sent = await self.sendmsg([view])
            view = view[sent:]

    def close(self) -> None:
        trio.lowlevel.notify_closing(self.socket)
        self.socket.close()
