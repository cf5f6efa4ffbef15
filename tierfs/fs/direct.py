"""Direct reads: hand a client descriptors of a file's hot extent files, so that it
reads them with preadv and no FUSE round trip per request (client: tierfs/direct.py).

The control request `direct_open` names paths relative to the mount. The daemon
checks them as the kernel's `default_permissions` would for the peer's credentials
(SO_PEERCRED, SO_PEERGROUPS and the peer's effective capabilities), fetches cold
extents and verifies unverified hot copies through the engine, opens each hot
extent file O_RDONLY and sends the descriptors with the reply line that describes
them, in one sendmsg (SCM_RIGHTS).

Request:  {"cmd": "direct_open", "paths": ["ds/a.bin", ...], "max_fds": 1024,
           "first_extents": 16, "keep": true}
          {"cmd": "direct_open", "ino": N, "token": T, "first_extent": K, "last_extent": L}
          (first_extents: extents of each file in its first range, at most MAX_FDS;
          the second form: the next range of a file opened before, by its handle;
          "keep": the connection stays open for the client's next request)
Reply:    lines {"direct": [result, ...], "fds": n}, each sent with its n descriptors,
          then {"ok": true, "files": opened}. A result is one of
            {"i": k, "ino", "token", "size", "extent_size", "first", "last",
             "extents": [[index, "fd" | "mount"], ...], "more": bool}
              (extents of [first, last] not listed are holes; the descriptors of the
               "fd" entries come in order; "mount": read that extent through the mount)
            {"i": k, "errno": e, "error": "..."}
            {"i": k, "use_mount": "why"}   (the kernel must decide: plain open())
          or, for the whole request, {"ok": true, "use_mount": "why"}.
"""
from __future__ import annotations

import array
import errno
import hashlib
import hmac
import json
import logging
import os
import socket
import stat
import struct
import time
from collections import deque

import trio

from ..errors import FsError, TierfsError
from ..meta.schema import ROOT_INO

log = logging.getLogger(__name__)

MAX_PATHS = 256      # paths per request
MAX_FDS = 64         # descriptors per reply line (and extents per range of one file)
MAX_REQUEST_FDS = 4096
MAX_LINKS = 40       # symlinks followed per path, as the kernel (ELOOP beyond)
NAME_MAX = 255
MAY_EXEC, MAY_WRITE, MAY_READ = 1, 2, 4
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
FETCH_PARALLEL = 16  # cold extents of one request fetched at once


# ---- the kernel's permission rules (pure) ------------------------------------------------

class Creds:
    """Who asks: effective uid/gid and supplementary groups, as the socket's peer
    credentials give them. `caps`, the two capabilities that bypass file permission
    checks, is given only by tests: the daemon never learns a peer's. /proc shows
    the connector's capabilities in its own user namespace (full ones in a rootless
    container) and as they are now (after an exec of a setuid program), not those of
    whoever holds the socket. Where the mode bits refuse, the kernel decides."""
    __slots__ = ("uid", "gid", "groups", "caps")

    def __init__(self, uid: int, gid: int, groups=(), caps: int | None = None):
        self.uid, self.gid, self.groups = uid, gid, frozenset(groups)
        self.caps = caps

    @classmethod
    def of(cls, uid: int, gid: int, groups=(), caps: int | None = None) -> "Creds":
        return cls(uid, gid, groups, caps)

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups


class UseMount(Exception):
    """The daemon's check cannot stand in for the kernel's: open through the mount."""


