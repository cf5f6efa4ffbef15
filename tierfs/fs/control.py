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

from ..errors import ColdStoreError, FsError, TierfsError
from ..fs.ops import CONTROL_XATTR, STATE_XATTR
from ..meta import scan
from ..meta.schema import ROOT_INO
from ..tier import actions
from ..tier.checkpoint import Fenced

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
        def bucket_scan():
            cold = sum(x.obj_len for _i, _x, x in scan.extents(self.meta) if not x.hot)
            return cold, self.meta.gc_backlog()

        cold_bytes, (gc_objects, gc_bytes) = await self.scan_in_thread(bucket_scan)
        out = {"mountpoint": d.cfg.mountpoint, "pid": os.getpid(), "cold": d.cold.describe(),
               "cold_bytes": cold_bytes, "fenced_by": d.state.fenced_by,
               # Superseded objects not deleted yet: kept checkpoints may need them.
               "gc_backlog_objects": gc_objects, "gc_backlog_bytes": gc_bytes,
               "upload_error": d.uploader.last_error,
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
            timeout = float(req.get("timeout") or 0) or float("inf")
            failed = None
            with trio.move_on_after(timeout) as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._sync_progress, inos, reply)
                    try:
                        await self._sync_wait(inos)
                    except TierfsError as e:  # raised out of a nursery it would be a group
                        failed = e
                    nursery.cancel_scope.cancel()
            if failed is not None:
                raise failed
            if scope.cancelled_caught:
                left = self._dirty(inos)
                why = self.daemon.uploader.last_error
                raise TierfsError(f"timed out after {timeout:.0f}s: {left} bytes are not in the "
                                  f"bucket yet" + (f" (last bucket error: {why})" if why else "")
                                  + "; they keep uploading")
        else:
            self.daemon.uploader.urgent = (self.daemon.uploader.urgent or set()) | (inos or set())
            if inos is None:
                self.daemon.space.need_upload.set()
            self.daemon.uploader.kick()
        return {"dirty_bytes_before": before, "dirty_bytes": self.engine.index.dirty_bytes}

    def _dirty(self, inos) -> int:
        index = self.engine.index
        return sum(index.sizes.get(k, 0) for k in index.dirty if inos is None or k[0] in inos)

    async def _sync_wait(self, inos) -> None:
        await self._check_lease()
        while True:
            await self.daemon.uploader.flush(inos)
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

    async def _sync_progress(self, inos, reply) -> None:
        """Tell the waiting client what it waits for, once a second."""
        uploader = self.daemon.uploader
        try:
            while True:
                await trio.sleep(1.0)
                await reply({"progress": True, "dirty_bytes": self._dirty(inos),
                             "uploads_in_flight": len(uploader.in_flight),
                             "upload_error": uploader.last_error})
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away; the sync itself goes on to its end

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

