"""Control interface of a live mount.

Clients find the daemon through the virtual xattr `user.tierfs.control` on any
path of the mount (JSON: pid, cache dir, socket path), then talk JSON lines over
a unix socket in the cache dir: one request line, zero or more progress lines,
and a final line holding "ok" (true/false). The per-file extent state is also
readable as the xattr `user.tierfs.state`.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import stat
import struct
import time

import trio

from ..errors import ColdStoreError, FsError, TierfsError
from ..fs.control_conn import ControlConn
from ..fs.direct import DirectOpen
from ..fs.direct_write import DirectWrite
from ..fs.resolve import resolve_in_passes
from ..fs.ops import CONTROL_XATTR, STATE_XATTR
from ..meta import scan
from ..tier import actions
from ..tier.checkpoint import Fenced

log = logging.getLogger(__name__)

# Entries a `status DIR` walk visits at most (about a second per 100,000 files).
TREE_LIMIT = 1_000_000
# Bytes of one request line at most (256 direct_open paths of 4 KiB each fit).
MAX_REQUEST = 8 << 20
# Control connections open at once at most: any local user may connect, and each
# costs a descriptor that hot-tier reads and fetches need too (a loader keeps one
# per thread). One over the limit is closed at once, and the accept loop never ends
# on an error of accept(): a flood of connections costs the socket, not the mount.
MAX_CONNECTIONS = 4096
# Bytes of unfinished request lines the daemon holds for all connections together: any
# local user may connect, and MAX_CONNECTIONS lines of MAX_REQUEST each would be 32 GiB.
# A read that would pass it gets an error and the connection is closed.
MAX_BUFFERED = 256 << 20
ACCEPT_RETRY_S = 0.1
XATTR_SIZE_MAX = 65536  # the kernel's limit on one xattr value
# Files a quick action on many (release_many, unpin_many) handles between two turns
# of the event loop: a few milliseconds of work.
EACH_PASS = 64
MAX_LIST_NAME = 256  # characters of a hint list's name kept


class BadRequest(TierfsError):
    """A request line that is not JSON, or whose arguments are missing or of the
    wrong type: its answer says which (any local user may send one)."""


INO_LIMIT = 1 << 64  # inode numbers are unsigned 64-bit (the metadata keys hold no more)


def arg_ino(req: dict, name: str = "ino") -> int:
    """req[name] as an inode number; BadRequest where it is none."""
    value = req.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < INO_LIMIT:
        raise BadRequest(f'bad request: "{name}" must be an inode number, not {value!r:.40}')
    return value


def arg_inos(req: dict, name: str = "inos") -> list[int]:
    """req[name] as a list of inode numbers; BadRequest where it is none."""
    value = req.get(name)
    if not isinstance(value, list):
        raise BadRequest(f'bad request: "{name}" must be a list of inode numbers, '
                         f'not {value!r:.40}')
    return [arg_ino({name: v}, name) for v in value]


def arg_number(req: dict, name: str, default: float) -> float:
    """req[name], a number not below 0 (`default` where it is left out or null)."""
    value = req.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 <= value < float("inf")):  # JSON as Python reads it has Infinity, NaN
        raise BadRequest(f'bad request: "{name}" must be a number not below 0, '
                         f'not {value!r:.40}')
    return value


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process that connected (SO_PEERCRED)."""
    pid, _uid, _gid = struct.unpack("iII", sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII")))
    return pid


def _add_extent(out: dict, ext, length: int) -> None:
    """Count one extent of `length` logical bytes into hot/cold/dirty/pinned totals."""
    if ext.hot:
        out["hot"] += length
    else:
        out["cold"] += length
    if ext.dirty:
        out["dirty"] += length
    if ext.pinned:
        out["pinned"] += length


class TreeWalk:
    """Files, bytes and hot/cold/dirty/pinned bytes of everything below a directory,
    from the metadata. step() is blocking (run it in a worker thread) and does a
    slice of the walk; it stops for good after `limit` entries, saying so in
    out["complete"], so a huge tree costs a bounded time."""

    SLICE = 10_000  # entries per step

    def __init__(self, meta, extent_size: int, top: int, limit: int = TREE_LIMIT):
        self.meta, self.E = meta, extent_size
        self.out = {"files": 0, "directories": 0, "other": 0, "bytes": 0, "hot": 0,
                    "cold": 0, "dirty": 0, "pinned": 0, "complete": True,
                    "entries_limit": limit}
        self.limit = limit
        self.entries = 0
        self.seen = {top}     # hard links count once
        self.current = top    # the directory being listed, None once all are
        self.cookie = 0       # where its listing goes on
        self.dirs: list[int] = []  # still to list

    def step(self) -> bool:
        """Walk a slice; True once the walk is over."""
        meta, out, E = self.meta, self.out, self.E
        budget = self.SLICE
        while self.current is not None and budget > 0:
            if self.entries >= self.limit:
                out["complete"] = False
                return True
            batch = meta.readdir(self.current, self.cookie, min(1024, budget))
            if not batch:  # this directory is done (or was removed meanwhile)
                self.current = self.dirs.pop() if self.dirs else None
                self.cookie = 0
                continue
            self.cookie = batch[-1][0]
            budget -= len(batch)
            self.entries += len(batch)
            children = [c for _k, _n, c in batch if c not in self.seen]
            self.seen.update(children)
            for node in _existing_inodes(meta, children):
                if stat.S_ISDIR(node.mode):
                    out["directories"] += 1
                    self.dirs.append(node.ino)
                elif stat.S_ISREG(node.mode):
                    out["files"] += 1
                    out["bytes"] += node.size
                    try:
                        exts = meta.all_extents(node.ino)
                    except FsError:  # unlinked and purged while we walk
                        continue
                    for idx, ext in exts.items():
                        _add_extent(out, ext, min(E, max(0, node.size - idx * E)))
                else:
                    out["other"] += 1
        return self.current is None


def _existing_inodes(meta, inos: list[int]) -> list:
    """The inodes of `inos` that still exist (the walk races with unlinks)."""
    try:
        return meta.get_inodes(inos)
    except FsError:
        out = []
        for ino in inos:
            try:
                out.append(meta.get_inode(ino))
            except FsError:
                pass
        return out


class Reply:
    """Sends JSON lines on one control connection. `stream` is there for commands
    that need the socket itself (peer credentials, descriptors); one that sends the
    final line itself (along with its last data: a wakeup less) sets `finished`."""

    def __init__(self, stream: ControlConn, conn: dict | None = None):
        self.stream = stream
        self.conn = {} if conn is None else conn  # per connection, across its requests
        self.finished = False

    async def __call__(self, obj) -> None:
        await self.stream.send_all(json.dumps(obj).encode() + b"\n")


class Control:
    def __init__(self, daemon):
        self.daemon = daemon
        self.engine = daemon.engine
        self.meta = daemon.meta
        # A shared namespace: names live in the shared store, and a file this node has
        # not opened yet must be pulled into its own store before tiering commands.
        self.ns = daemon.shared or daemon.meta
        self.view = getattr(daemon, "view", None) if daemon.shared else None
        self.socket_path = os.path.join(daemon.cfg.cache_dir, "control.sock")
        self.connections = 0  # open control connections (MAX_CONNECTIONS)
        self.buffered = 0     # bytes of their unfinished request lines (MAX_BUFFERED)
        self._over_budget_logged = False
        self.commands = {"status": self.cmd_status, "ping": self.cmd_ping,
                         "sync": self.cmd_sync, "prefetch_many": self.cmd_prefetch_many,
                         "release": self.cmd_release, "release_many": self.cmd_release_many,
                         "unpin": self.cmd_unpin, "unpin_many": self.cmd_unpin_many,
                         "scrub": self.cmd_scrub,
                         "hint": self.cmd_hint}
        self.direct = DirectOpen(daemon)
        self.commands["direct_open"] = self.direct.cmd_direct_open
        self.direct_write = DirectWrite(daemon)
        self.commands["direct_write"] = self.direct_write.cmd_direct_write
        # Commands whose connection serves more requests.
        self.keep_alive = {"direct_open", "direct_write"}

    # ---- virtual xattrs ------------------------------------------------------------
    def info(self) -> dict:
        """What a client needs to reach this daemon."""
        return {"pid": os.getpid(), "cache_dir": self.daemon.cfg.cache_dir,
                "socket": self.socket_path, "mountpoint": self.daemon.cfg.mountpoint}

    def virtual_xattr(self, ino: int, name: bytes) -> bytes | None:
        if name == CONTROL_XATTR:
            return json.dumps(self.info()).encode()
        if name == STATE_XATTR:
            state = self.file_state(ino)
            raw = json.dumps(state, sort_keys=True).encode()
            if len(raw) > XATTR_SIZE_MAX:
                # The kernel takes no larger value (E2BIG): the totals, and where the
                # list of extents is to be had.
                state["extents_omitted"] = len(state.pop("extents"))
                state["extents_hint"] = "tierfs status PATH --json lists them"
                raw = json.dumps(state, sort_keys=True).encode()
            return raw
        return None

    def file_state(self, ino: int) -> dict:
        node = self.meta.get_inode(ino)
        E = self.engine.E
        out = {"size": node.size, "extent_size": E, "hot": 0, "cold": 0, "dirty": 0,
               "pinned": 0, "extents": []}
        for idx, ext in sorted(self.meta.all_extents(ino).items()):
            where = "hot+cold" if ext.hot and ext.obj_id and not ext.dirty else (
                "hot" if ext.hot else "cold")
            out["extents"].append({"index": idx, "where": where, "dirty": ext.dirty,
                                   "pinned": ext.pinned})
            _add_extent(out, ext, min(E, max(0, node.size - idx * E)))
        return out

    # ---- commands ---------------------------------------------------------------------
    async def cmd_ping(self, req, reply):
        return {"pid": os.getpid()}

    async def cmd_status(self, req, reply):
        d = self.daemon
        out = {"mountpoint": d.cfg.mountpoint, "pid": os.getpid(), "cold": d.cold.describe(),
               "cache_dir": d.cfg.cache_dir, "extent_size": self.engine.E,
               "fenced_by": d.state.fenced_by}
        # A file or a directory gets its own figures only: the whole-mount ones cost a
        # scan of every extent and answer another question.
        if req.get("ino"):
            ino = arg_ino(req)
            await self.pull([ino])
            out["file"] = self.file_state(ino)
            return out
        if req.get("dir_ino"):
            top = arg_ino(req, "dir_ino")
            limit = int(arg_number(req, "limit", 0)) or TREE_LIMIT
            walk = TreeWalk(self.ns, self.engine.E, top, limit)
            # In slices, each its own worker-thread hop: between them the map may grow
            # and the trio thread is never kept waiting on a long walk.
            while not await self.scan_in_thread(walk.step):
                pass
            out["directory"] = walk.out
            return out
        index = self.engine.index
        st = self.engine.stats.snapshot()
        hot_b, cold_b = st.get("hot_read_bytes", 0), st.get("miss_read_bytes", 0)
        oldest = min((i.last_write for i in index.dirty.values()), default=None)

        def bucket_scan():
            cold = sum(x.obj_len for _i, _x, x in scan.extents(self.meta) if not x.hot)
            packs = [p for _id, p in scan.packs(self.meta)]
            return cold, self.meta.gc_backlog(), packs

        cold_bytes, (gc_objects, gc_bytes), packs = await self.scan_in_thread(bucket_scan)
        out.update({
            "cold_bytes": cold_bytes,
            # Objects holding small files; bytes of files deleted or rewritten since
            # stay in them until the whole pack is dead.
            "packs": len(packs), "pack_bytes": sum(p.total for p in packs),
            "pack_live_bytes": sum(p.live for p in packs),
            # Superseded objects not deleted yet: kept checkpoints may need them.
            "gc_backlog_objects": gc_objects, "gc_backlog_bytes": gc_bytes,
            "upload_error": d.uploader.last_error,
            "hot_bytes": index.total, "dirty_bytes": index.dirty_bytes,
            "hot_extents": len(index.sizes), "dirty_extents": len(index.dirty),
            # Fetched extents are installed after their reader has the bytes.
            "fetches_in_flight": self.engine.fetches_in_flight,
            "pinned_bytes": sum(index.sizes.get(k, 0) for k in index.pinned),
            # Dropped hot copies whose files the trash's thread has yet to empty.
            "trash_files": self.engine.hot.trash.waiting,
            "trash_bytes": self.engine.hot.trash.pending_bytes,
            "cache_limit": d.space.high, "cache_policy": d.space.policy,
            # Where the limit comes from (flag, or the disk's share), when Space says.
            "cache_limit_note": getattr(d.space, "limit_note", None),
            "upload_backlog_bytes": index.dirty_bytes,
            "upload_backlog_age_s": round(time.monotonic() - oldest, 3) if oldest else 0,
            **self._upload_slots(),
            "hit_rate": round(hot_b / (hot_b + cold_b), 4) if hot_b + cold_b else None,
            "counters": st,
            "fuse_ops": {label: h.count for (name, label), h in
                         list(self.engine.stats.histograms.items())
                         if name == "fuse_op_seconds"}})
        return out

    def _upload_slots(self) -> dict:
        """Uploads running now (holding one of the --upload-parallel slots) and extents
        handed to the uploader that wait for a slot: its in_flight set holds both."""
        up = self.daemon.uploader
        running = int(up.limit.borrowed_tokens)
        return {"uploads_running": running, "upload_slots": int(up.limit.total_tokens),
                "uploads_queued": max(0, len(up.in_flight) - running)}

    async def scan_in_thread(self, fn):
        """A whole-database read off the event loop."""
        with self.ns.reading_in_thread(), self.meta.reading_in_thread():
            return await trio.to_thread.run_sync(fn)

    async def pull(self, inos) -> None:
        """Shared namespace: bring files into this node's own store (as open does)."""
        if self.view is None:
            return
        for ino in inos:
            try:
                await self.view.pull(ino)
            except FsError:
                pass  # gone, or its data unreachable: the command reports it per file

    async def cmd_sync(self, req, reply):
        inos = set(arg_inos(req)) if req.get("inos") is not None else None
        before = self.engine.index.dirty_bytes
        total = self._dirty(inos)  # what this sync waits for, for the client's progress
        if req.get("wait"):
            timeout = float(arg_number(req, "timeout", 0)) or float("inf")
            failed = None
            with trio.move_on_after(timeout) as scope:
                async with trio.open_nursery() as nursery:
                    # Progress lines from the start: a client that hears nothing for
                    # long takes the daemon for stopped or stuck.
                    nursery.start_soon(self._sync_progress, inos, total, reply)
                    try:
                        await self.engine.sync_all()
                        await self._sync_wait(inos)
                    except TierfsError as e:  # raised out of a nursery it would be a group
                        failed = e
                    nursery.cancel_scope.cancel()
            if failed is not None:
                raise failed
            if scope.cancelled_caught:
                left = self._dirty(inos)
                why = self.daemon.uploader.last_error
                held = sum(1 for k in self.engine.index.held if inos is None or k[0] in inos)
                raise TierfsError(f"timed out after {timeout:.0f}s: {left} bytes are not in the "
                                  f"bucket yet" + (f" (last bucket error: {why})" if why else "")
                                  + (f"; {held} extents of them are open for direct writing "
                                     f"(tierfs.open) and upload once their writer closes them"
                                     if held else "")
                                  + "; they keep uploading")
        else:
            await self.engine.sync_all()
            if inos is None:
                self.daemon.space.need_upload.set()
            else:
                for ino in inos:
                    self.daemon.uploader.hurry(ino)
            self.daemon.uploader.kick()
        return {"dirty_bytes_before": before, "dirty_bytes": self.engine.index.dirty_bytes}

    def _dirty(self, inos) -> int:
        return self.engine.index.dirty_bytes_of(inos)

    async def _sync_wait(self, inos) -> None:
        await self._check_lease()
        while True:
            try:
                await self.daemon.uploader.flush(inos)
            except Fenced:
                raise TierfsError(self.fenced_message()) from None
            try:
                await self.daemon.checkpointer.checkpoint()  # the namespace too
                break
            except Fenced:
                raise TierfsError(self.fenced_message()) from None
            except ColdStoreError as e:
                log.info("checkpoint for sync failed (%s); retrying", e)
                await trio.sleep(1.0)
        await self._check_lease()  # nobody took over while we uploaded

    async def _check_lease(self) -> None:
        """A durability answer needs the filesystem to be ours: read the lease now
        (through bucket trouble, until the caller's timeout)."""
        lease = self.daemon.lease
        while True:
            try:
                mine = await trio.to_thread.run_sync(lease.still_mine, abandon_on_cancel=True)
                break
            except ColdStoreError:
                await trio.sleep(1.0)
        if not mine:
            raise TierfsError(self.fenced_message())

    def fenced_message(self) -> str:
        return (f"this mount was fenced: {self.daemon.state.fenced_by} took the filesystem "
                f"over, and nothing written here since reaches the bucket; unmount it")

    async def _sync_progress(self, inos, total: int, reply) -> None:
        """Tell the waiting client what it waits for, twice a second."""
        uploader = self.daemon.uploader
        try:
            while True:
                await trio.sleep(0.5)
                await reply({"progress": True, "dirty_bytes": self._dirty(inos),
                             "total_bytes": total, **self._upload_slots(),
                             "upload_error": uploader.last_error})
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away; the sync itself goes on to its end

    async def cmd_prefetch_many(self, req, reply):
        """Prefetch (and with "pin", pin) many files in one request, so that files
        packed together come in one GET (actions.prefetch_many). Per file: its
        result, or {"error": ...}."""
        inos = arg_inos(req)
        parallel = int(arg_number(req, "parallel", 8))
        await self.pull(inos)
        results = await self._fetching(inos, req, reply, actions.prefetch_many(
            self.engine, inos, parallel, pin=bool(req.get("pin"))))
        files = {}
        for ino, res in results.items():
            if isinstance(res, Exception):
                files[str(ino)] = {"error": str(res) or type(res).__name__}
                continue
            files[str(ino)] = res
        return {"files": files}

    async def cmd_release(self, req, reply):
        return actions.release(self.engine, arg_ino(req))

    async def cmd_release_many(self, req, reply):
        """release of many files in one request: `tierfs release -r` of a data set
        costs one connection per BATCH_FILES files, not one per file."""
        return {"files": await self._each(arg_inos(req),
                                          lambda ino: actions.release(self.engine, ino))}

    async def _each(self, inos: list[int], action) -> dict:
        """{ino: action(ino), or {"error": ...}} of a quick action on many files, the
        event loop let go every EACH_PASS files."""
        files = {}
        for n, ino in enumerate(inos, 1):
            try:
                files[str(ino)] = action(ino)
            except FsError as e:
                files[str(ino)] = {"error": os.strerror(e.errno)}
            except TierfsError as e:
                files[str(ino)] = {"error": str(e) or type(e).__name__}
            if n % EACH_PASS == 0:
                await trio.lowlevel.checkpoint()
        return files

    async def _fetching(self, inos: list[int], req, reply, work):
        """Await a prefetch; with req["progress"], tell the client how many bytes of
        the files are hot while it runs (one large file would otherwise show nothing)."""
        if not req.get("progress"):
            return await work
        failed = result = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._fetch_progress, inos, reply)
            try:
                result = await work
            except Exception as e:  # raised out of a nursery it would be a group
                failed = e
            nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed
        return result

    async def _fetch_progress(self, inos: list[int], reply) -> None:
        last = None
        try:
            while True:
                await trio.sleep(0.25)
                hot = 0
                for ino in inos:
                    try:
                        hot += actions.hot_bytes(self.engine, ino)
                    except FsError:
                        pass  # removed meanwhile
                if hot != last:
                    last = hot
                    await reply({"progress": True, "hot_bytes": hot})
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away; the prefetch goes on to its end

    async def cmd_hint(self, req, reply):
        paths = req.get("paths", [])
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise BadRequest('bad request: "paths" must be a list of paths')
        found = await resolve_in_passes(self.ns, paths,
                                        call=self.view.call if self.view else None)
        inos = [ino for ino in found if ino is not None]
        await self.pull(inos)
        # Each client its own list (the sending process, and the name it gives one:
        # a sampler), so the ranks of a job do not replace each other's lists.
        client = (peer_pid(reply.stream.socket), str(req.get("list", ""))[:MAX_LIST_NAME])
        queued = self.daemon.hints.add(inos, bool(req.get("replace")), client)
        return {"queued": queued, "unknown": len(found) - len(inos),
                "dropped": len(inos) - queued}

    async def cmd_scrub(self, req, reply):
        ino = arg_ino(req)
        await self.pull([ino])
        return await actions.scrub(self.engine, ino)

    async def cmd_unpin(self, req, reply):
        ino = arg_ino(req)
        await self.pull([ino])
        return {"unpinned": actions.set_pinned(self.engine, ino, False)}

    async def cmd_unpin_many(self, req, reply):
        inos = arg_inos(req)
        await self.pull(inos)
        return {"files": await self._each(
            inos, lambda ino: {"unpinned": actions.set_pinned(self.engine, ino, False)})}

    # ---- server ------------------------------------------------------------------------
    async def serve(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(path)
        # Any local user may ask: file access stays kernel-checked, and direct opens
        # are checked by the daemon as the kernel would, on the peer's credentials.
        os.chmod(path, 0o666)
        sock.listen(64)
        refused = False  # logged once for each run of refusals
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    conn, _ = await sock.accept()
                except OSError as e:  # EMFILE, ENFILE, ENOMEM: out of descriptors
                    if not refused:
                        log.warning("control socket: accepting a connection failed (%s); "
                                    "%d are open", e, self.connections)
                    refused = True
                    await trio.sleep(ACCEPT_RETRY_S)
                    continue
                if self.connections >= MAX_CONNECTIONS:
                    conn.close()
                    if not refused:
                        log.warning("control socket: %d connections are open; closing new "
                                    "ones until some end", self.connections)
                    refused = True
                    continue
                refused = False
                self.connections += 1
                stream = ControlConn(socket.socket(fileno=conn.detach()))
                nursery.start_soon(self._handle, stream)

    async def _refuse_over_budget(self, stream: ControlConn) -> None:
        if not self._over_budget_logged:
            log.warning("control socket: %d MiB of unfinished requests are held; refusing "
                        "more until they end", MAX_BUFFERED >> 20)
            self._over_budget_logged = True
        await Reply(stream)({"ok": False, "error": "the daemon holds too many unfinished "
                             "requests; try again"})

    async def _handle(self, stream: ControlConn) -> None:
        # What commands keep about the connection: the peer's credentials, and what to
        # do when it ends ("on_close": async functions of conn).
        conn: dict = {}
        buf = bytearray()
        counted = 0  # of len(buf), in self.buffered

        def count() -> None:
            nonlocal counted
            self.buffered += len(buf) - counted
            counted = len(buf)
        try:
            try:
                while True:
                    # A hint list's request runs to megabytes: look for the end of the
                    # line only in what each read adds.
                    end = buf.find(b"\n")
                    while end < 0:
                        if len(buf) > MAX_REQUEST:
                            await Reply(stream)({"ok": False, "error": "request too long"})
                            return
                        if self.buffered + 65536 > MAX_BUFFERED:
                            await self._refuse_over_budget(stream)
                            return
                        chunk = await stream.receive_some(65536)
                        if not chunk:
                            return
                        searched = len(buf)
                        buf += chunk
                        count()
                        end = buf.find(b"\n", searched)
                    line = bytes(buf[:end])
                    del buf[:end + 1]
                    count()
                    reply = Reply(stream, conn)
                    try:
                        req = json.loads(line)
                    except (ValueError, RecursionError):  # RecursionError: nested too deep
                        await reply({"ok": False, "error": "bad request: a request is one "
                                     "line of JSON"})
                        return
                    if not isinstance(req, dict):
                        await reply({"ok": False, "error": "a request is a JSON object"})
                        return
                    cmd = req.get("cmd")
                    handler = self.commands.get(cmd)
                    if handler is None:
                        await reply({"ok": False, "error": f"unknown command {cmd!r}"})
                        return
                    self.engine.stats.inc(f"control_requests:{cmd}")
                    try:
                        result = await handler(req, reply)
                        if not reply.finished:
                            await reply({"ok": True, **(result or {})})
                    except FsError as e:
                        await reply({"ok": False, "error": os.strerror(e.errno), "errno": e.errno})
                    except TierfsError as e:
                        await reply({"ok": False, "error": str(e)})
                    # A loader opening file after file keeps its connection: no
                    # accept and no new task per file.
                    if not (req.get("keep") and cmd in self.keep_alive):
                        return
            finally:
                self.buffered -= counted
                if self.buffered < MAX_BUFFERED // 2:
                    self._over_budget_logged = False  # the next flood is logged again
                stream.close()
        except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError) as e:
            log.debug("control connection dropped: %s", e)
        except Exception:
            log.exception("control request failed")
        finally:
            self.connections -= 1
            for hook in conn.get("on_close", ()):
                with trio.CancelScope(shield=True):
                    try:
                        await hook(conn)
                    except Exception:
                        log.exception("cleaning up after a control connection failed")
