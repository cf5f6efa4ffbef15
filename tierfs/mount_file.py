"""A small file read through the mount for two FUSE requests instead of three.

Python's open() fstat()s every file it opens (to refuse a directory, and to size its
buffer). On a mount with the writeback cache the kernel forgets a file's block count
at every close (the daemon does not keep it in step with the cached writes), and a
stat asks for it, so that fstat costs a GETATTR request: a warm small file read with
open() costs the daemon open, getattr and release. `kind_dev_size(path)` asks the
kernel for a file's type, device and size only (statx with a mask that leaves out the
block count), which it answers from its attribute cache, and `open_file()` opens the
file with os.open() and never stats it: open and release remain. `tierfs.open` uses
both for files below MOUNT_BELOW.

The file object, `MountFile`, reads with the descriptor's own offset as a FileIO does,
so fileno(), seek() and os.read() on the descriptor agree with it.

Where libc has no statx, `available` is False and callers use os.stat() and open().
"""
from __future__ import annotations

import ctypes
import io
import os
import stat

STATX_TYPE, STATX_SIZE = 0x1, 0x200
AT_FDCWD = -100


class _Statx(ctypes.Structure):
    # struct statx of <linux/stat.h>, the same on every architecture (256 bytes).
    _fields_ = [("mask", ctypes.c_uint32), ("blksize", ctypes.c_uint32),
                ("attributes", ctypes.c_uint64), ("nlink", ctypes.c_uint32),
                ("uid", ctypes.c_uint32), ("gid", ctypes.c_uint32),
                ("mode", ctypes.c_uint16), ("_spare0", ctypes.c_uint16),
                ("ino", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("blocks", ctypes.c_uint64), ("attributes_mask", ctypes.c_uint64),
                ("times", ctypes.c_uint8 * 64),
                ("rdev_major", ctypes.c_uint32), ("rdev_minor", ctypes.c_uint32),
                ("dev_major", ctypes.c_uint32), ("dev_minor", ctypes.c_uint32),
                ("_rest", ctypes.c_uint8 * 112)]


def _statx_function():
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                   ctypes.POINTER(_Statx)]
    fn.restype = ctypes.c_int
    return fn


_statx = _statx_function()
available = _statx is not None


def kind_dev_size(path) -> tuple[int, int, int]:
    """(st_mode's file type bits, st_dev, st_size) of `path`, following symlinks, from
    the kernel's cached attributes where it has them (no block count asked). Raises
    what os.stat() raises."""
    out = _Statx()
    if _statx(AT_FDCWD, os.fsencode(path), 0, STATX_TYPE | STATX_SIZE, ctypes.byref(out)):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return stat.S_IFMT(out.mode), os.makedev(out.dev_major, out.dev_minor), out.size


class MountFile(io.RawIOBase):
    """Raw reader over a descriptor opened on the mount: a FileIO that never stats."""

    def __init__(self, fd: int, name, size: int):
        super().__init__()
        self._fd, self.name, self.mode, self._size = fd, name, "rb", size

    def readinto(self, b) -> int:
        self._check_open()
        return os.readv(self._fd, [b])

    def read(self, size: int = -1) -> bytes:
        """As FileIO.read: the kernel fills the bytes returned, where RawIOBase would
        read into a new bytearray and copy it (DirectFile.readall says why not)."""
        if size is None or size < 0:
            return self.readall()
        self._check_open()
        return os.read(self._fd, size)

    def readall(self) -> bytes:
        """The rest of the file: one read of the size known at open, and one more
        that finds the end."""
        self._check_open()
        chunks = []
        want = max(self._size - os.lseek(self._fd, 0, os.SEEK_CUR), 0) + 1
        while chunk := os.read(self._fd, want):
            chunks.append(chunk)
            want = 64 << 10  # the end, or what was appended since
        return b"".join(chunks)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_open()
        return os.lseek(self._fd, offset, whence)

    def tell(self) -> int:
        self._check_open()
        return os.lseek(self._fd, 0, os.SEEK_CUR)

    def readable(self) -> bool:
        self._check_open()
        return True

    def seekable(self) -> bool:
        self._check_open()
        return True

    def writable(self) -> bool:
        self._check_open()
        return False

    def fileno(self) -> int:
        self._check_open()
        return self._fd

    def close(self) -> None:
        if not self.closed:
            try:
                os.close(self._fd)
            finally:
                super().close()

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")

    def __repr__(self) -> str:
        return f"<tierfs.MountFile name={self.name!r}>"


def open_file(path, name, size: int, buffering: int, buffer_size: int):
    """open(path, "rb", buffering) of a regular file of `size` bytes, as a MountFile."""
    raw = MountFile(os.open(path, os.O_RDONLY | os.O_CLOEXEC), name, size)
    if buffering == 0:
        return raw
    return io.BufferedReader(raw, buffering if buffering > 1 else buffer_size)