def may(mode: int, uid: int, gid: int, creds: Creds, mask: int) -> bool:
    """The kernel's generic_permission() for an inode (mode, uid, gid): owner bits
    if the caller owns it, else group bits if it is in the group, else other bits;
    then CAP_DAC_READ_SEARCH (read, and search of directories) and CAP_DAC_OVERRIDE
    (everything on directories; read/write on files, execute only if some x bit is set).
    Where the bits refuse and capabilities could allow, and the caller's are not
    known, raises UseMount: the kernel weighs them."""
    if creds.uid == uid:
        bits = mode >> 6
    elif creds.in_group(gid):
        bits = mode >> 3
    else:
        bits = mode
    if mask & ~bits & 7 == 0:
        return True
    if not stat.S_ISDIR(mode) and mask & MAY_EXEC and not mode & 0o111:
        return False  # no capability executes a file without x bits
    if creds.caps is None:
        raise UseMount(f"the mode bits refuse uid {creds.uid}; the kernel decides "
                       "whether its capabilities allow")
    read_search = bool(creds.caps >> CAP_DAC_READ_SEARCH & 1)
    override = bool(creds.caps >> CAP_DAC_OVERRIDE & 1)
    if stat.S_ISDIR(mode):
        return override or (not mask & MAY_WRITE and read_search)
    return override or (mask == MAY_READ and read_search)


def may_follow(link, parent, creds: Creds) -> bool:
    """fs.protected_symlinks: in a sticky world-writable directory only links of the
    follower or of the directory's owner are followed."""
    if creds.uid == link.uid:
        return True
    if parent.mode & (stat.S_ISVTX | stat.S_IWOTH) != stat.S_ISVTX | stat.S_IWOTH:
        return True
    return parent.uid == link.uid


def resolve(meta, rel: str, creds: Creds, mountpoints=(), protected_symlinks: bool = False,
            dirs: dict | None = None):
    """The inode a path relative to the mount root names, walked as the kernel walks
    it for `creds`: search (x) permission on every directory before looking a name
    up in it, symlinks followed (at most MAX_LINKS; absolute targets only under one
    of `mountpoints`), read permission on the regular file at the end.
    Raises FsError (ENOENT, ENOTDIR, EACCES, ELOOP, EISDIR, ENAMETOOLONG) or UseMount
    (a symlink or '..' leading out of the mount, a file that is not regular).

    `dirs`, a dict kept by the caller for one batch of paths of one caller: where
    the walk of a path's directory part ended (and the symlinks it followed), so the
    files of one directory cost one walk of it, not one each."""
    head, sep, name = rel.rpartition("/")
    walk = (meta, creds, mountpoints, protected_symlinks)
    if dirs is not None and sep and name not in ("", ".", ".."):
        got = dirs.get(head)
        if got is None:
            cur, links, _must_dir = _walk(*walk, meta.get_inode(ROOT_INO), 0,
                                          deque(head.split("/")))
            got = dirs[head] = (cur, links)
        cur, links = got
        cur, _links, must_dir = _walk(*walk, cur, links, deque([name]))
    else:
        parts = deque(rel.split("/"))
        must_dir = _strip_trailing(parts)
        cur, _links, must_dir = _walk(*walk, meta.get_inode(ROOT_INO), 0, parts, must_dir)
    if stat.S_ISDIR(cur.mode):
        # open(2) of a directory for reading needs read permission; Python's open()
        # then says EISDIR.
        if not may(cur.mode, cur.uid, cur.gid, creds, MAY_READ):
            raise FsError(errno.EACCES)
        raise FsError(errno.EISDIR)
    if must_dir:
        raise FsError(errno.ENOTDIR)
    if not stat.S_ISREG(cur.mode):
        raise UseMount("not a regular file")
    if not may(cur.mode, cur.uid, cur.gid, creds, MAY_READ):
        raise FsError(errno.EACCES)
    return cur


