"""Direct reads of hot data: `tierfs.open(path, "rb")`, a drop-in for `open()`.

    import tierfs
    with tierfs.open("/mnt/tierfs/ds/shard-0001.tar", "rb") as f:
        header = f.read(512)

The daemon checks the path for the caller's credentials as the kernel would, makes
the file's extents hot (fetching cold ones, verifying hot copies not yet verified
since mount) and sends descriptors of the hot extent files over its control socket;
reads are then preadv() calls on those descriptors, with no FUSE round trip and no
daemon work per read. Holes and the tail of a short extent file read as zeros, up to
the size the file had when it was opened.

Anything the direct path does not cover falls back to the builtin `open()`, logged
once per reason (never an error): another mode than "rb", a path outside a tierfs
mount, a daemon that cannot be reached or does not offer direct reads, a mount run
with --no-default-permissions, special files. Errors the daemon finds (no such file,
permission denied, a directory) raise what `open()` raises. A daemon that takes the
request and answers neither it nor a ping (stopped, stuck) raises TimeoutError
(ETIMEDOUT) within ANSWER_CHECK_S + PING_WAIT_S: open() would wait on the same daemon.

`fileno()` opens the file on the mount and returns that descriptor (mmap and
np.memmap need one); what is read through it comes through the mount, while the
object's own reads stay direct.
"""
from __future__ import annotations

import array
import errno
import io
import json
import logging
import os
import resource
import socket
import stat
import threading
import time
from dataclasses import dataclass, field

from . import client, mount_file, read_pool
from .client import answers_ping, daemon_info, not_answering_text
from .mount_table import TABLE
from .hot import pagecache
from .errors import UserError

log = logging.getLogger(__name__)

BUFFER_SIZE = 128 * 1024   # as open() on the mount buffers (the mount's st_blksize)
MAX_PATHS = 256            # per request, as the daemon takes them
RANGE = 64                 # extents the daemon hands out per file and request
FIRST_RANGE = 16           # extents of a file in the answer to its open (the rest: ranges)
ASK_AHEAD = 16             # a sequential reader this many extents from a range's end asks for the next
SIZE_RECHECK = 1.0         # s: a reader at the end asks the daemon whether the file grew, at most this often
SKIP_AHEAD = 64 << 10      # a forward gap up to this between two reads is still sequential
# open() reads a file smaller than this through the mount: its open, getattr and read
# requests cost the daemon less than a control round trip, and the kernel caches its
# pages (README, Fast path: "Reads"). open_many() batches stay direct at any size.
MOUNT_BELOW = 1 << 20
START_READS_BELOW = 1 << 20  # open_many starts the disk reads of files this small
NEGATIVE_TTL = 30.0        # seconds a "not a tierfs mount" or "use the mount" answer is kept
# An answer may take long (cold extents fetched first): as for control commands
# (client.py), one not here after ANSWER_CHECK_S pings the daemon, and a daemon that
# does not answer that within PING_WAIT_S (stopped, stuck) fails the call with ETIMEDOUT.
ANSWER_CHECK_S = client.ANSWER_CHECK_S
PING_WAIT_S = client.PING_WAIT_S
_ANC_SPACE = socket.CMSG_SPACE(253 * array.array("i").itemsize)  # the kernel's SCM_MAX_FD
_ZEROS = bytes(1 << 20)
_MODES = ("rb", "br")

_lock = threading.Lock()
# st_dev -> (mount, valid until, TABLE.mounts_of(st_dev) then): a device number is only
# known while its mounts stay the same (numbers freed by an unmount are reused).
_mounts: dict[int, tuple["_Mount | None", float, tuple | None]] = {}
_noted: set[str] = set()


def _note(reason: str, level: int = logging.INFO) -> None:
    """Log why a file is opened with the builtin open(), once per reason."""
    with _lock:
        if reason in _noted:
            return
        _noted.add(reason)
    log.log(level, "tierfs.open: using the builtin open(): %s", reason)


class _Fallback(Exception):
    """The direct path is not available for a request: use open(). `level` for the log."""

    def __init__(self, reason: str, level: int = logging.WARNING, ttl: float | None = None,
                 unreachable: bool = False):
        super().__init__(reason)
        self.level = level
        self.ttl = ttl  # keep the answer for the mount this long (None: not at all)
        self.unreachable = unreachable  # the connect failed: the mount may be a new one


