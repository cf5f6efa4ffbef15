"""One writer per filesystem: a lease object in the bucket, renewed by the daemon.

The lease names its holder (node id, host, pid, cache dir, mount point) and an
expiry time. A mount is refused while another node holds an unexpired lease;
--force takes it over (for a node known to be dead). The same node (same cache
dir) may always take its own lease back, e.g. after kill -9. A daemon whose
lease was taken over stops uploading (it is fenced) and says so in its log.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid

import trio

from ..errors import ColdStoreError, ObjectNotFound, UserError

log = logging.getLogger(__name__)

LEASE_KEY = "lease.json"


def node_id(cache_dir: str) -> str:
    """A stable identity of this cache dir (a node's local state)."""
    path = os.path.join(cache_dir, "node-id")
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        ident = str(uuid.uuid4())
        with open(path, "w") as f:
            f.write(ident + "\n")
        return ident


class Lease:
    def __init__(self, cold, cache_dir: str, mountpoint: str, ttl: float = 60.0):
        self.cold = cold
        self.ttl = ttl
        self.me = {"node": node_id(cache_dir), "host": socket.gethostname(), "pid": os.getpid(),
                   "cache_dir": cache_dir, "mountpoint": mountpoint}
        self.fenced = False

    def read(self) -> dict | None:
        try:
            return json.loads(self.cold.get(LEASE_KEY))
        except ObjectNotFound:
            return None
        except ValueError:
            return None  # a damaged lease protects nothing

    def _write(self) -> None:
        self.cold.put(LEASE_KEY, json.dumps({**self.me, "expires": time.time() + self.ttl}).encode())

    def acquire(self, force: bool = False) -> str | None:
        """Take the lease (blocking). Returns a note if a lease was taken over."""
        cur = self.read()
        note = None
        if cur and cur.get("node") != self.me["node"]:
            left = cur.get("expires", 0) - time.time()
            holder = (f"{cur.get('host')} (pid {cur.get('pid')}, cache dir {cur.get('cache_dir')}, "
                      f"mount point {cur.get('mountpoint')})")
            if left > 0 and not force:
                raise UserError(f"{self.cold.describe()} is mounted read-write by {holder} for "
                                f"another {left:.0f}s: unmount it there, or add --force if that "
                                f"node is dead")
            note = f"took over the lease of {holder}"
        self._write()
        return note

    async def run(self) -> None:
        """Renew the lease every ttl/3; fence this daemon if another node took it."""
        while not self.fenced:
            await trio.sleep(self.ttl / 3)
            try:
                cur = await trio.to_thread.run_sync(self.read)
                if cur and cur.get("node") != self.me["node"]:
                    self.fenced = True
                    log.error("the filesystem was taken over by %s (pid %s): this mount "
                              "stops uploading; unmount it", cur.get("host"), cur.get("pid"))
                    return
                await trio.to_thread.run_sync(self._write)
            except ColdStoreError as e:
                log.warning("lease renewal failed (%s); will retry", e)

    def release(self) -> None:
        if self.fenced:
            return
        try:
            cur = self.read()
            if cur and cur.get("node") == self.me["node"]:
                self.cold.delete(LEASE_KEY)
        except ColdStoreError as e:
            log.warning("could not release the lease: %s", e)