def _walk(meta, creds: Creds, mountpoints, protected_symlinks: bool, cur, links: int,
          parts: deque, must_dir: bool = False):
    """Walk `parts` from the inode `cur`, `links` symlinks followed so far:
    (the inode reached, symlinks followed, whether it must be a directory)."""
    while parts:
        name = parts.popleft()
        if name == "":
            continue
        if not stat.S_ISDIR(cur.mode):
            raise FsError(errno.ENOTDIR)
        if not may(cur.mode, cur.uid, cur.gid, creds, MAY_EXEC):
            raise FsError(errno.EACCES)
        if name == ".":
            continue
        if name == "..":
            if cur.ino == ROOT_INO:
                raise UseMount("the path leads out of the mount")
            cur = meta.get_inode(cur.parent)
            continue
        raw = os.fsencode(name)
        if len(raw) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        child = meta.get_inode(meta.lookup(cur.ino, raw))
        if not stat.S_ISLNK(child.mode):
            cur = child
            continue
        links += 1
        if links > MAX_LINKS:
            raise FsError(errno.ELOOP)
        if protected_symlinks and not may_follow(child, cur, creds):
            raise FsError(errno.EACCES)
        target = os.fsdecode(meta.readlink(child.ino))
        if target.startswith("/"):
            inside = next((target[len(m):] for m in mountpoints
                           if target == m or target.startswith(m.rstrip("/") + "/")), None)
            if inside is None:
                raise UseMount("a symlink on the path leads out of the mount")
            target = inside
            cur = meta.get_inode(ROOT_INO)
        more = deque(target.split("/"))
        if not parts:
            must_dir = _strip_trailing(more) or must_dir
        parts.extendleft(reversed(more))
    return cur, links, must_dir


def _strip_trailing(parts: deque) -> bool:
    """Drop trailing empty components ('dir/'); True if there were any."""
    trailing = False
    while len(parts) > 1 and parts[-1] == "":
        parts.pop()
        trailing = True
    return trailing


# ---- the peer ----------------------------------------------------------------------------

def peer_credentials(sock) -> Creds:
    """Credentials of the process at the other end of a unix socket (as of its
    connect): uid/gid from SO_PEERCRED, groups from SO_PEERGROUPS."""
    _pid, uid, gid = struct.unpack("iII", sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII")))
    groups = array.array("I")
    for size in (256, 65536):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size * groups.itemsize)
        except OSError as e:
            if e.errno == errno.ERANGE:
                continue
            raise
        groups.frombytes(raw[:len(raw) - len(raw) % groups.itemsize])
        break
    return Creds(uid, gid, groups)


def _protected_symlinks() -> bool:
    try:
        with open("/proc/sys/fs/protected_symlinks") as f:
            return f.read().strip() != "0"
    except OSError:
        return True


# ---- the control command -----------------------------------------------------------------

# Files of a namespace shared by many nodes must be opened through the mount, whose
# open and close keep them consistent across nodes.
SHARED_NAMESPACE = ("the namespace is shared by many nodes (--meta-url): files open "
                    "through the mount, which keeps them consistent across nodes")