@dataclass(eq=False)
class _Mount:
    dev: int
    socket: str
    # (mount point as this process sees it, the directory of the filesystem mounted
    # there), longest first: bind mounts of a subdirectory have a root other than "/".
    roots: list[tuple[str, str]]
    off_until: float = 0.0
    off_reason: str = ""
    max_fds: int = field(default_factory=lambda: _fd_budget())

    def relative(self, path: str) -> str | None:
        """The path relative to the filesystem's root, or None if it is not below
        any of its mount points (by name, then with symlinks resolved). The daemon
        follows the symlinks inside the mount; '..' after a symlink means what the
        link's target says, so such paths are resolved here."""
        lexical = ".." not in path.split("/")
        for resolve in ((os.path.abspath, os.path.realpath) if lexical else (os.path.realpath,)):
            candidate = resolve(path)
            for point, root in self.roots:
                if candidate == point or candidate.startswith(point.rstrip("/") + "/"):
                    inner = candidate[len(point):].lstrip("/")
                    return os.path.join(root.lstrip("/"), inner).rstrip("/") or "."
        return None


def _fd_budget() -> int:
    """Descriptors one request may bring: a share of this process's limit."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(64, min(4096, soft // 4))


def _mount_of(path, dev: int) -> _Mount | None:
    """The tierfs mount a file is on (cached per device number), or None."""
    now = time.monotonic()
    # Kept while this filesystem's mounts stay as they were: mounts elsewhere (other
    # jobs' and containers') do not send every process to the daemon again.
    seen = TABLE.mounts_of(dev)
    hit = _mounts.get(dev)
    if hit is not None and hit[1] > now and hit[2] == seen:
        return hit[0]
    roots = TABLE.roots_of(dev)
    mount, until = None, now + NEGATIVE_TTL
    # The control xattr of a file needs read permission on it: ask the mount point
    # first (usually readable), then the file and the directories above it.
    probes = [point for point, _root in roots] + [path]
    parent = os.path.dirname(os.path.abspath(path))
    while parent not in probes and parent != "/":
        probes.append(parent)
        parent = os.path.dirname(parent)
    for probe in probes:
        try:
            if os.stat(probe).st_dev != dev:
                continue  # another filesystem mounted over it, or above the mount
            info = daemon_info(probe)
            mount = _Mount(dev, info["socket"], roots or [(info["mountpoint"], "/")])
            until = float("inf")  # a dead daemon shows as a failed connect: forget it then
            break
        except (UserError, OSError, ValueError, KeyError):
            continue
    with _lock:
        _mounts[dev] = (mount, until, seen)
    return mount


def _placer(paths: list):
    """placed(i): the tierfs mount paths[i] is on and the path inside it, told by name
    alone (mount_table.py, read once for all), if this process found that mount
    before (perhaps by the stat of an earlier path of the batch); None: stat it."""
    table, known = TABLE.place_all(paths), {}

    def placed(i: int) -> tuple[_Mount, str] | None:
        where = table[i]
        if where is None:
            return None
        mount = known.get(where[0])
        if mount is None:
            hit = _mounts.get(where[0])
            if (hit is None or hit[0] is None or hit[1] <= time.monotonic()
                    or hit[2] != TABLE.mounts_of(where[0])):
                return None
            mount = known[where[0]] = hit[0]
        return mount, where[1]
    return placed


def _forget(mount: _Mount) -> None:
    with _lock:
        for dev, (m, _until, _gen) in list(_mounts.items()):
            if m is mount:
                del _mounts[dev]


class _Conn:
    """A connection to a daemon kept by one thread of one process, for as long as
    that process keeps its credentials (the daemon checks those of the connector)."""

    def __init__(self, path: str):
        self.owner = _identity()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.connect(path)
        except BaseException:
            self.sock.close()
            raise


def _identity() -> tuple:
    return os.getpid(), os.geteuid(), os.getegid(), tuple(os.getgroups())


_local = threading.local()


def _exchange(mount: _Mount, req: dict) -> tuple[list[tuple[dict, list[int]]], dict]:
    """One request: (each "direct" line with its descriptors, the final line), on
    this thread's connection to the daemon; once more on a new connection if a kept
    one turns out to be closed."""
    conns = _local.__dict__.setdefault("conns", {})
    conn = conns.pop(mount.socket, None)
    if conn is not None and conn.owner != _identity():  # forked, or setuid since
        conn.sock.close()
        conn = None
    for attempt in range(2):
        fresh = conn is None
        if fresh:
            try:
                conn = _Conn(mount.socket)
            except OSError as e:
                _forget(mount)
                raise _Fallback(f"cannot reach the tierfs daemon at {mount.socket}: "
                                f"{e.strerror}", unreachable=True) from None
        try:
            out = _talk(conn.sock, {"cmd": "direct_open", "keep": True, **req})
        except TimeoutError:  # the daemon is stopped or stuck: a new connection waits too
            raise
        except (_Fallback, OSError):
            conn.sock.close()
            conn = None
            if fresh:
                raise
            continue  # the daemon closed the kept connection (restart, old version)
        except BaseException:  # interrupted mid-answer: the connection is out of step
            conn.sock.close()
            raise
        conns[mount.socket] = conn
        return out
    raise AssertionError("unreachable")


def _talk(sock: socket.socket, req: dict) -> tuple[list[tuple[dict, list[int]]], dict]:
    """Send one request, read its answer: each "direct" line with its descriptors,
    and the final line."""
    lines: list[tuple[dict, list[int]]] = []
    pending: list[int] = []  # received descriptors not yet matched to their line
    daemon = sock.getpeername()  # its control socket's path
    try:
        sock.settimeout(ANSWER_CHECK_S + PING_WAIT_S)  # a live daemon reads requests at once
        try:
            sock.sendall(json.dumps(req).encode() + b"\n")
        except TimeoutError:
            raise _not_answering(sock, daemon) from None
        sock.settimeout(ANSWER_CHECK_S)
        buf = bytearray()
        while True:
            # Close-on-exec, as open() makes its descriptors: a program it runs gets none.
            try:
                data, anc, flags, _addr = sock.recvmsg(1 << 16, _ANC_SPACE,
                                                       socket.MSG_CMSG_CLOEXEC)
            except TimeoutError:
                if answers_ping(daemon, PING_WAIT_S):
                    continue  # at work on the request
                raise _not_answering(sock, daemon) from None
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(cdata[:len(cdata) - len(cdata) % fds.itemsize])
                    pending.extend(fds)
            if flags & socket.MSG_CTRUNC:
                raise _Fallback("descriptors from the daemon were cut off "
                                "(too many open files?)")
            if not data:
                raise _Fallback("the tierfs daemon closed the connection without answering")
            buf += data
            while (end := buf.find(b"\n")) >= 0:
                obj = json.loads(buf[:end])
                del buf[:end + 1]
                if "direct" not in obj:
                    if buf or pending:
                        raise _Fallback("the tierfs daemon's answer did not end cleanly")
                    return lines, obj
                n = int(obj.get("fds", 0))
                if n > len(pending):
                    raise _Fallback("the tierfs daemon's answer lacks descriptors")
                lines.append((obj, pending[:n]))
                del pending[:n]
    except BaseException:
        for _obj, fds in lines:
            _close_all(fds)
        raise
    finally:
        _close_all(pending)


def _not_answering(sock: socket.socket, daemon: str) -> TimeoutError:
    """The error of a call whose daemon is stopped or stuck. The connection is
    closed: an answer coming later must not be taken for the next request's."""
    sock.close()
    return TimeoutError(errno.ETIMEDOUT, not_answering_text(daemon))


