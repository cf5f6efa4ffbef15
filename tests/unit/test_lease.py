"""The writer lease's writes are conditional on the version just read: another node's
write that lands between a read and a write wins, and the node that read is refused
or fenced. Over the in-memory store, with another node's write put in between."""
from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest
import trio

from tierfs.cold.faulty import FaultyStore
from tierfs.cold.memory import MemoryStore
from tierfs.cold.retry import RetryingStore
from tierfs.errors import ColdStoreError, ConditionalWritesUnsupported, UserError
from tierfs.tier import lease as lease_mod
from tierfs.tier.lease import LEASE_KEY, Lease
from tests.harness import wait_until


class Interleaved:
    """A store that runs `between` (once) right after the next read of the lease:
    another node's write landing between this node's read and its write."""

    def __init__(self, inner):
        self.inner = inner
        self.between = None

    def get_versioned(self, key):
        try:
            return self.inner.get_versioned(key)  # the lease, or ObjectNotFound
        finally:
            between, self.between = self.between, None
            if between is not None:
                between()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def holder(store) -> str:
    return json.loads(store.get(LEASE_KEY))["mountpoint"]


def node(store, tmp_path, name: str) -> Lease:
    (tmp_path / name).mkdir()
    return Lease(store, str(tmp_path / name), f"/mnt/{name}")


def test_a_renewal_never_overwrites_a_takeover(tmp_path):
    bucket = MemoryStore()
    seen_by_a = Interleaved(bucket)
    a, b = node(seen_by_a, tmp_path, "a"), node(bucket, tmp_path, "b")
    assert a.acquire() is None
    seen_by_a.between = lambda: b.acquire(force=True)  # b takes over as a renews
    assert a.renew() is False
    assert a.fenced and holder(bucket) == "/mnt/b"
    assert b.renew() is True and not b.fenced       # b stays the writer
    assert holder(bucket) == "/mnt/b"


def test_two_nodes_taking_a_free_lease_at_once_one_wins(tmp_path):
    bucket = MemoryStore()
    seen_by_a = Interleaved(bucket)
    a, b = node(seen_by_a, tmp_path, "a"), node(bucket, tmp_path, "b")
    seen_by_a.between = b.acquire                    # both read "no lease"; b writes first
    with pytest.raises(UserError, match="mounted read-write by .*/mnt/b"):
        a.acquire()
    assert holder(bucket) == "/mnt/b"


def test_release_and_abandon_leave_another_nodes_lease_alone(tmp_path):
    bucket = MemoryStore()
    seen_by_a = Interleaved(bucket)
    a, b = node(seen_by_a, tmp_path, "a"), node(bucket, tmp_path, "b")
    a.acquire()
    seen_by_a.between = lambda: b.acquire(force=True)
    a.release()                                      # b took it between read and write
    assert holder(bucket) == "/mnt/b" and not json.loads(bucket.get(LEASE_KEY)).get("released")
    a.abandon()
    assert holder(bucket) == "/mnt/b"


class LandsThenFails:
    """The first conditional write lands, then its answer is lost (a transient error):
    the retry finds the object changed by that very write."""

    def __init__(self, inner):
        self.inner = inner
        self.failed = False

    def put_if(self, key, data, version):
        self.inner.put_if(key, data, version)
        if not self.failed:
            self.failed = True
            raise ColdStoreError("connection reset", transient=True)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_write_whose_first_try_landed_counts_as_done(tmp_path):
    bucket = MemoryStore()
    flaky = LandsThenFails(bucket)
    a = node(RetryingStore(flaky, timeout=10, base=0.001, cap=0.01), tmp_path, "a")
    assert a.acquire() is None and flaky.failed
    assert holder(bucket) == "/mnt/a" and a.renew() is True


class NoConditionalWrites:
    def __init__(self, inner):
        self.inner = inner

    def put_if(self, key, data, version):
        raise ConditionalWritesUnsupported("s3://old does not support conditional writes")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_store_without_conditional_writes_gets_plain_ones_and_a_warning(tmp_path, caplog):
    bucket = MemoryStore()
    a = node(NoConditionalWrites(bucket), tmp_path, "a")
    with caplog.at_level(logging.WARNING, logger="tierfs.tier.lease"):
        assert a.acquire() is None
        assert a.renew() is True
    assert holder(bucket) == "/mnt/a"
    warnings = [r for r in caplog.records if "both take it" in r.getMessage()]
    assert len(warnings) == 1  # said once, not at every renewal


