"""One writer per filesystem: a lease object in the bucket, renewed by the daemon.

The lease names its holder (node id, host, pid, cache dir, mount point) and an
expiry time. A mount is refused while another node holds an unexpired lease;
--force takes it over (for a node known to be dead). The same node (same cache
dir) may always take its own lease back, e.g. after kill -9. A daemon whose
lease was taken over is fenced (NodeState): it refuses changes, uploads and
deletes nothing, and says so. It notices at its next renewal (every ttl/3), and
at once before `sync --wait` reports success.

Unmounting leaves the lease in the bucket marked released, so the next mount
knows which node wrote the filesystem last: a cache dir whose metadata another
node has changed since is stale and must not be mounted (attach refuses it).

Every write of the lease is conditional on the version read just before it
(If-Match / If-None-Match in S3): a node never overwrites a lease another node
wrote in between. Two nodes taking a free lease at the same moment: one wins, the
other reads again and is refused. A renewal that loses to a takeover: the renewing
node is fenced at once. A store without conditional writes gets plain writes (and
a warning): the old read-then-write, where both could win.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid

import trio

from ..errors import (ColdStoreError, ConditionalWritesUnsupported, ObjectNotFound,
                      PreconditionFailed, UserError)
from .state import NodeState

log = logging.getLogger(__name__)

LEASE_KEY = "lease.json"
TRIES = 3  # reads and conditional writes of the lease before giving up for now
# A lease whose expiry passed less than this long ago by this node's clock may belong
# to a live holder whose clock runs behind: it is watched for a renewal first.
CLOCKS_MAY_DIFFER_S = 3600.0
WATCH_POLL_S = 1.0  # how often a watched lease is read again
# Where the node-id was made: a copy of the cache dir (cp -a, rsync, a cloned VM) carries
# the node-id along, and must not pass for the original, which may still write.
PLACE_FILE = "node-id.place"
MACHINE_ID = "/sys/class/dmi/id/product_uuid"


def node_id(cache_dir: str) -> str:
    """A stable identity of this cache dir (a node's local state)."""
    path = os.path.join(cache_dir, "node-id")
    try:
        with open(path) as f:
            ident = f.read().strip()
    except FileNotFoundError:
        ident = ""
    if not ident:
        # None yet, or left empty by a power cut (older releases did not sync it): an
        # empty identity would write a lease naming no holder, which others take as free.
        ident = str(uuid.uuid4())
        _record_place(cache_dir)
        _write_durably(path, ident + "\n")
        return ident
    if not os.path.exists(os.path.join(cache_dir, PLACE_FILE)):
        _record_place(cache_dir)  # a node-id made before places were recorded: its own
    return ident


def _place(cache_dir: str) -> dict:
    """Where this cache dir is: its directory's inode (stable across reboots and a mv
    within its filesystem, new for a copy) and the machine's hardware id (new for a
    cloned VM)."""
    return {"dir_inode": os.stat(cache_dir).st_ino, "machine": _machine_id()}


def _machine_id() -> str | None:
    """The machine's DMI UUID: kept across reboots and by a container image upgrade,
    unlike /etc/machine-id, which a container has from its image."""
    try:
        with open(MACHINE_ID) as f:
            return f.read().strip() or None
    except OSError:
        return None  # not readable (not root) or none (no DMI): the inode alone tells


def _record_place(cache_dir: str) -> None:
    _write_durably(os.path.join(cache_dir, PLACE_FILE), json.dumps(_place(cache_dir)))


def _write_durably(path: str, text: str) -> None:
    """Write, sync and rename into place, then sync the directory: the file and its
    entry survive a power cut whole, or not at all."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def refuse_a_copy(cache_dir: str) -> None:
    """UserError if this cache dir's node-id was made in another directory or on another
    machine: it is a copy, and would hold the lease as the original holds it."""
    path = os.path.join(cache_dir, PLACE_FILE)
    try:
        with open(path) as f:
            made = json.load(f)
    except FileNotFoundError:
        return  # node_id() records it: a cache dir of an older release is its own
    except ValueError:
        made = {}  # damaged: taken as unknown
    if not isinstance(made, dict):
        made = {}
    here = _place(cache_dir)
    if made.get("dir_inode") not in (None, here["dir_inode"]):
        where = "in another directory"
    elif None not in (made.get("machine"), here["machine"]) and made["machine"] != here["machine"]:
        where = "on another machine"
    else:
        return
    raise UserError(f"cache dir {cache_dir} is a copy of another node's cache dir (its node-id "
                    f"was made {where}), which may still write this filesystem: use an empty "
                    f"--cache-dir; if the original is gone for good (moved here, not copied), "
                    f"delete {path}")


class Lease:
    def __init__(self, cold, cache_dir: str, mountpoint: str, ttl: float = 60.0,
                 state: NodeState | None = None, clock=time.time):
        self.cold = cold
        self.ttl = ttl
        self.clock = clock  # this node's wall clock (the lease's times are the holder's)
        self.watch_poll = WATCH_POLL_S
        self.cache_dir = cache_dir
        self.me = {"node": node_id(cache_dir), "host": socket.gethostname(), "pid": os.getpid(),
                   "cache_dir": cache_dir, "mountpoint": mountpoint}
        self.state = state or NodeState()
        self.previous: dict | None = None  # the lease found at acquire (maybe released)
        self._plain_writes = False  # the store refused a conditional write once
        self.released = False  # by release(): renew() writes nothing any more

    @property
    def fenced(self) -> bool:
        return self.state.fenced

    @staticmethod
    def describe(lease: dict) -> str:
        return (f"{lease.get('host')} (pid {lease.get('pid')}, cache dir {lease.get('cache_dir')}, "
                f"mount point {lease.get('mountpoint')})")

    def last_writer_elsewhere(self) -> bool:
        """Did another node hold the filesystem after this cache dir last did?"""
        return bool(self.previous) and self.previous.get("node") != self.me["node"]

    def read(self) -> dict | None:
        return self._read_versioned()[0]

    def _read_versioned(self) -> tuple[dict | None, str | None]:
        """(the lease or None, the version of the object or None if missing)."""
        try:
            data, version = self.cold.get_versioned(LEASE_KEY)
        except ObjectNotFound:
            return None, None
        try:
            lease = json.loads(data)
        except ValueError:
            lease = None
        if not isinstance(lease, dict) or not lease.get("node"):
            # A damaged lease protects nothing: every check treats it as no lease
            # (one that is valid JSON but names no holder as well).
            log.warning("the writer lease in %s is damaged (it names no holder): "
                        "taken as free", self.cold.describe())
            return None, version
        return lease, version

    def _body(self) -> bytes:
        now = self.clock()
        return json.dumps({**self.me, "renewed": now, "renew_every": self.ttl / 3,
                           "expires": now + self.ttl}).encode()

    def _put(self, body: bytes, version: str | None) -> bool:
        """Write the lease in place of `version` (None: there was none). False if
        another write came between the read of `version` and this one."""
        if self._plain_writes:
            self.cold.put(LEASE_KEY, body)
            return True
        try:
            self.cold.put_if(LEASE_KEY, body, version)
            return True
        except PreconditionFailed:
            # A retried write whose first try landed finds its own lease there.
            try:
                return self.cold.get_versioned(LEASE_KEY)[0] == body
            except ObjectNotFound:
                return False
        except ConditionalWritesUnsupported as e:
            log.warning("%s: the writer lease is read, then written, so two nodes "
                        "starting at the same moment could both take it", e)
            self._plain_writes = True
            self.cold.put(LEASE_KEY, body)
            return True

    def acquire(self, force: bool = False) -> str | None:
        """Take the lease (blocking). Returns a note if a lease was taken over."""
        refuse_a_copy(self.cache_dir)  # even with --force: the copy's metadata may be stale
        for _try in range(TRIES):
            cur, version = self._read_versioned()
            self.previous = cur
            note = None
            if cur and cur.get("node") != self.me["node"] and not cur.get("released"):
                left = cur.get("expires", 0) - self.clock()
                if left > 0 and not force:
                    raise UserError(self._refusal(cur, left))
                if not force and -left < CLOCKS_MAY_DIFFER_S and self._renewed_while_watched(
                        cur, version):
                    continue  # renewed (its clock is behind this one's) or released
                note = f"took over the lease of {self.describe(cur)}"
            if self._put(self._body(), version):
                return note
        raise UserError(f"the writer lease of {self.cold.describe()} changed {TRIES} times "
                        f"while this node took it: another node is mounting it at this "
                        f"moment; try again")

    def _renewed_while_watched(self, cur: dict, version: str | None) -> bool:
        """Its expiry passed by this node's clock, yet a live holder whose clock runs
        behind would still renew it: read it again for two of its renewal periods.
        True if it changed meanwhile (read it anew); raises UserError if another node
        renewed it. False: it lapsed for sure, and `version` is still the one there."""
        every = float(cur.get("renew_every", self.ttl / 3))
        log.warning("the writer lease of %s lapsed by this node's clock: making sure it is "
                    "no longer renewed, for up to %.0fs (--force skips this)",
                    self.describe(cur), 2 * every)
        deadline = time.monotonic() + 2 * every
        while time.monotonic() < deadline:
            time.sleep(min(self.watch_poll, max(0.0, deadline - time.monotonic())))
            now, now_version = self._read_versioned()
            if now_version == version:
                continue
            if now and now.get("node") == cur.get("node") and not now.get("released"):
                raise UserError(
                    f"{self.cold.describe()} is mounted read-write by {self.describe(now)}, "
                    f"which still renews its lease although its expiry time has passed by "
                    f"this node's clock: the two nodes' clocks disagree; set them right "
                    f"(NTP), or add --force if that node is dead after all")
            return True
        return False

    def _refusal(self, cur: dict, left: float) -> str:
        """Why a live lease keeps this node out. A holder that is alive renews the
        lease long before it lapses, so the lapse time only matters for a dead one."""
        every = cur.get("renew_every", self.ttl / 3)
        renewed = self.clock() - cur.get("renewed", cur.get("expires", 0) - self.ttl)
        return (f"{self.cold.describe()} is mounted read-write by {self.describe(cur)}, "
                f"which renewed its lease {max(renewed, 0):.0f}s ago (it renews every "
                f"{every:.0f}s while alive): unmount it there; if that node is dead, its "
                f"lease lapses in {left:.0f}s, or add --force to take over now")

    def still_mine(self) -> bool:
        """Read the lease (blocking); fence this node if another one holds it."""
        if self.fenced:
            return False
        return not self._fenced_by(self.read())

    def _fenced_by(self, cur: dict | None) -> bool:
        """Fence this node if the lease `cur` is another node's; True if so."""
        if cur and cur.get("node") != self.me["node"]:
            self.state.fence(self.describe(cur))
            return True
        return False

    def renew(self) -> bool:
        """Write the lease renewed in place of the version read (blocking); fence this
        node if another one holds it, or wrote it between that read and this write."""
        for _try in range(TRIES):
            if self.fenced or self.released:
                return False  # released: a renewal left behind at unmount writes nothing
            cur, version = self._read_versioned()
            if self._fenced_by(cur):
                return False
            if self._put(self._body(), version):
                return True
        log.warning("the writer lease changed %d times while this node renewed it; "
                    "will retry", TRIES)
        return True

    async def run(self) -> None:
        """Renew the lease every ttl/3; fence this daemon if another node took it."""
        while not self.fenced:
            await trio.sleep(self.ttl / 3)
            try:
                # Abandoned if cancelled (unmount): a bucket that never answers must not
                # keep the daemon from exiting; the lease then simply lapses.
                await trio.to_thread.run_sync(self.renew, abandon_on_cancel=True)
            except ColdStoreError as e:
                log.warning("lease renewal failed (%s); will retry", e)

    def _mine_or_free(self) -> tuple[bool, str | None]:
        """(whether no other node holds the lease now, the version read)."""
        cur, version = self._read_versioned()
        return cur is None or cur.get("node") == self.me["node"], version

    def abandon(self) -> None:
        """A mount refused after acquire: put back what was there (blocking), unless
        another node wrote the lease since."""
        try:
            mine, version = self._mine_or_free()
            if not mine:
                return
            if self.previous is None:
                self.cold.delete(LEASE_KEY)
            else:
                self._put(json.dumps(self.previous).encode(), version)
        except ColdStoreError as e:
            log.warning("could not give the lease back: %s", e)

    def release(self) -> None:
        """Mark the lease released (kept as the record of the last writer)."""
        self.released = True
        if self.fenced:
            return
        try:
            mine, version = self._mine_or_free()
            if mine:
                self._put(json.dumps({**self.me, "expires": 0, "released": True}).encode(),
                          version)
        except ColdStoreError as e:
            log.warning("could not release the lease: %s", e)
