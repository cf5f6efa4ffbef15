"""Direct writes: `tierfs.open(path, "wb")` ("xb", "ab", "r+b", "w+b", "x+b", "a+b").

    import tierfs, torch
    with tierfs.open("/mnt/tierfs/ckpt/step-1000.pt", "wb") as f:
        torch.save(model.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())   # durable, as through the mount

The file is opened on the mount first: the kernel checks permissions and does
O_CREAT, O_EXCL and O_TRUNC as for any open(). The daemon checks that descriptor
(by its number, in /proc) when asked over its control socket, and answers with descriptors of the file's hot
extent files, a range at a time, and the data is then written with pwrite() into
them: no FUSE round trip and no daemon work per write. The daemon keeps the
extents a writer holds from being uploaded; when the writer moves on, closes, or
exits, they are released: marked dirty, the file's size grown to what they hold,
and uploaded after --upload-delay like any data written through the mount.

- `fileno()` is the descriptor on the mount: `os.fsync(f.fileno())` makes what was
  written durable (the daemon fsyncs the extent files and its metadata).
- Close-to-open: other processes see the data through the mount once close()
  returns (the daemon drops the kernel's cached pages and attributes of the file);
  before that they may see it or not.
- Reads of a "+" file come from the extents held, else through the mount.
- "a" writes at the end of the file as this file object knows it: other processes
  appending to the same file at the same time interleave badly (use the mount).
- A file object belongs to the process that opened it: a forked child that closes
  its copy closes only its descriptors.
- If the daemon dies while the file is open, writes keep landing in the hot tier,
  but close() raises OSError(EIO): what was written since the last fsync may be lost.

Anything else (not on a tierfs mount, a daemon that cannot be reached or does not
offer direct writes, a special file) is written with the builtin open() on the
descriptor already opened (logged once, never an error).
"""
from __future__ import annotations

import errno
import io
import logging
import os
import stat

from .hot import pagecache
from .direct import (BUFFER_SIZE, RANGE, Positioned, _close_all, _Conn, _Fallback, _forget,
                     _mount_of, _note, _pread, _talk, _zero)

log = logging.getLogger(__name__)

# mode (letters sorted) -> (open flags, readable, append)
_MODES = {
    "bw": (os.O_WRONLY | os.O_CREAT | os.O_TRUNC, False, False),
    "bx": (os.O_WRONLY | os.O_CREAT | os.O_EXCL, False, False),
    "ab": (os.O_WRONLY | os.O_CREAT | os.O_APPEND, False, True),
    "+br": (os.O_RDWR, True, False),
    "+bw": (os.O_RDWR | os.O_CREAT | os.O_TRUNC, True, False),
    "+bx": (os.O_RDWR | os.O_CREAT | os.O_EXCL, True, False),
    "+ab": (os.O_RDWR | os.O_CREAT | os.O_APPEND, True, True),
}


def write_mode(mode: str):
    """(flags, readable, append) of a binary write mode tierfs.open takes, else None."""
    if len(set(mode)) != len(mode):
        return None
    return _MODES.get("".join(sorted(mode)))


def open_for_writing(file, mode: str, buffering: int):
    flags, readable, append = write_mode(mode)
    path = os.fspath(file)
    fd = os.open(path, flags | os.O_CLOEXEC, 0o666)  # what open() raises, it raises
    conn = None
    try:
        st = os.fstat(fd)
        mount = _mount_of(path, st.st_dev) if stat.S_ISREG(st.st_mode) else None
        if mount is None:
            raise _Fallback("not on a tierfs mount" if stat.S_ISREG(st.st_mode)
                            else "not a regular file", logging.INFO)
        conn = _connect(path, mount)
        try:
            lines, final = _talk(conn.sock, {"cmd": "direct_write", "op": "open", "fd": fd,
                                             "keep": True})
        except OSError as e:
            raise _Fallback(f"the tierfs daemon did not answer: {e}") from None
        for _obj, fds in lines:
            _close_all(fds)
        if not final.get("ok"):
            why = str(final.get("error", "no reason given"))
            if why.startswith("unknown command"):
                raise _Fallback("the tierfs daemon does not offer direct writes "
                                "(an older version)", logging.INFO)
            if final.get("errno") in (errno.EROFS, errno.ENOSPC):
                raise OSError(final["errno"], why, path)
            raise _Fallback(f"the tierfs daemon refused direct writes: {why}")
        raw = DirectWriter(path, mode, fd, conn, final, st.st_size, readable, append)
    except _Fallback as e:
        if conn is not None:
            conn.sock.close()
        _note(str(e), e.level)
        # The open already happened (created, truncated): wrap it, do not redo it.
        return io.open(fd, mode.replace("x", "w"), buffering)
    except BaseException:
        if conn is not None:
            conn.sock.close()
        os.close(fd)
        raise
    if buffering == 0:
        return raw
    size = buffering if buffering > 1 else BUFFER_SIZE
    return io.BufferedRandom(raw, size) if readable else io.BufferedWriter(raw, size)