def _ask(mount: _Mount, req: dict) -> list[tuple[dict, list[int]]]:
    """Results (with descriptors) of one request; _Fallback where open() must serve."""
    if mount.off_until > time.monotonic():
        raise _Fallback(mount.off_reason, logging.INFO)
    lines, final = _exchange(mount, req)
    try:
        if final.get("ok"):
            if final.get("use_mount"):
                raise _Fallback(final["use_mount"], logging.INFO, ttl=NEGATIVE_TTL)
            return [pair for obj, fds in lines for pair in _split(obj, fds)]
        if final.get("errno"):
            raise OSError(final["errno"], final.get("error") or os.strerror(final["errno"]))
        why = str(final.get("error", "no reason given"))
        if why.startswith("unknown command"):
            raise _Fallback("the tierfs daemon does not offer direct reads (an older version)",
                            logging.INFO, ttl=float("inf"))
        raise _Fallback(f"the tierfs daemon refused direct reads: {why}")
    except BaseException as e:
        for _obj, fds in lines:
            _close_all(fds)
        if isinstance(e, _Fallback) and e.ttl is not None:
            mount.off_until, mount.off_reason = time.monotonic() + e.ttl, str(e)
        raise


def _split(obj: dict, fds: list[int]):
    """The results of one line, each with its share of the line's descriptors."""
    at = 0
    for res in obj["direct"]:
        n = sum(1 for _idx, kind in res.get("extents", ()) if kind == "fd")
        yield res, fds[at:at + n]
        at += n


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# ---- the file object ------------------------------------------------------------------------