class DirectOpen:
    """The daemon's side of tierfs.open(): resolves, checks, makes extents hot and
    verified, and sends descriptors of their hot files."""

    ANCESTORS_TTL = 5.0  # seconds the mount point's parent directories' modes are kept

    def __init__(self, daemon):
        self.daemon = daemon
        self.engine = daemon.engine
        self.meta = daemon.meta
        self.stats = self.engine.stats
        cfg = daemon.cfg
        self.mountpoints = sorted({cfg.mountpoint, os.path.realpath(cfg.mountpoint)})
        options = daemon.fuse_options() if hasattr(daemon, "fuse_options") else set()
        self.allow_other = "allow_other" in options
        self.protected_symlinks = _protected_symlinks()
        self._secret = os.urandom(32)  # handles are good for this daemon's life only
        self._ancestors: tuple[float, list] = (0.0, [])

    # ---- request ------------------------------------------------------------------------
    async def cmd_direct_open(self, req, reply):
        if self.daemon.shared is not None:
            return {"use_mount": SHARED_NAMESPACE}
        if not self.daemon.cfg.default_permissions:
            return {"use_mount": "the mount runs with --no-default-permissions, so the "
                                 "daemon cannot check access the way the kernel does"}
        creds = reply.conn.get("creds")
        if creds is None:  # SO_PEERCRED is the connector's: the same for every request
            creds = reply.conn["creds"] = peer_credentials(reply.stream.socket)
        if not self.allow_other and (creds.uid, creds.gid) != (os.getuid(), os.getgid()):
            raise FsError(errno.EACCES, "the mount is not shared with other users "
                                        "(--no-allow-other)")
        outside = self._ancestor_problem(creds)
        if outside:
            return {"use_mount": outside}
        self.stats.inc("direct_requests")
        if "ino" in req:
            try:
                ino, first = int(req["ino"]), max(0, int(req["first_extent"]))
                last = int(req.get("last_extent", first + MAX_FDS - 1))
                if not 0 < ino < 1 << 64:  # what the metadata's keys hold
                    raise ValueError(ino)
            except (KeyError, TypeError, ValueError):
                raise TierfsError("direct_open of a handle needs ino, token and "
                                  "first_extent") from None
            return await self._continue(ino, str(req.get("token", "")), first, last, creds,
                                        reply)
        paths = req.get("paths")
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise TierfsError("direct_open needs a list of paths")
        if len(paths) > MAX_PATHS:
            raise TierfsError(f"direct_open takes at most {MAX_PATHS} paths per request")
        try:
            budget = max(0, min(int(req.get("max_fds", MAX_FDS)), MAX_REQUEST_FDS))
            first = max(1, min(int(req.get("first_extents", MAX_FDS)), MAX_FDS))
        except (TypeError, ValueError):
            raise TierfsError("direct_open: max_fds and first_extents are numbers") from None
        return await self._open_paths(paths, creds, budget, first, reply)

    def _ancestor_problem(self, creds: Creds) -> str | None:
        """The kernel checks the directories above the mount point too; where the peer
        may not search them, only the kernel knows what it may reach (its working
        directory may be inside), so it decides."""
        when, dirs = self._ancestors
        if time.monotonic() - when > self.ANCESTORS_TTL:
            dirs = []
            path = os.path.dirname(self.daemon.cfg.mountpoint)
            while True:
                try:
                    st = os.stat(path)
                    dirs.append((path, st.st_mode, st.st_uid, st.st_gid))
                except OSError:
                    pass
                if path == "/":
                    break
                path = os.path.dirname(path)
            self._ancestors = (time.monotonic(), dirs)
        for path, mode, uid, gid in dirs:
            try:
                if not may(mode, uid, gid, creds, MAY_EXEC):
                    return f"uid {creds.uid} may not search {path} above the mount point"
            except UseMount:
                return f"the mode bits refuse uid {creds.uid} a search of {path} above " \
                       "the mount point"
        return None

    def _token(self, ino: int, generation: int, uid: int) -> str:
        msg = f"{ino}:{generation}:{uid}".encode()
        # Keyed BLAKE2 is a MAC of its own, and cheaper per file than HMAC-SHA256.
        return hashlib.blake2b(msg, key=self._secret, digest_size=16).hexdigest()

    async def _open_paths(self, paths: list[str], creds: Creds, budget: int, first: int,
                          reply) -> dict:
        results: list[dict | None] = [None] * len(paths)
        ranges = {}  # position -> (inode, last extent of its first range)
        dirs: dict = {}  # the walks of this request's directories (no await among them)
        for i, rel in enumerate(paths):
            try:
                node = resolve(self.meta, rel, creds, self.mountpoints,
                               self.protected_symlinks, dirs)
            except FsError as e:
                results[i] = {"i": i, "errno": e.errno, "error": os.strerror(e.errno)}
                self.stats.inc("direct_errors")
                continue
            except UseMount as e:
                results[i] = {"i": i, "use_mount": str(e)}
                self.stats.inc("direct_use_mount")
                continue
            # Out of descriptors for this request: the client asks for the rest later.
            last = min(self._last_index(node.size), first - 1, budget - 1)
            budget -= last + 1
            ranges[i] = (node, last)
        # Cold and unverified extents of every first range, all at once: a batch of
        # cold small files costs one bucket round trip, not one per file.
        unready = await self._make_ready_all(
            [(node.ino, idx) for node, last in ranges.values() for idx in range(last + 1)])
        line = _Line(reply.stream)
        opened = 0
        try:
            for i in range(len(paths)):
                if results[i] is not None:
                    await line.add(results[i], [])
                    continue
                node, last = ranges[i]
                try:
                    result, fds = await self._range(node, 0, last, unready, creds)
                    opened += 1
                except FsError as e:  # unlinked and purged since it was resolved
                    result, fds = {"errno": e.errno, "error": os.strerror(e.errno)}, []
                result["i"] = i
                await line.add(result, fds)
            self.stats.inc("direct_open_files", opened)
            await line.flush(final={"ok": True, "files": opened})
            reply.finished = True
        finally:
            line.close()
        return {"files": opened}

    async def _continue(self, ino: int, token: str, first: int, last: int, creds: Creds,
                        reply) -> dict:
        """The next range of a file opened before: by inode, so a rename or unlink
        since does not matter; the handle proves the open was checked for this uid."""
        node = self.meta.get_inode(ino)  # ENOENT once it is gone
        expect = self._token(ino, node.generation, creds.uid)
        if not hmac.compare_digest(token.encode(errors="replace"), expect.encode()):
            raise FsError(errno.ESTALE, "stale or foreign file handle")
        last = min(last, first + MAX_FDS - 1, self._last_index(node.size))
        unready = await self._make_ready_all([(ino, idx) for idx in range(first, last + 1)])
        line = _Line(reply.stream)
        try:
            result, fds = await self._range(node, first, last, unready, creds)
            result["i"] = 0
            await line.add(result, fds)
            await line.flush(final={"ok": True, "files": 1})
            reply.finished = True
        finally:
            line.close()
        return {"files": 1}

    def _last_index(self, size: int) -> int:
        return (size - 1) // self.engine.E if size else -1

    # ---- extents ----------------------------------------------------------------------------
    def _record(self, ino: int, idx: int):
        return self.meta.get_extents(ino, idx, idx)[1].get(idx)

    def _ready(self, ino: int, idx: int, ext) -> bool:
        """Hot, and either dirty (ours, nothing to check) or not waiting for the check
        of a copy found at mount."""
        return not self.engine.needs_ready(ino, idx, ext)

    async def _make_ready_all(self, keys: list) -> set:
        """Fetch and verify, in parallel, the extents among `keys` that need it.
        Returns those that could not be made hot (bucket error, or a cache policy
        that serves them uncached): they are read through the mount."""
        todo = []
        for ino, indices in _by_inode(keys).items():
            try:  # one read of the records per file, not one per extent
                exts = self.meta.get_extents(ino, min(indices), max(indices))[1]
            except FsError:
                continue  # the file is gone: its range says so later
            todo += [(ino, idx) for idx in indices
                     if (ext := exts.get(idx)) is not None and not self._ready(ino, idx, ext)]
        unready: set = set()
        if not todo:
            return unready
        limiter = trio.CapacityLimiter(FETCH_PARALLEL)

        async def one(ino: int, idx: int) -> None:
            async with limiter:
                if not await self._make_ready(ino, idx):
                    unready.add((ino, idx))

        async with trio.open_nursery() as nursery:
            for ino, idx in todo:
                nursery.start_soon(one, ino, idx)
        return unready

    async def _make_ready(self, ino: int, idx: int) -> bool:
        """Verify an unverified hot copy as a read would (a bad one is dropped), and
        fetch a cold extent from the bucket. True if it is hot now (or a hole)."""
        engine = self.engine
        try:
            ext = self._record(ino, idx)
            if ext is not None and ext.hot and not self._ready(ino, idx, ext):
                # A small copy in the page cache is checked here, without a thread hop.
                if engine.verify_inline(ino, idx, ext) is not None:
                    return True
                if await engine.verify_hot_copy(ino, idx):
                    return True
                ext = self._record(ino, idx)
            if ext is not None and not ext.hot:
                await engine.fetch(ino, idx)
                self.stats.inc("direct_fetched_extents")
                ext = self._record(ino, idx)
        except FsError as e:  # logged by the engine; the mount gives the reader the error
            log.debug("direct open of inode %d extent %d: %s", ino, idx, e)
            return False
        return ext is None or ext.hot

    async def _range(self, node, first: int, last: int, unready: set, creds: Creds):
        """The answer for extents [first, last] of a file, with descriptors of its
        hot extent files."""
        E = self.engine.E
        ino = node.ino
        entries, fds = [], []
        nbytes = 0
        try:
            exts = self.meta.get_extents(ino, first, last)[1] if last >= first else {}
            stale = False  # records read before an await are not to be trusted
            for idx in range(first, last + 1):
                ext = self._record(ino, idx) if stale else exts.get(idx)
                if ext is None:
                    continue  # a hole
                got = self._open_hot(ino, idx) if self._ready(ino, idx, ext) else None
                if got is None:
                    stale = True
                    got = await self._slow(ino, idx, unready)
                if got is HOLE:
                    continue
                if got is MOUNT:
                    entries.append([idx, "mount"])
                    continue
                fds.append(got)
                entries.append([idx, "fd"])
                nbytes += min(E, node.size - idx * E)
                self.engine.index.touch((ino, idx))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self.stats.inc("direct_extents", len(fds))
        self.stats.inc("direct_bytes", nbytes)
        if len(entries) > len(fds):
            self.stats.inc("direct_mount_extents", len(entries) - len(fds))
        return ({"ino": ino, "token": self._token(ino, node.generation, creds.uid),
                 "size": node.size, "extent_size": E, "first": first, "last": last,
                 "extents": entries, "more": last < self._last_index(node.size)}, fds)

    async def _slow(self, ino: int, idx: int, unready: set):
        """An extent that was not ready, or whose hot file was missing: a descriptor,
        HOLE or MOUNT. Made ready once more (it was evicted or dropped since the fetch
        phase) unless that phase already failed on it."""
        for attempt in range(2):
            ext = self._record(ino, idx)
            if ext is None:
                return HOLE
            if self._ready(ino, idx, ext):
                # No await since the record: a missing file was lost behind our back,
                # and the mount's read path sorts that out (refetch, or EIO).
                fd = self._open_hot(ino, idx)
                return MOUNT if fd is None else fd
            if attempt or (ino, idx) in unready or not await self._make_ready(ino, idx):
                return MOUNT
        return MOUNT

    def _open_hot(self, ino: int, idx: int) -> int | None:
        """A private read-only descriptor of a hot extent file (never the hot store's
        cached O_RDWR one); None if the file is missing. A local metadata operation:
        inline, as the hot store opens its files."""
        try:
            return self.engine.hot.open_private(ino, idx, os.O_RDONLY)
        except FileNotFoundError:
            return None


