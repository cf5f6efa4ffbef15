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
import time

import trio

from ..errors import FsError, TierfsError
from ..fs.ops import CONTROL_XATTR, STATE_XATTR
from ..meta import scan
from ..meta.schema import ROOT_INO
from ..tier import actions

log = logging.getLogger(__name__)


class Control:
    def __init__(self, daemon):
        self.daemon = daemon
        self.engine = daemon.engine
        self.meta = daemon.meta
        self.socket_path = os.path.join(daemon.cfg.cache_dir, "control.sock")
        self.commands = {"status": self.cmd_status, "ping": self.cmd_ping,
                         "sync": self.cmd_sync, "prefetch": self.cmd_prefetch,
                         "release": self.cmd_release, "pin": self.cmd_pin,
                         "unpin": self.cmd_unpin, "scrub": self.cmd_scrub,
                         "hint": self.cmd_hint}

    # ---- virtual xattrs ------------------------------------------------------------
    def info(self) -> dict:
        """What a client needs to reach this daemon."""
        return {"pid": os.getpid(), "cache_dir": self.daemon.cfg.cache_dir,
                "socket": self.socket_path, "mountpoint": self.daemon.cfg.mountpoint}

    def virtual_xattr(self, ino: int, name: bytes) -> bytes | None:
        if name == CONTROL_XATTR:
            return json.dumps(self.info()).encode()
        if name == STATE_XATTR:
            return json.dumps(self.file_state(ino), sort_keys=True).encode()
        return None

    def file_state(self, ino: int) -> dict:
        node = self.meta.get_inode(ino)
        extents = self.meta.all_extents(ino)
        E = self.engine.E
        out = {"size": node.size, "extent_size": E, "hot": 0, "cold": 0, "dirty": 0,
               "pinned": 0, "extents": []}
        for idx, ext in sorted(extents.items()):
            length = min(E, max(0, node.size - idx * E))
            where = "hot+cold" if ext.hot and ext.obj_id and not ext.dirty else (
                "hot" if ext.hot else "cold")
            out["extents"].append({"index": idx, "where": where, "dirty": ext.dirty,
                                   "pinned": ext.pinned})
            if ext.hot:
                out["hot"] += length
            else:
                out["cold"] += length
            if ext.dirty:
                out["dirty"] += length
            if ext.pinned:
                out["pinned"] += length
        return out

    # ---- commands ---------------------------------------------------------------------
    async def cmd_ping(self, req, reply):
        return {"pid": os.getpid()}

    async def cmd_status(self, req, reply):
        d = self.daemon
        index = self.engine.index
        st = self.engine.stats.snapshot()
        hot_b, cold_b = st.get("hot_read_bytes", 0), st.get("miss_read_bytes", 0)
        oldest = min((i.last_write for i in index.dirty.values()), default=None)
        cold_bytes = await self.scan_in_thread(
            lambda: sum(x.obj_len for _i, _x, x in scan.extents(self.meta) if not x.hot))
        out = {"mountpoint": d.cfg.mountpoint, "pid": os.getpid(), "cold": d.cold.describe(),
               "cold_bytes": cold_bytes,
               "cache_dir": d.cfg.cache_dir, "extent_size": self.engine.E,
               "hot_bytes": index.total, "dirty_bytes": index.dirty_bytes,
               "hot_extents": len(index.sizes), "dirty_extents": len(index.dirty),
               "pinned_bytes": sum(index.sizes.get(k, 0) for k in index.pinned),
               "cache_limit": d.space.high, "cache_policy": d.space.policy,
               "upload_backlog_bytes": index.dirty_bytes,
               "upload_backlog_age_s": round(time.monotonic() - oldest, 3) if oldest else 0,
               "uploads_in_flight": len(d.uploader.in_flight),
               "hit_rate": round(hot_b / (hot_b + cold_b), 4) if hot_b + cold_b else None,
               "counters": st,
               "fuse_ops": {label: h.count for (name, label), h in
                            list(self.engine.stats.histograms.items())
                            if name == "fuse_op_seconds"}}
        if req.get("ino"):
            out["file"] = self.file_state(int(req["ino"]))
        return out

    async def scan_in_thread(self, fn):
        """A whole-database read off the event loop (the map must not grow meanwhile)."""
        self.meta.thread_readers += 1
        try:
            return await trio.to_thread.run_sync(fn)
        finally:
            self.meta.thread_readers -= 1

    async def cmd_sync(self, req, reply):
        inos = set(req["inos"]) if req.get("inos") is not None else None
        before = self.engine.index.dirty_bytes
        await self.engine.sync_all()
        if req.get("wait"):
            await self.daemon.uploader.flush(inos)
            await self.daemon.checkpointer.checkpoint()  # the namespace too
        else:
            self.daemon.uploader.urgent = (self.daemon.uploader.urgent or set()) | (inos or set())
            if inos is None:
                self.daemon.space.need_upload.set()
            self.daemon.uploader.kick()
        return {"dirty_bytes_before": before, "dirty_bytes": self.engine.index.dirty_bytes}

    async def cmd_prefetch(self, req, reply):
        return await actions.prefetch(self.engine, int(req["ino"]), int(req.get("parallel", 8)))

    async def cmd_release(self, req, reply):
        return actions.release(self.engine, int(req["ino"]))

    async def cmd_pin(self, req, reply):
        ino = int(req["ino"])
        fetched = await actions.prefetch(self.engine, ino)
        return {"pinned": actions.set_pinned(self.engine, ino, True), **fetched}

    async def cmd_hint(self, req, reply):
        inos, unknown = [], 0
        for rel in req.get("paths", []):
            ino = self.resolve(rel)
            if ino is None:
                unknown += 1
            else:
                inos.append(ino)
        self.daemon.hints.add(inos, bool(req.get("replace")))
        return {"queued": len(inos), "unknown": unknown}

    def resolve(self, rel: str) -> int | None:
        """Inode of a path relative to the mount root (no symlinks followed)."""
        ino = ROOT_INO
        for part in rel.split("/"):
            if part in ("", "."):
                continue
            try:
                ino = self.meta.lookup(ino, part.encode())
            except FsError:
                return None
        return ino

    async def cmd_scrub(self, req, reply):
        return await actions.scrub(self.engine, int(req["ino"]))

    async def cmd_unpin(self, req, reply):
        return {"unpinned": actions.set_pinned(self.engine, int(req["ino"]), False)}

    # ---- server ------------------------------------------------------------------------
    async def serve(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(path)
        os.chmod(path, 0o666)  # any local user may ask; file access stays kernel-checked
        sock.listen(64)
        async with trio.open_nursery() as nursery:
            while True:
                conn, _ = await sock.accept()
                nursery.start_soon(self._handle, trio.SocketStream(conn))

    async def _handle(self, stream: trio.SocketStream) -> None:
        async def reply(obj):
            await stream.send_all(json.dumps(obj).encode() + b"\n")

        try:
            async with stream:
                buf = b""
                while b"\n" not in buf:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buf += chunk
                req = json.loads(buf.split(b"\n", 1)[0])
                handler = self.commands.get(req.get("cmd"))
                if handler is None:
                    await reply({"ok": False, "error": f"unknown command {req.get('cmd')!r}"})
                    return
                try:
                    result = await handler(req, reply)
                    await reply({"ok": True, **(result or {})})
                except FsError as e:
                    await reply({"ok": False, "error": os.strerror(e.errno), "errno": e.errno})
                except TierfsError as e:
                    await reply({"ok": False, "error": str(e)})
        except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError) as e:
            log.debug("control connection dropped: %s", e)
        except Exception:
            log.exception("control request failed")