class Positioned(io.RawIOBase):
    """What the direct file objects share: a position, a size as this object knows it,
    and a lock around both (seek, tell, SEEK_END)."""

    def __init__(self, size: int):
        super().__init__()
        self._size, self._pos = size, 0
        self._lock = threading.Lock()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        with self._lock:
            self._check_open()
            base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos,
                    io.SEEK_END: self._end()}.get(whence)
            if base is None:
                raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
            if base + offset < 0:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            self._pos = base + offset
            return self._pos

    def tell(self) -> int:
        self._check_open()
        return self._pos

    def _end(self) -> int:
        """The size of the file as this object knows it (the lock is held)."""
        return self._size

    def read(self, size: int = -1) -> bytes:
        """At most `size` bytes (the rest of the file if negative), read by the kernel
        straight into the bytes object returned, as FileIO.read does (see readall)."""
        if size is None or size < 0:
            return self.readall()
        return self._into_new_bytes(size)

    def readall(self) -> bytes:
        """The rest of the file, read by the kernel straight into the bytes object
        returned. RawIOBase fills a new bytearray instead, then copies it into bytes:
        a second copy, from a buffer that glibc starts 16 bytes into a page when it is
        large, where the kernel's copy from the page cache runs several times slower on
        some CPUs (README, Benchmark § Where a reader's buffer starts), and a fresh
        buffer touched page by page in user space (docs/architecture.md § Memory)."""
        return self._into_new_bytes(None)

    def _into_new_bytes(self, size: int | None) -> bytes:
        """`size` bytes (None: up to the end) read into a new bytes object."""
        # A BufferedReader's read(n) allocates the bytes object and hands readinto() a
        # view of it; with a buffer of one byte it reads exactly what was asked, nothing
        # ahead that detach() would drop.
        reader = io.BufferedReader(self, buffer_size=1)  # refuses a write-only one
        try:
            if size is None:
                with self._lock:
                    size = max(0, self._end() - self._pos)
            return reader.read(size) if size else b""
        finally:
            reader.detach()  # this object stays open; its position is past what was read

    def seekable(self) -> bool:
        self._check_open()
        return True

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")


