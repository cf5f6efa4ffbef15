"""The hot tier: one file per extent in a directory on local NVMe.

Reads that the page cache can serve (RWF_NOWAIT) and pwrites (into the page
cache) run inline on the caller's thread: faster than a thread hop. Reads that
must go to the disk, fsync and whole-extent stores are meant for worker
threads. Open file descriptors are cached.

Evicted extent files are kept as empty spares (up to MAX_SPARES, in a directory beside
the hot tier) and reused for the next fetched extents: on ext4 allocating an inode can
cost ten times the rename, open and write of reusing one (see docs/architecture.md).
A dropped copy is at most renamed out of its place on the caller's thread; the trash
(trash.py) empties it into a spare, or unlinks it, in a thread of its own.
A fetched extent is written into its spare where the spare lies and renamed into place
once written; a crash in between leaves bytes in a spare, so a new store drops the
spares it finds with bytes in them.
A file is made a spare only when nobody else has it open (a write lease succeeds), so
a descriptor handed out by the direct path never sees another file's data. The lease
is let go before the spare can be taken, and the store ignores SIGIO, by which the
kernel announces an open that breaks a lease (its default action ends the process).
"""
from __future__ import annotations

import collections
import errno
import fcntl
import itertools
import mmap
import os
import resource
import secrets
import signal
import threading

from ..checksum import HotCopyCheck
from ..errors import FsError
from . import trash as trash_module
from .copy_writers import CopyWriters

MAX_SPARES = 65536  # empty inodes kept for reuse (a few MiB of inode table)
# A temp file is opened without O_TRUNC: a spare is empty already, and on ext4 a
# truncate to zero marks a file as being replaced, so the close after its writes would
# push them to the disk at once, in the worker thread (auto_da_alloc), instead of
# leaving them to the kernel's writeback.
TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
CHECK_PIECE = 1 << 20  # copy_matches reads an extent file in pieces of this size
# Hot copies are opened with O_NOATIME: a fetched copy is read right after it is
# written, and on a relatime mount (atime not after mtime) that first read would dirty
# its inode, a journal update per copy on the thread that reads it, most often the
# trio thread. Nothing reads a hot copy's atime. Where the flag is refused (EPERM:
# the daemon neither owns the file nor has CAP_FOWNER), files are opened without it.
_noatime = getattr(os, "O_NOATIME", 0)

_local = threading.local()


def open_copy(path: str, flags: int) -> int:
    """os.open() of a hot copy, with O_NOATIME where the daemon may use it."""
    global _noatime
    if _noatime:
        try:
            return os.open(path, flags | _noatime, 0o600)
        except PermissionError:
            _noatime = 0  # not the files' owner: plain opens from now on
    return os.open(path, flags, 0o600)


def _open_in_place(path: str, flags: int) -> int:
    """open_copy(); with O_CREAT, the copy's subdirectory is made for the first extent
    in it (no stat per extent)."""
    try:
        return open_copy(path, flags)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open_copy(path, flags)