@pytest.mark.parametrize("damaged", [b"{not json", b"[]", b"7", b"{}", b'{"node": ""}'])
def test_a_damaged_lease_is_free_to_every_check_and_replaced(tmp_path, caplog, damaged):
    """A lease that is not an object naming its holder protects nothing: it is taken,
    renewed, released and given back as if there were none, with a warning."""
    bucket = MemoryStore()
    bucket.put(LEASE_KEY, damaged)
    a = node(bucket, tmp_path, "a")
    with caplog.at_level(logging.WARNING, logger="tierfs.tier.lease"):
        assert a.acquire() is None
    assert "damaged" in caplog.text
    assert holder(bucket) == "/mnt/a" and not a.last_writer_elsewhere()
    assert a.renew() and not a.fenced
    a.release()
    assert json.loads(bucket.get(LEASE_KEY))["released"] is True
    bucket.put(LEASE_KEY, damaged)
    b = node(bucket, tmp_path, "b")
    b.acquire()
    b.abandon()  # a refused mount: what was there goes back (nothing valid: deleted)
    assert LEASE_KEY not in bucket.list("")


class Answered:
    """Counts the reads of the lease that came back (answered, failed or given up)."""

    def __init__(self, inner):
        self.inner = inner
        self.returned = 0

    def get_versioned(self, key):
        try:
            return self.inner.get_versioned(key)
        finally:
            self.returned += 1

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_unmount_does_not_wait_for_a_renewal_the_bucket_never_answers(tmp_path):
    """A bucket that accepts and never answers holds a renewal in its worker thread
    (up to the socket timeouts and retries, minutes): cancelling the lease task at
    unmount leaves that thread behind instead of keeping the daemon from exiting."""
    silent = FaultyStore(MemoryStore())
    silent.hang_limit_s = 10.0  # a bound for the test only: the call then returns
    answered = Answered(silent)
    lease = Lease(RetryingStore(answered, timeout=1.0), str(tmp_path), "/mnt/a", ttl=0.3)
    assert lease.acquire() is None
    reads, answers = silent.calls.get("get", 0), answered.returned

    async def unmount_during_a_renewal():
        silent.hang = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lease.run)
            while silent.calls.get("get", 0) == reads:  # the renewal's read is in flight
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        return answered.returned - answers

    try:
        returned = trio.run(unmount_during_a_renewal)
    finally:
        silent.hang = False  # the thread left behind ends
    assert returned == 0, "the lease task waited for the silent bucket to answer"


def test_a_renewal_left_behind_at_unmount_does_not_undo_the_release(tmp_path):
    """The renewal an unmount left in its thread may get its answer after the lease
    was released: it must not write a live lease over the released one, which would
    keep other nodes out for a whole ttl."""
    bucket = MemoryStore()
    lease = node(bucket, tmp_path, "a")
    assert lease.acquire() is None
    lease.release()
    assert lease.renew() is False
    assert json.loads(bucket.get(LEASE_KEY)).get("released") is True


class CountsReads:
    def __init__(self, inner):
        self.inner = inner
        self.reads = 0

    def get_versioned(self, key):
        self.reads += 1
        return self.inner.get_versioned(key)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_live_holder_whose_clock_runs_behind_keeps_its_lease(tmp_path):
    """The holder's clock runs five minutes behind: by the other node's clock its lease
    expired long ago. The other node watches it first, sees it renewed, and is
    refused instead of taking over a live mount."""
    bucket = MemoryStore()
    seen_by_b = Interleaved(bucket)
    (tmp_path / "a").mkdir()
    a = Lease(bucket, str(tmp_path / "a"), "/mnt/a", clock=lambda: time.time() - 300)
    b = node(seen_by_b, tmp_path, "b")
    b.watch_poll = 0.01
    assert a.acquire() is None
    seen_by_b.between = a.renew  # a renews while b watches
    with pytest.raises(UserError, match="still renews its lease .* clocks disagree"):
        b.acquire()
    assert holder(bucket) == "/mnt/a" and a.renew() is True and not a.fenced