class DirectFile(Positioned):
    """Raw reader over the hot extent files of one tierfs file. Extents come in
    ranges (FIRST_RANGE with the open, then up to RANGE); the next range is asked for
    when a read gets there, or ahead by a streaming reader (the daemon fetches cold
    extents then). A range the daemon cannot give is read through the mount."""

    def __init__(self, name, path: str, mount: _Mount, res: dict, fds: list[int],
                 mount_fd: int | None = None):
        super().__init__(int(res["size"]))
        self.name = name
        self.mode = "rb"
        self._path = os.path.abspath(path)  # for a mount descriptor opened later
        self._mount = mount
        self._ino, self._token = res["ino"], res["token"]
        self._E = int(res["extent_size"])
        self._last = (self._size - 1) // self._E if self._size else -1
        self._mount_fd = mount_fd
        self._window: dict[int, int | None] = {}  # extent -> descriptor, None: the mount
        self._lo, self._hi = 0, -1
        # Sequential readers: where the last read ended, the last extent whose disk
        # read was started, and how many extents ahead to start (doubling to 16).
        self._next_pos, self._advised, self._ahead = 0, 0, 1
        # The next range, asked for in the background by a sequential reader nearing
        # the end of the one held: (first extent, pid that asked, Future of the answer).
        self._next_range = None
        self._size_learned = time.monotonic()
        self._install(res, fds)

    def _end(self) -> int:
        self._grew()
        return self._size

    def _grew(self) -> bool:
        """Whether the file has grown past the size this object knows, asked of the
        daemon at most every SIZE_RECHECK seconds (the lock is held). The question is
        the range after the last extent known, which fetches nothing while the file
        has not grown. A last extent that was not full is asked for again when it has:
        its file handed out at open may have been replaced since, without the bytes
        appended to it."""
        now = time.monotonic()
        if now - self._size_learned < SIZE_RECHECK:
            return False
        self._size_learned = now
        old_size, first = self._size, self._last + 1
        got = self._range_from(first)
        if got is None or int(got[0]["size"]) <= old_size:
            if got is not None:
                _close_all(got[1])
            return False
        if old_size % self._E:
            _close_all(got[1])
            got = self._range_from(first - 1)
            if got is None:
                return False  # reads past the old end say so (EOF) until the next check
        res, fds = got
        self._size = int(res["size"])
        self._last = (self._size - 1) // self._E
        self._install(res, fds)
        return True

    def _range_from(self, first: int):
        """(result, descriptors) of the range of RANGE extents from `first`; None when
        the daemon cannot say (this object then goes on as it was)."""
        try:
            (res, fds), = _ask(self._mount, {"ino": self._ino, "token": self._token,
                                             "first_extent": first,
                                             "last_extent": first + RANGE - 1})
        except (_Fallback, OSError, ValueError) as e:
            log.debug("asking whether %s has grown: %s", self._path, e)
            return None
        if "ino" not in res:
            _close_all(fds)
            return None
        return res, fds

    def _install(self, res: dict, fds: list[int]) -> None:
        """Take a range from the daemon in place of the one held (whose descriptors close)."""
        old = [fd for fd in self._window.values() if fd is not None]
        window, it = {}, iter(fds)
        for idx, kind in res["extents"]:
            window[int(idx)] = next(it) if kind == "fd" else None
        self._window, self._lo, self._hi = window, int(res["first"]), int(res["last"])
        # From this extent on, a sequential reader asks for the next range ahead.
        self._ask_at = self._hi - ASK_AHEAD if self._hi < self._last else self._last + 1
        _close_all(old)

    def _range_request(self, idx: int) -> dict:
        last = min(self._last, idx + RANGE - 1)
        return {"ino": self._ino, "token": self._token, "first_extent": idx, "last_extent": last}

    def _ask_ahead(self) -> None:
        """Ask for the range after the one held while the reader reads on: the
        daemon checks and opens 64 extent files for its answer."""
        self._ask_at = self._last + 1
        first = self._hi + 1
        future = read_pool.in_background(_ask, self._mount, self._range_request(first))
        self._next_range = (first, os.getpid(), future)

    def _take_ahead(self, idx: int):
        """The range asked for ahead, if it starts at `idx`: (res, fds), else None.
        One that is not used has its descriptors closed once it comes."""
        pending, self._next_range = self._next_range, None
        if pending is None:
            return None
        first, pid, future = pending
        if pid != os.getpid():
            return None  # asked for by the parent of this (forked) process
        if first != idx:
            future.add_done_callback(_discard_range)
            return None
        try:
            answer = future.result()
        except (_Fallback, OSError, ValueError):
            return None  # asked again now, which reports the error as it comes
        if len(answer) != 1:
            _discard_range(future)
            return None
        return answer[0]

    def _load(self, idx: int) -> None:
        """Make extent `idx` part of the range held."""
        req = self._range_request(idx)
        last = req["last_extent"]
        try:
            got = self._take_ahead(idx)
            if got is None:
                (res, fds), = _ask(self._mount, req)
            else:
                res, fds = got
            if "ino" not in res:
                _close_all(fds)
                raise _Fallback(res.get("use_mount") or res.get("error") or "no extents")
            if int(res["last"]) < idx:  # the file shrank below it: zeros, as a hole
                res = {**res, "first": idx, "last": last}
            self._install(res, fds)
        except (_Fallback, OSError, ValueError) as e:
            level = e.level if isinstance(e, _Fallback) else logging.WARNING
            _note(f"the next extents of an open file: {e}", level)
            self._install({"extents": [[i, "mount"] for i in range(idx, last + 1)],
                           "first": idx, "last": last}, [])

    def _read_ahead(self, start: int, end: int) -> None:
        """A sequential reader entering an extent gets the kernel's readahead of the
        next ones started (_stream), as the daemon does for reads through the mount:
        a new extent file would otherwise start its readahead only when the reader
        gets there. A read across extents after a seek gets all of them read at once
        (_advise), its first one included."""
        first, idx = start // self._E, (end - 1) // self._E
        lo = first if idx > first else first + 1
        # A short skip forward is still a stream: torch.load's zip reader steps over
        # each record's header so, and the readahead under way covers the gap.
        sequential = self._next_pos <= start <= self._next_pos + SKIP_AHEAD
        self._next_pos = end
        if not sequential:  # a seek: nothing ahead, but one large read gets all it covers
            self._advise(lo, min(idx, self._hi))
            self._advised, self._ahead = idx, 1
            return
        # Ask ahead once the reader streams (it entered two extents in a row since
        # its last seek): not for a header read before a seek, as torch.load does.
        if idx >= self._ask_at and self._ahead >= 4:  # _ask_at is past the end once asked
            self._ask_ahead()
        if idx < self._advised:
            return
        self._stream(max(lo, self._advised + 1), min(idx + self._ahead, self._hi))
        self._advised = max(self._advised, min(idx + self._ahead, self._hi))
        self._ahead = min(self._ahead * 2, 16)

    def _uncached(self, lo: int, hi: int):
        """Descriptors of the extents lo..hi held that the page cache does not wholly
        hold: starting the read of a cached one costs more than reading it."""
        for j in range(lo, hi + 1):
            fd = self._window.get(j)
            if fd is not None and not self._cached(fd, min(self._E, self._size - j * self._E)):
                yield fd

    def _advise(self, lo: int, hi: int) -> None:
        """Read extents lo..hi from the disk in parallel, whole (POSIX_FADV_WILLNEED),
        for one large read that covers them all."""
        for fd in self._uncached(lo, hi):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass

    def _stream(self, lo: int, hi: int) -> None:
        """Start the kernel's own readahead of extents lo..hi for a sequential reader:
        mark each sequential and read its first byte. Not WILLNEED here: that reads
        into single pages, which the page cache serves to the next epoch more slowly
        than a file read by its own readahead (in large folios); the readahead
        started from the first byte ramps up as the reader comes (README, Benchmark:
        W2 read warm, tierfs.open)."""
        for fd in self._uncached(lo, hi):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                os.pread(fd, 1, 0)
            except OSError:
                pass

    @staticmethod
    def _cached(fd: int, length: int) -> bool:
        """Whether the page cache holds all of an extent file (False where the
        kernel cannot tell: every extent is advised then)."""
        return length > 0 and bool(pagecache.is_cached(fd, length))

    def _through_mount(self) -> int:
        if self._mount_fd is None:
            fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
            if not _names_inode(fd, self._ino):
                os.close(fd)  # reading on there would mix two files' bytes
                raise OSError(errno.ESTALE, "the file was replaced (renamed over or "
                              "unlinked) while it was read", self._path)
            self._mount_fd = fd
        return self._mount_fd

    # ---- io.RawIOBase ---------------------------------------------------------------------
    def readinto(self, b) -> int:
        with self._lock:
            self._check_open()
            view = memoryview(b).cast("B")
            n = max(0, min(len(view), self._size - self._pos))
            if not n and view and self._pos >= self._size and self._grew():
                n = min(len(view), self._size - self._pos)
            if not n:
                return 0  # the end (a whole-file reader's last call) or an empty buffer
            E = self._E
            pos = self._pos
            idx, off = divmod(pos, E)
            if (off + n <= E and pos == self._next_pos
                    and (idx < self._advised or idx == self._last)
                    and self._lo <= idx <= self._hi and idx < self._ask_at):
                # The common case, kept short (a cached 1 MiB read is a matter of
                # microseconds): a sequential read within one extent whose readahead is
                # already under way, or within the last one (a small file's only
                # one), which has nothing after it to read ahead.
                fd = self._window.get(idx)
                if fd is not None and os.preadv(fd, [view[:n]], off) == n:
                    self._pos = self._next_pos = pos + n
                    return n
                # A hole, the mount, or a short extent file: the general path (again).
            done = 0
            self._read_ahead(self._pos, self._pos + n)
            pieces = []  # (descriptor, out, offset) in the range held, read together
            while done < n:
                pos = self._pos + done
                idx, off = divmod(pos, E)
                chunk = min(n - done, E - off)
                out = view[done:done + chunk]
                if not self._lo <= idx <= self._hi:
                    self._read(pieces)  # before their descriptors close
                    pieces = []
                    self._load(idx)
                if idx not in self._window:
                    _zero(out)  # a hole
                elif self._window[idx] is None:
                    _zero(out[_pread(self._through_mount(), out, pos):])
                else:
                    pieces.append((self._window[idx], out, off))
                done += chunk
            self._read(pieces)
            self._pos += n
            return n

    @staticmethod
    def _read(pieces: list) -> None:
        """Read extent files (at once where a read covers several: read_pool)."""
        for (_fd, out, _off), got in zip(pieces, read_pool.read_all(pieces)):
            _zero(out[got:])  # the short tail of an extent file

    def readable(self) -> bool:
        self._check_open()
        return True

    def writable(self) -> bool:
        self._check_open()
        return False

    def fileno(self) -> int:
        """The file's descriptor on the mount (opened now, checked to be the file this
        object reads): mmap, np.memmap and np.fromfile read through the mount with it.
        This object's own reads stay direct."""
        with self._lock:
            self._check_open()
            return self._through_mount()

    def close(self) -> None:
        if not self.closed:
            with self._lock:
                _close_all([fd for fd in self._window.values() if fd is not None])
                self._window = {}
                pending, self._next_range = self._next_range, None
                if pending is not None and pending[1] == os.getpid():
                    pending[2].add_done_callback(_discard_range)
                if self._mount_fd is not None:
                    _close_all([self._mount_fd])
                    self._mount_fd = None
        super().close()

    def __repr__(self) -> str:
        return f"<tierfs.DirectFile name={self.name!r} size={self._size}>"