def _read_buffer() -> memoryview:
    """This thread's buffer for copy_matches: memory touched once, not per extent.
    It starts on a page boundary: from the heap it could start 16 bytes past one,
    where the kernel's copies from the page cache run several times slower on some
    CPUs (README, Benchmark § Where a reader's buffer starts)."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(mmap.mmap(-1, CHECK_PIECE))
    return buf


def _ignore_lease_breaks() -> bool:
    """A lease break (someone opens a file while _make_spare holds its lease, for the
    microseconds of a truncate and a rename) is announced by SIGIO, whose default
    action ends the process: a daemon would die with no word in its log. Ignored,
    the opener just waits for the lease to go. Signal handlers can only be set from
    the main thread: a store made elsewhere takes no leases (evicted files are
    unlinked, not kept as spares). True if leases may be used."""
    if signal.getsignal(signal.SIGIO) == signal.SIG_IGN:
        return True
    try:
        signal.signal(signal.SIGIO, signal.SIG_IGN)
    except ValueError:  # not the main thread
        return False
    return True


class HotStore:
    def __init__(self, root: str, max_open: int = 2048, copy_writers: int = 2):
        """copy_writers: processes that write_temps() may use at once (one per thread
        calling it), once `self.copy_writers.start()` has started them."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            max_open = max(64, min(max_open, soft // 4))  # leave room for everything else
        self.root = root
        os.makedirs(root, exist_ok=True)
        self._fds: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        self._max_open = max_open
        self._temp_ids = itertools.count()
        self.nowait = True  # the filesystem supports RWF_NOWAIT reads (until it says no)
        self.spare_dir = root.rstrip("/") + ".spare"
        os.makedirs(self.spare_dir, exist_ok=True)
        # Names of empty spare files; deque appends and pops are atomic across threads.
        self._spares = collections.deque(self._empty_spares())
        # New spares' names: never one that a spare left by an earlier store has, which
        # a rename would replace while a fetch is writing into it.
        self._spare_prefix = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._spare_ids = itertools.count()
        # The kernel grants leases here (until it says no), and a lease break cannot
        # kill this process (_ignore_lease_breaks).
        self.leases = _ignore_lease_breaks()
        self.trash = trash_module.Trash(root.rstrip("/") + ".trash", self._recycle)
        self.copy_writers = CopyWriters(copy_writers)

    def _empty_spares(self) -> list[str]:
        """Names of the spares left in the spare directory. One with bytes in it was
        being written when its store stopped (a crash): removed, since its bytes are
        not counted anywhere (one stat per spare, as scan() makes per hot file)."""
        names = []
        for entry in os.scandir(self.spare_dir):
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue  # not ours (put there by hand): never written into
                if entry.stat(follow_symlinks=False).st_size:
                    os.unlink(entry.path)
                    continue
            except FileNotFoundError:
                continue
            names.append(entry.name)
        return names

    def path(self, ino: int, idx: int) -> str:
        return os.path.join(self.root, f"{ino & 0xff:02x}", f"{ino:x}.{idx:x}")

    def _fd(self, ino: int, idx: int, create: bool) -> int:
        key = (ino, idx)
        fd = self._fds.get(key)
        if fd is not None:
            self._fds.move_to_end(key)
            return fd
        fd = _open_in_place(self.path(ino, idx),
                            os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0))
        self._fds[key] = fd
        if len(self._fds) > self._max_open:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def _forget_fd(self, ino: int, idx: int) -> None:
        fd = self._fds.pop((ino, idx), None)
        if fd is not None:
            os.close(fd)

    def pread(self, ino: int, idx: int, offset: int, size: int) -> bytes:
        """Bytes of an extent file; short at its end. FileNotFoundError if missing."""
        return os.pread(self._fd(ino, idx, False), size, offset)

    def read_cached(self, ino: int, idx: int, offset: int, out) -> int:
        """Fill `out` from the page cache only (RWF_NOWAIT): bytes read, maybe fewer
        than asked (not cached, or the file ends). FileNotFoundError if missing."""
        fd = self._fd(ino, idx, False)
        if self.nowait:
            try:
                return os.preadv(fd, [out], offset, os.RWF_NOWAIT)
            except BlockingIOError:
                return 0
            except OSError as e:
                if e.errno != errno.EOPNOTSUPP:
                    raise
                self.nowait = False  # overlayfs, tmpfs: plain inline reads from now on
        return os.preadv(fd, [out], offset)

    def read_whole_cached(self, ino: int, idx: int, limit: int) -> bytes | None:
        """The first `limit` bytes of an extent file (all of it if shorter), only if
        the page cache holds every one of them (RWF_NOWAIT); None otherwise.
        FileNotFoundError if missing."""
        if not self.nowait:
            return None
        fd = self._fd(ino, idx, False)
        want = min(limit, os.fstat(fd).st_size)
        buf = bytearray(want)
        try:
            got = os.preadv(fd, [buf], 0, os.RWF_NOWAIT) if want else 0
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno != errno.EOPNOTSUPP:
                raise
            self.nowait = False
            return None
        return bytes(buf) if got == want else None

    def will_need(self, ino: int, idx: int, length: int = 0) -> None:
        """Start reading an extent file (its first `length` bytes; 0: all) into the
        page cache (asynchronously)."""
        try:
            os.posix_fadvise(self._fd(ino, idx, False), 0, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # missing or unsupported: the read itself will tell

    @staticmethod
    def read_into(fd: int, offset: int, out) -> None:
        """Blocking read into `out` (a worker thread's part); closes the fd."""
        try:
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:]], offset + done)
                if n == 0:
                    break  # end of the extent file: the rest is a hole (zeros)
                done += n
        finally:
            os.close(fd)

    def pwrite(self, ino: int, idx: int, offset: int, data: bytes) -> None:
        try:
            fd = self._fd(ino, idx, True)  # a new extent's file: ENOSPC, EMFILE...
            written = os.pwrite(fd, data, offset)
        except OSError as e:
            raise FsError(e.errno or errno.EIO, f"hot tier write failed: {e}") from None
        if written != len(data):
            raise FsError(errno.ENOSPC, "short write on the hot tier")

    def truncate(self, ino: int, idx: int, length: int) -> None:
        os.ftruncate(self._fd(ino, idx, True), length)

    def open_private(self, ino: int, idx: int, flags: int) -> int:
        """A descriptor of an extent file of its own (for a direct writer), never the
        cached one; O_CREAT in `flags` creates the file."""
        return _open_in_place(self.path(ino, idx), flags | os.O_CLOEXEC)

    def exists(self, ino: int, idx: int) -> bool:
        """Whether an extent file is there (or open here: a descriptor keeps it)."""
        return (ino, idx) in self._fds or os.path.exists(self.path(ino, idx))

    def file_size(self, ino: int, idx: int) -> int | None:
        """Bytes in an extent file (a local metadata call); None if it is missing."""
        try:
            return os.stat(self.path(ino, idx)).st_size
        except FileNotFoundError:
            return None

    def remove(self, ino: int, idx: int) -> None:
        """Take an extent file out of its place (a rename: the place is free for a
        new copy at once); the trash empties it."""
        try:
            self.trash.take(self.path(ino, idx), self._fds.pop((ino, idx), None))
        except FileNotFoundError:
            pass

    def remove_later(self, ino: int, idx: int, size: int) -> None:
        """Remove the extent file of an inode that is gone (inode numbers are never
        reused, so nothing takes its place), all of it in the trash's thread."""
        self.trash.take_later(self.path(ino, idx), size, self._fds.pop((ino, idx), None))

    def _recycle(self, path: str) -> None:
        """The trash's part: make the file a spare, or unlink it (blocking)."""
        if not self._make_spare(path):
            os.unlink(path)

    def _make_spare(self, path: str) -> bool:
        """Empty the file at `path` and move it among the spares, if nobody else has it
        open (a write lease is refused while any other descriptor is open, also one in
        another process or behind an mmap). False: unlink it instead."""
        if not self.leases or len(self._spares) >= MAX_SPARES:
            return False
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EBUSY):
                    self.leases = False  # leases off (fs.leases-enable) or unsupported
                return False
            # Holding the lease: an open by anyone else now waits for its release.
            os.ftruncate(fd, 0)
            name = f"{self._spare_prefix}-{next(self._spare_ids)}"
            os.rename(path, os.path.join(self.spare_dir, name))
        finally:
            os.close(fd)  # and the lease with it
        # Only now may a fetch take it: its open would otherwise break our own lease.
        self._spares.append(name)
        return True

    def dup_fd(self, ino: int, idx: int) -> int | None:
        """A private fd for a worker thread (the cache may close its own at any time)."""
        try:
            return os.dup(self._fd(ino, idx, False))
        except FileNotFoundError:
            return None

    # ---- blocking helpers: run these in worker threads --------------------------
    def write_temp(self, ino: int, idx: int, data: bytes, tmp: str | None = None) -> str:
        """Write a complete extent to a temp file (blocking); install_temp() or
        discard_temp() it afterwards. The temp file is `tmp` (a name _temp_name gave)
        or a spare where it lies, if there is one (no rename until the install), else a
        new file beside the extent's place. Temp files never collide: two fetches of one
        extent may overlap (one for a stale record). A full disk is tried again once the
        trash has emptied what it holds."""
        try:
            return self._write_temp(ino, idx, data, tmp)
        except OSError as e:
            if e.errno != errno.ENOSPC or not self.trash.waiting:
                raise
        self.trash.settle(trash_module.WAIT)
        return self._write_temp(ino, idx, data, tmp)

    def write_temps(self, items: list[tuple[int, int, bytes]]) -> list[str]:
        """write_temp() of many extents [(ino, idx, data)] (blocking), in the copy
        writer processes where they can: a run of fetched neighbours. All or none: on
        an error, the temp files written are removed."""
        temps = [self._temp_name(ino, idx) for ino, idx, _data in items]
        if self.copy_writers.write([(tmp, data) for tmp, (_i, _x, data) in zip(temps, items)]):
            return temps
        try:  # not done there: all of them here, into the same temp files
            for i, (ino, idx, data) in enumerate(items):
                temps[i] = self.write_temp(ino, idx, data, temps[i])
        except BaseException:
            self.discard_temps(temps)
            raise
        return temps

    def _temp_name(self, ino: int, idx: int) -> str:
        """A spare's path, or a new temp file's beside the extent's place."""
        try:
            return os.path.join(self.spare_dir, self._spares.pop())
        except IndexError:
            return f"{self.path(ino, idx)}.tmp{os.getpid()}-{next(self._temp_ids)}"

    def _write_temp(self, ino: int, idx: int, data: bytes, tmp: str | None = None) -> str:
        tmp = tmp or self._temp_name(ino, idx)
        try:  # its directory is there but for the first extent in it: no stat per extent
            fd = os.open(tmp, TEMP_FLAGS, 0o600)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            fd = os.open(tmp, TEMP_FLAGS, 0o600)
        try:
            with open(fd, "wb") as f:
                f.write(data)
                if os.fstat(fd).st_size > len(data):  # a spare someone else left non-empty
                    f.truncate(len(data))
        except BaseException:
            self.discard_temp(tmp)  # a full disk: no half-written file left behind
            raise
        return tmp

    def install_temp(self, tmp: str, ino: int, idx: int) -> None:
        """Rename a temp file into place (a metadata operation: fast enough inline)
        and drop the cached fd of whatever was there. The hot tier's subdirectory is
        made for the first extent in it."""
        path = self.path(ino, idx)
        try:
            os.replace(tmp, path)
        except FileNotFoundError:
            if not os.path.exists(tmp):
                raise
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(tmp, path)
        self._forget_fd(ino, idx)

    @staticmethod
    def discard_temp(tmp: str) -> None:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass

    @classmethod
    def discard_temps(cls, temps: list[str]) -> None:
        for tmp in temps:
            cls.discard_temp(tmp)

    def copy_matches(self, ino: int, idx: int, length: int, checksum: int) -> bool:
        """Whether an extent file holds the extent's `length` bytes (checksum.
        hot_copy_matches), read in pieces into this thread's buffer (blocking: worker
        threads). FileNotFoundError if it is missing.

        One large read of a file the page cache lacks fills the cache page by page, and
        every later read of those pages (tierfs.open, the mount) copies them at about
        half the speed of large folios; a fresh buffer of the extent's size costs a
        page fault per page. So the file is marked sequential and its first byte read
        alone (a read that small starts the kernel's readahead, which then reads into
        large folios as the pieces follow), and the pieces go to a buffer the thread
        keeps (README, Benchmark: "After a remount")."""
        check = HotCopyCheck(length, checksum)
        buf = _read_buffer()
        with open(open_copy(self.path(ino, idx), os.O_RDONLY | os.O_CLOEXEC), "rb",
                  buffering=0) as f:
            try:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass  # advice only
            n = f.readinto(buf[:1])
            while n:
                check.update(buf[:n])
                if check.seen > length:
                    break  # longer than the extent: no match, nothing more to read
                n = f.readinto(buf)
        return check.matches()

    @staticmethod
    def fsync_fd(fd: int) -> None:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.copy_writers.close()
        self.trash.close()
        while self._fds:
            _, fd = self._fds.popitem()
            os.close(fd)

    def scan(self):
        """(ino, idx, size, mtime) of every extent file on disk; removes stray temp files."""
        for sub in os.scandir(self.root):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                name = entry.name
                if ".tmp" in name:
                    os.unlink(entry.path)
                    continue
                try:
                    ino_s, idx_s = name.split(".")
                    st = entry.stat()
                    yield int(ino_s, 16), int(idx_s, 16), st.st_size, st.st_mtime
                except ValueError:
                    continue

    def disk_usage(self) -> os.statvfs_result:
        return os.statvfs(self.root)