HOLE, MOUNT = object(), object()  # what _slow() answers besides a descriptor


def _by_inode(keys: list) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for ino, idx in keys:
        out.setdefault(ino, []).append(idx)
    return out


class _Line:
    """Collects results into reply lines of at most MAX_FDS descriptors; each line
    goes out with its descriptors in one sendmsg, and the daemon's copies are closed
    right after. close() closes whatever was not sent."""

    def __init__(self, stream):
        self.stream = stream
        self.results: list[dict] = []
        self.fds: list[int] = []

    async def add(self, result: dict, fds: list[int]) -> None:
        if self.fds and len(self.fds) + len(fds) > MAX_FDS:
            try:
                await self.flush()
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
        self.results.append(result)
        self.fds += fds
        if len(self.results) >= MAX_PATHS:
            await self.flush()

    async def flush(self, final: dict | None = None) -> None:
        """Send what was collected; with `final`, the request's final line too, in the
        same sendmsg (the client wakes once)."""
        data = b""
        if self.results:
            data = json.dumps({"direct": self.results, "fds": len(self.fds)}).encode() + b"\n"
        if final is not None:
            data += json.dumps(final).encode() + b"\n"
        if not data:
            return
        try:
            anc = ([(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", self.fds))]
                   if self.fds else [])
            sent = await self.stream.sendmsg([data], anc)
            if sent < len(data):  # a stream socket may take part of it; the fds went along
                await self.stream.send_all(data[sent:])
        finally:
            self.close()

    def close(self) -> None:
        fds, self.fds, self.results = self.fds, [], []
        for fd in fds:
            os.close(fd)