def _connect(path: str, mount) -> _Conn:
    """A connection of its own to the daemon (sessions end with it). A daemon that
    is gone may have been replaced by a new mount with the same device number: ask
    the file once more who serves it."""
    try:
        return _Conn(mount.socket)
    except OSError as e:
        _forget(mount)
        fresh = _mount_of(path, mount.dev)
        if fresh is not None and fresh.socket != mount.socket:
            try:
                return _Conn(fresh.socket)
            except OSError:
                _forget(fresh)
        raise _Fallback(f"cannot reach the tierfs daemon at {mount.socket}: "
                        f"{e.strerror}") from None


class DirectWriter(Positioned):
    """Raw file over the hot extent files of one tierfs file, for writing (and
    reading, in "+" modes). Holds extents a range at a time: a sequential writer
    gets ranges that double up to 64 extents, a random one single extents; what is
    not in the next range is released with that request."""

    def __init__(self, name, mode: str, mount_fd: int, conn: _Conn, info: dict, size: int,
                 readable: bool, append: bool):
        super().__init__(size)
        self.name = name
        self.mode = mode
        self._fd = mount_fd
        self._conn = conn
        self._sid = int(info["session"])
        self._E = int(info["extent_size"])
        self._pos = size if append else 0
        self._readable, self._append = readable, append
        self._held: dict[int, int] = {}  # extent -> descriptor of its hot file
        self._next, self._ahead = -1, 1  # where a sequential writer's next range starts
        self._owner = os.getpid()
        # Set by the first fileno(): writes and reads go through the mount descriptor.
        self._via_mount = False

    # ---- talking to the daemon --------------------------------------------------------
    def _request(self, req: dict):
        if os.getpid() != self._owner:  # its connection is the parent's
            raise OSError(errno.EBADF, "a file opened with tierfs.open for writing cannot be "
                                       "used after fork(): open it again in this process",
                          self.name)
        try:
            lines, final = _talk(self._conn.sock, {"cmd": "direct_write",
                                                   "session": self._sid, "keep": True, **req})
        except (OSError, _Fallback) as e:
            raise OSError(errno.EIO, f"the tierfs daemon went away while {self.name} was "
                                     f"open for direct writing ({e}): what was written "
                                     f"since the last fsync may be lost") from None
        if not final.get("ok"):
            for _obj, fds in lines:
                _close_all(fds)
            err = int(final.get("errno") or errno.EIO)
            raise OSError(err, str(final.get("error") or os.strerror(err)), self.name)
        return lines, final

    def _release_all(self, **req) -> None:
        """Give every held extent back (their descriptors close first)."""
        held, self._held = self._held, {}
        _close_all(held.values())
        self._request({"release": sorted(held), **req})

    def _hold(self, idx: int) -> int:
        """Descriptor of extent `idx`, asking the daemon for a range starting there."""
        self._ahead = min(self._ahead * 2, RANGE) if idx == self._next else 1
        last = idx + self._ahead - 1
        drop = [i for i in self._held if not idx <= i <= last]
        _close_all([self._held.pop(i) for i in drop])
        lines, _final = self._request({"release": drop, "hold": [idx, last]})
        for obj, fds in lines:
            extents = [i for res in obj["direct"] for i, _kind in res["extents"]]
            for i, fd in zip(extents, fds):
                old = self._held.pop(int(i), None)
                if old is not None:
                    _close_all([old])
                self._held[int(i)] = fd
        if idx not in self._held:
            raise OSError(errno.EIO, "the tierfs daemon gave no descriptor", self.name)
        self._next = max(self._held) + 1
        return self._held[idx]

    # ---- io.RawIOBase -------------------------------------------------------------------
    def write(self, b) -> int:
        with self._lock:
            self._check_open()
            view = memoryview(b).cast("B")
            n = len(view)
            if self._via_mount:
                return self._write_through_mount(view)
            pos = self._size if self._append else self._pos
            E = self._E
            done = 0
            while done < n:
                idx, off = divmod(pos + done, E)
                fd = self._held.get(idx)
                if fd is None:
                    fd = self._hold(idx)
                wrote = os.pwrite(fd, view[done:done + min(n - done, E - off)], off)
                if off + wrote == E:  # filled: its fsync later finds it written
                    pagecache.start_writeback(fd)
                done += wrote
            self._pos = pos + n
            self._size = max(self._size, self._pos)
            return n

    def _write_through_mount(self, view: memoryview) -> int:
        """write() once fileno() was asked for: with the mount's own semantics (an
        append lands at the end of the file as the kernel knows it)."""
        done = 0
        while done < len(view):
            if self._append:
                done += os.write(self._fd, view[done:])  # O_APPEND: at the end
            else:
                done += os.pwrite(self._fd, view[done:], self._pos + done)
        # The size is the kernel's from now on (_end()).
        self._pos = os.fstat(self._fd).st_size if self._append else self._pos + done
        return done

    def _end(self) -> int:
        return os.fstat(self._fd).st_size if self._via_mount else self._size

    def readinto(self, b) -> int:
        with self._lock:
            self._check_open()
            if not self._readable:
                raise io.UnsupportedOperation("read")
            view = memoryview(b).cast("B")
            n = max(0, min(len(view), self._end() - self._pos))
            E = self._E
            done = 0
            while done < n:
                pos = self._pos + done
                idx, off = divmod(pos, E)
                out = view[done:done + min(n - done, E - off)]
                fd = self._held.get(idx)
                # Released extents are the file's now: the mount has them.
                got = _pread(fd, out, off) if fd is not None else _pread(self._fd, out, pos)
                _zero(out[got:])  # a hole, or the short tail of an extent file
                done += len(out)
            self._pos += n
            return n

    def truncate(self, size: int | None = None) -> int:
        with self._lock:
            self._check_open()
            size = self._pos if size is None else size
            self._release_all()     # what was written is the file's first,
            os.ftruncate(self._fd, size)  # then the kernel cuts or grows it
            self._size = size
            return size

    def readable(self) -> bool:
        self._check_open()
        return self._readable

    def writable(self) -> bool:
        self._check_open()
        return True

    def fileno(self) -> int:
        """The file's descriptor on the mount (os.fsync on it makes the writes durable).
        From the first call on, this object writes and reads through that descriptor
        too, never the hot tier's files: whoever asks for the descriptor may write
        through it (numpy's tofile and np.save do), and the kernel's cached pages of
        the file, written back later, would overwrite direct writes it never saw. The
        extents held are given back first, and the kernel told the file's size and
        told to drop its pages, so writes through the descriptor build on the data
        written directly."""
        with self._lock:
            self._check_open()
            if not self._via_mount:
                self._release_all(tell=True)
                self._via_mount = True
            return self._fd

    def close(self) -> None:
        if self.closed:
            return
        error = None
        try:
            super().close()  # flush() first: nothing is buffered at this level
        finally:
            with self._lock:
                held, self._held = self._held, {}
                _close_all(held.values())
                try:
                    if os.getpid() == self._owner:  # a forked child ends nothing
                        self._request({"release": sorted(held), "close": True})
                        # mtime and ctime now, through the kernel: with the writeback
                        # cache it keeps its own and would not take the daemon's.
                        os.utime(self._fd)
                except OSError as e:
                    error = e
                finally:
                    self._conn.sock.close()
                    try:
                        os.close(self._fd)
                    except OSError as e:
                        error = error or e
        if error is not None:
            raise error

    def __repr__(self) -> str:
        return f"<tierfs.DirectWriter name={self.name!r} mode={self.mode!r}>"
