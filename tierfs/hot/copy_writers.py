"""Hot copies of fetched runs written by helper processes.

A cold epoch installs tens of thousands of fetched small files. Written by the daemon's
worker threads, each system call of a copy (open, write, close) hands the interpreter
lock back and forth with the event loop, which is busy serving the loader at the same
time: a run of fetched neighbours then waited 248-594 ms for an install thread instead
of 20-29 ms with the copies written by processes of their own (README, "Fetched copies
written by helper processes"). A worker thread copies the run's bytes into a shared
memory buffer and hands the helper a list of paths; the helper writes them
(copy_writer.py).

Anything a helper cannot do (a run too large for its buffer, a helper that cannot be
started or died, a write that fails) is left to the caller, which writes the copies
in its own thread as before: that path also knows how to wait for the trash on a full
disk, and raises the error the caller reports.

The helpers are started by start(), on the daemon's main thread: each dies with the
thread that started it (copy_writer.py), so they die with the daemon and never write
after it. One that dies is not replaced (from a worker thread, its replacement would
die with that thread); the threads write its share from then on.
"""
from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

BUFFER_BYTES = 8 << 20  # shared memory per helper: a run is handed over in parts this large
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "copy_writer.py")


def _address(buffer) -> int:
    """Where a writable buffer's bytes begin (the ctypes object that tells is let go
    at once: a buffer exported to it could not be closed)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _one_region(items: list) -> tuple[int, int, list[int]] | None:
    """(address, length, each item's offset in it) of the stretch of memory that holds
    the bytes of every item, where they are all views of one writable buffer (the
    pieces of one fetched span) and the stretch fits the shared buffer; else None.
    Copied at once with ctypes.memmove, which lets the interpreter lock go: copied
    piece by piece, a span's megabytes went over under the lock, which the event loop
    waits for."""
    owner, addresses = None, []
    for _path, data in items:
        if (not isinstance(data, memoryview) or data.readonly or not data.c_contiguous
                or not data.nbytes or (owner is not None and data.obj is not owner)):
            return None
        owner = data.obj
        addresses.append(_address(data))
    if not addresses:
        return None
    low = min(addresses)
    high = max(address + data.nbytes for address, (_p, data) in zip(addresses, items))
    if high - low > BUFFER_BYTES:
        return None
    return low, high - low, [address - low for address in addresses]


class _Helper:
    def __init__(self):
        self.memfd = os.memfd_create("tierfs-copies", os.MFD_CLOEXEC)
        self.buffer = None
        try:
            os.ftruncate(self.memfd, BUFFER_BYTES)
            self.buffer = mmap.mmap(self.memfd, BUFFER_BYTES)
            self._address = _address(self.buffer)
            # close_fds (the default) keeps the FUSE connection and everything else of
            # the daemon out of it; -I -S: the standard library only, nothing from the
            # environment.
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", SCRIPT, str(self.memfd), str(BUFFER_BYTES),
                 str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(self.memfd,))
        except BaseException:
            if self.buffer is not None:
                self.buffer.close()
            os.close(self.memfd)
            raise

    def write(self, items: list[tuple[str, memoryview | bytes]]) -> bool:
        """Write the copies (each no larger than the buffer) in parts; False when one
        failed, OSError or ValueError when the helper is gone."""
        region = _one_region(items)
        if region is not None:  # the pieces of one fetched span: one copy, lock let go
            address, length, offsets = region
            ctypes.memmove(self._address, address, length)
            return self._written([(path, offset, data.nbytes)
                                  for (path, data), offset in zip(items, offsets)])
        start = 0
        while start < len(items):
            used, part = 0, []
            for path, data in items[start:]:
                if used + len(data) > BUFFER_BYTES:
                    break
                self.buffer[used:used + len(data)] = data
                part.append((path, used, len(data)))
                used += len(data)
            if not self._written(part):
                return False
            start += len(part)
        return True

    def _written(self, part: list[tuple[str, int, int]]) -> bool:
        """Have the helper write [(path, offset in the buffer, length)]: False when one
        failed."""
        self.proc.stdin.write(json.dumps(part).encode() + b"\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise BrokenPipeError("the copy writer ended")
        return json.loads(answer) is None

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.buffer.close()
        os.close(self.memfd)


class CopyWriters:
    """Up to `count` helpers, each used by one thread at a time."""

    def __init__(self, count: int):
        self.count = count
        self._idle: list[_Helper] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start the helpers (on the daemon's main thread: see above). A store whose
        helpers were never started, or could not be, writes in its threads."""
        try:
            helpers = [_Helper() for _ in range(self.count)]
        except OSError as e:
            log.warning("cannot start the hot copy writer processes (%s): worker threads "
                        "write the copies of fetched runs", e)
            return
        with self._lock:
            self._idle += helpers

    def write(self, items: list[tuple[str, memoryview | bytes]]) -> bool:
        """Write each (path, bytes) (blocking: worker threads). False if that was not
        done (the copies already written are the caller's to remove)."""
        if any(len(data) > BUFFER_BYTES for _p, data in items):
            return False
        with self._lock:
            if self._closed or not self._idle:
                return False
            helper = self._idle.pop()
        try:
            ok = helper.write(items)
        except (OSError, ValueError) as e:  # it died, or was killed
            log.warning("a hot copy writer process ended (%s): worker threads write its "
                        "share of the copies of fetched runs", e)
            helper.close()
            return False
        with self._lock:
            if not self._closed:
                self._idle.append(helper)
                return ok
        helper.close()
        return ok

    def close(self) -> None:
        """Stop the idle helpers; one in use stops when its thread is done with it."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for helper in idle:
            helper.close()