def test_a_lease_that_lapsed_a_moment_ago_is_watched_then_taken(tmp_path):
    """A holder that died a moment ago renews no more: after two of its renewal periods
    unchanged, its lease is taken over without --force."""
    bucket = MemoryStore()
    (tmp_path / "a").mkdir()
    a = Lease(bucket, str(tmp_path / "a"), "/mnt/a", ttl=0.3)  # renews every 0.1 s
    assert a.acquire() is None
    watched = CountsReads(bucket)
    b = node(watched, tmp_path, "b")
    b.watch_poll = 0.01
    wait_until(lambda: json.loads(bucket.get(LEASE_KEY))["expires"] < time.time(), 5,
               "a's lease to lapse")
    assert "took over the lease of" in b.acquire()
    assert holder(bucket) == "/mnt/b" and watched.reads > 2  # read again while watched


def test_a_lease_that_lapsed_long_ago_is_taken_at_once(tmp_path):
    bucket = MemoryStore()
    (tmp_path / "a").mkdir()
    a = Lease(bucket, str(tmp_path / "a"), "/mnt/a", clock=lambda: time.time() - 2 * 3600)
    assert a.acquire() is None
    watched = CountsReads(bucket)
    b = node(watched, tmp_path, "b")
    assert "took over the lease of" in b.acquire()
    assert holder(bucket) == "/mnt/b" and watched.reads == 1


def test_a_copied_cache_dir_does_not_pass_for_its_original(tmp_path, monkeypatch):
    """A cache dir of an older release (a node-id file alone) keeps its live lease. A
    copy of it (cp -a: another directory; a cloned VM disk: another machine) carries
    the node-id too, and is refused even with --force, until its place file is deleted
    (the original is gone: it was moved, not copied)."""
    machine = tmp_path / "product_uuid"  # the machine's DMI UUID
    machine.write_text("4c4c4544-0001\n")
    monkeypatch.setattr(lease_mod, "MACHINE_ID", str(machine))
    bucket = MemoryStore()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "node-id").write_text("made-by-an-older-release\n")
    bucket.put(LEASE_KEY, json.dumps({"node": "made-by-an-older-release", "host": "h",
                                      "pid": 1, "cache_dir": str(tmp_path / "a"),
                                      "mountpoint": "/mnt/a",
                                      "expires": time.time() + 60}).encode())
    a = Lease(bucket, str(tmp_path / "a"), "/mnt/a")
    assert a.acquire() is None and a.renew() and not a.fenced  # its own lease, still

    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    copy = Lease(bucket, str(tmp_path / "copy"), "/mnt/copy")
    for force in (False, True):
        with pytest.raises(UserError, match="is a copy of another node's cache dir .*"
                                            "made in another directory"):
            copy.acquire(force=force)
    assert holder(bucket) == "/mnt/a" and a.renew() and not a.fenced

    machine.write_text("4c4c4544-0002\n")  # a cloned VM: the same inode, another machine
    clone = Lease(bucket, str(tmp_path / "a"), "/mnt/a")
    with pytest.raises(UserError, match="made on another machine"):
        clone.acquire(force=True)
    machine.unlink()  # no DMI UUID to read (not root): the inode alone tells
    assert Lease(bucket, str(tmp_path / "a"), "/mnt/a").acquire() is None

    (tmp_path / "copy" / "node-id.place").unlink()  # moved here, not copied
    moved = Lease(bucket, str(tmp_path / "copy"), "/mnt/copy")
    assert moved.acquire() is None and holder(bucket) == "/mnt/copy"


def test_a_node_id_left_empty_by_a_power_cut_is_no_identity(tmp_path, monkeypatch):
    """A node-id file is new on a node's first mount; a power cut soon after may leave
    it empty. An empty identity wrote a lease naming no holder, which every other node
    takes for a damaged one, free: a second writer then came in without --force. The
    node-id is written durably, and an empty one is replaced by a new identity."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    fresh = node(MemoryStore(), tmp_path, "fresh")
    made = [p for p in synced if os.path.basename(p).startswith("node-id")]
    assert fresh.me["node"] and made, synced  # the node-id written, and synced
    assert str(tmp_path / "fresh") in synced  # and its entry in the cache dir

    bucket = MemoryStore()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "node-id").write_text("")  # as a power cut leaves it
    a = Lease(bucket, str(tmp_path / "a"), "/mnt/a")
    assert a.acquire() is None and a.me["node"]
    b = node(bucket, tmp_path, "b")
    with pytest.raises(UserError, match="mounted read-write by .*/mnt/a"):
        b.acquire()
    assert holder(bucket) == "/mnt/a" and a.renew() and not a.fenced