_pread = read_pool.pread_full


def _discard_range(future) -> None:
    """Close the descriptors of a range asked for ahead and never used."""
    if future.exception() is None:
        for _res, fds in future.result():
            _close_all(fds)


def _zero(out: memoryview) -> None:
    for at in range(0, len(out), len(_ZEROS)):
        piece = out[at:at + len(_ZEROS)]
        piece[:] = _ZEROS[:len(piece)]


# ---- opening ------------------------------------------------------------------------------------

def open(file, mode: str = "rb", buffering: int = -1, encoding=None, errors=None,
         newline=None, closefd: bool = True, opener=None):
    """open() for files on a tierfs mount, read and written straight on the hot tier.
    Binary modes: "rb" (tierfs/direct.py; a file below MOUNT_BELOW through the mount),
    "wb", "xb", "ab", "r+b", "w+b", "x+b", "a+b" (tierfs/direct_writer.py); anything else
    is the builtin open()."""
    from . import direct_writer
    if (isinstance(file, int) or encoding is not None or errors is not None
            or newline is not None or not closefd or opener is not None):
        return io.open(file, mode, buffering, encoding, errors, newline, closefd, opener)
    if direct_writer.write_mode(mode) is not None:
        return direct_writer.open_for_writing(file, mode, buffering)
    if mode not in _MODES:
        _note(f"mode {mode!r} (the direct path is for binary modes)")
        return io.open(file, mode, buffering, encoding, errors, newline, closefd, opener)
    return _open_all([file], buffering, MOUNT_BELOW)[0]


def open_many(files, buffering: int = -1) -> list:
    """tierfs.open(f, "rb") of every file, resolved by the daemon in as few requests
    as possible (one per 256 files): for loaders that know their next batch. Paths
    on a mount this process has used are placed by name, with no stat of each file
    (mount_table.py); the daemon then says what open() would raise. The first
    error raises, after closing the files already opened."""
    return _open_all(list(files), buffering, by_name=True)


def _open_all(files: list, buffering: int, mount_below: int = 0,
              by_name: bool = False) -> list:
    out: list = [None] * len(files)
    todo: dict[_Mount, list[tuple[int, str, object]]] = {}
    paths = [os.fspath(file) for file in files]
    # A batch, by name: the daemon says what open() would (no such file, a
    # directory...), and no stat costs a FUSE lookup for a name not cached.
    placed_of = _placer(paths) if by_name else None
    try:
        for i, file in enumerate(files):
            path = paths[i]
            placed = placed_of(i) if placed_of is not None else None
            if placed is not None:
                todo.setdefault(placed[0], []).append((i, placed[1], path))
                continue
            # What open() raises for a missing file or a closed path, raised here.
            if mount_file.available:  # type and size from the kernel's cache
                kind, dev, size = mount_file.kind_dev_size(path)
            else:
                st = os.stat(path)
                kind, dev, size = stat.S_IFMT(st.st_mode), st.st_dev, st.st_size
            if kind != stat.S_IFREG or size < mount_below:
                # Directories and devices: open() answers. Small files: faster so, and
                # on a tierfs mount without the getattr open() costs (mount_file.py).
                small = kind == stat.S_IFREG and mount_file.available
                out[i] = (mount_file.open_file(path, file, size, buffering, BUFFER_SIZE)
                          if small and _mount_of(path, dev) is not None else
                          io.open(path, "rb", buffering))
                continue
            mount = _mount_of(path, dev)
            rel = mount.relative(os.fsdecode(path)) if mount is not None else None
            if rel is None and mount is not None:  # mounted elsewhere since it was cached?
                _forget(mount)
                mount = _mount_of(path, dev)
                rel = mount.relative(os.fsdecode(path)) if mount is not None else None
            if rel is None:
                _note("not on a tierfs mount" if mount is None else
                      f"{os.fsdecode(path)} is not below the mount point seen here")
                out[i] = io.open(path, "rb", buffering)
                continue
            todo.setdefault(mount, []).append((i, rel, path))
        for mount, items in todo.items():
            for at in range(0, len(items), MAX_PATHS):
                _open_direct(mount, items[at:at + MAX_PATHS], buffering, out, batch=by_name)
        return out
    except BaseException:
        for f in out:
            if f is not None:
                f.close()
        raise


def _open_direct(mount: _Mount, items: list, buffering: int, out: list,
                 retry: bool = True, batch: bool = False) -> None:
    try:
        answers = _ask(mount, {"paths": [rel for _i, rel, _p in items],
                               "max_fds": mount.max_fds, "first_extents": FIRST_RANGE})
    except _Fallback as e:
        if e.unreachable and retry:
            # A device number cached for a mount that is gone may now be another
            # mount's: ask the file again who serves it, once.
            fresh = _mount_of(items[0][2], mount.dev)
            rels = [fresh.relative(os.fsdecode(p)) if fresh else None for _i, _r, p in items]
            if fresh is not None and fresh.socket != mount.socket and None not in rels:
                _open_direct(fresh, [(i, rel, p) for (i, _r, p), rel in zip(items, rels)],
                             buffering, out, retry=False, batch=batch)
                return
        _note(str(e), e.level)
        for i, _rel, path in items:
            out[i] = io.open(path, "rb", buffering)
        return
    except OSError as e:
        raise OSError(e.errno, e.strerror, os.fsdecode(items[0][2])) from None
    got = {int(res["i"]): (res, fds) for res, fds in answers}
    if batch:
        _start_reads(got.values())
    try:
        for k, (i, _rel, path) in enumerate(items):
            res, fds = got.pop(k, ({"use_mount": "no answer for this path"}, []))
            out[i] = _file(mount, path, res, fds, buffering)
    finally:
        for _res, fds in got.values():
            _close_all(fds)


def _start_reads(answers) -> None:
    """Start the disk reads of every small file of a batch at once
    (POSIX_FADV_WILLNEED): the reader then takes them one by one from the page cache,
    where each would otherwise wait for its own read."""
    for res, fds in answers:
        if len(fds) == 1 and 0 < res.get("size", 0) <= START_READS_BELOW:
            try:
                os.posix_fadvise(fds[0], 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass


def _names_inode(fd: int, ino) -> bool:
    """Whether a descriptor of the mount is of the inode the daemon resolved."""
    return os.fstat(fd).st_ino == int(ino)


def _file(mount: _Mount, path, res: dict, fds: list[int], buffering: int):
    if "errno" in res:
        _close_all(fds)
        raise OSError(int(res["errno"]), os.strerror(int(res["errno"])), path)
    if "ino" not in res:
        _close_all(fds)
        _note(str(res.get("use_mount", "the daemon said so")))
        return io.open(path, "rb", buffering)
    mount_fd = None
    try:
        # A file that needs the mount now, or whose later ranges may (it could be
        # renamed or unlinked meanwhile), holds a descriptor of it from the start.
        if res.get("more") or any(kind != "fd" for _idx, kind in res["extents"]):
            mount_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            if not _names_inode(mount_fd, res["ino"]):
                # Renamed over since the daemon resolved it: what the path names now
                # is another file, which a plain open reads whole.
                _close_all(fds + [mount_fd])
                _note(f"{path} was replaced while it was opened", logging.DEBUG)
                return io.open(path, "rb", buffering)
        raw = DirectFile(path, path, mount, res, fds, mount_fd)
    except BaseException:
        _close_all(fds + ([mount_fd] if mount_fd is not None else []))
        raise
    if buffering == 0:
        return raw
    return io.BufferedReader(raw, buffering if buffering > 1 else BUFFER_SIZE)
