"""Several stores on one PostgreSQL namespace, as several nodes hold it: each
operation is one serializable transaction, so concurrent creates, renames and
unlinks in one directory leave a namespace that some serial order of them
explains, and two creates of one name give one success and one EEXIST."""
from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import stat
import threading
import time
import types

import pytest

from tests.component.test_meta_conformance import always, err, never
from tests.harness import wait_until
from tests.pg_server import ForgetfulProxy, pg_server
from tierfs.errors import FsError, SessionLost, UserError
from tierfs.meta import MetaStore, scan
from tierfs.meta.store import ID_BLOCK, open_engine
from tierfs.meta.schema import FIRST_COOKIE, ROOT_INO, Superblock
from tierfs.tier.fsck import Fsck

REG = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755
NODES = 3


@pytest.fixture
def nodes(postgres):
    url = postgres.new_schema()
    first = MetaStore(url)
    first.format(Superblock(fs_id="shared", extent_size=4 << 20), uid=0, gid=0)
    stores = [first] + [MetaStore(url) for _ in range(NODES - 1)]
    yield stores
    for store in stores:
        store.close()


def run_together(fns) -> list:
    """Run each fn in its own thread, released at once; their results (or the
    FsError each raised). Any other exception in a thread fails the caller."""
    start = threading.Barrier(len(fns))
    results: list = [None] * len(fns)
    failed: list[BaseException] = []

    def body(i, fn):
        start.wait()
        try:
            results[i] = fn()
        except FsError as e:
            results[i] = e
        except BaseException as e:
            failed.append(e)
    threads = [threading.Thread(target=body, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a store operation did not finish within 60 s"
    if failed:
        raise failed[0]
    return results


def namespace_problems(meta) -> list[str]:
    """fsck's namespace check: entries, cookies, link counts, parents."""
    check = Fsck(meta, None, None, 4 << 20, repair=False, verify_data=False)
    check.inodes = {n.ino: n for n in scan.inodes(meta)}
    check.check_namespace()
    return [f.problem for f in check.findings]


def test_one_name_created_on_three_nodes_at_once_succeeds_once(nodes):
    for round_ in range(20):
        name = f"same-{round_}".encode()
        results = run_together([lambda m=m: m.create_node(ROOT_INO, name, REG, 0, 0)
                                for m in nodes])
        won = [r for r in results if not isinstance(r, FsError)]
        lost = [r for r in results if isinstance(r, FsError)]
        assert len(won) == 1, results
        assert [e.errno for e in lost] == [errno.EEXIST] * (NODES - 1)
        assert all(m.lookup(ROOT_INO, name) == won[0].ino for m in nodes)
    assert namespace_problems(nodes[0]) == []


def test_ids_are_unique_across_nodes(nodes):
    made = run_together([
        lambda m=m, i=i: [m.create_node(ROOT_INO, f"n{i}-{k}".encode(), REG, 0, 0).ino
                          for k in range(30)]
        for i, m in enumerate(nodes)])
    inos = [ino for per_node in made for ino in per_node]
    assert len(set(inos)) == len(inos) == NODES * 30
    objects = run_together([lambda m=m: [m.next_object_id() for _ in range(30)] for m in nodes])
    ids = [obj for per_node in objects for obj in per_node]
    assert len(set(ids)) == len(ids) == NODES * 30
    # Each node took one block of each counter, not one counter write per id.
    assert nodes[0].peek_counter(b"ino") == ROOT_INO + 1 + NODES * ID_BLOCK
    assert nodes[0].peek_counter(b"obj") == 1 + NODES * ID_BLOCK


def test_concurrent_creates_renames_and_unlinks_in_one_directory(nodes):
    """Three nodes, two threads each, churning 24 names in one directory. Every
    operation that succeeded is counted: names created minus names unlinked is
    what the directory holds (a rename moves a name within it), and the
    namespace passes fsck's checks."""
    work = nodes[0].create_node(ROOT_INO, b"work", DIR, 0, 0).ino
    names = [f"f{i:02d}".encode() for i in range(24)]
    counts = {"created": 0, "unlinked": 0, "renamed": 0, "refused": 0, "replaced": 0}
    lock = threading.Lock()

    def churn(meta, seed):
        rng = random.Random(seed)
        for _ in range(60):
            op = rng.choice(("create", "create", "unlink", "rename", "rename_noreplace"))
            a, b = rng.choice(names), rng.choice(names)
            try:
                if op == "create":
                    meta.create_node(work, a, REG, 0, 0)
                    key = "created"
                elif op == "unlink":
                    meta.unlink(work, a, never)
                    key = "unlinked"
                else:
                    flags = 1 if op == "rename_noreplace" else 0
                    replaced, _purged = meta.rename(work, a, work, b, flags, never, 1, 2)
                    key = "renamed"
                    if replaced is not None:  # the target's name is gone with it
                        with lock:
                            counts["replaced"] += 1
            except FsError as e:
                assert e.errno in (errno.EEXIST, errno.ENOENT), (op, a, b, e)
                key = "refused"
            with lock:
                counts[key] += 1

    run_together([lambda m=m, seed=seed: churn(m, seed)
                  for seed, m in enumerate(nodes + nodes)])
    listed = [name for _c, name, _ino in nodes[1].readdir(work, 0)]
    assert len(listed) == len(set(listed))
    assert len(listed) == counts["created"] - counts["unlinked"] - counts["replaced"], counts
    for name in listed:
        assert nodes[2].lookup(work, name) == nodes[0].lookup(work, name)
    assert sum(counts.values()) - counts["replaced"] == 6 * 60
    assert counts["created"] and counts["unlinked"] and counts["renamed"], counts
    assert namespace_problems(nodes[0]) == []


def test_rename_exchange_across_directories_is_one_step(nodes):
    a = nodes[0].create_node(ROOT_INO, b"a", DIR, 0, 0)
    b = nodes[1].create_node(ROOT_INO, b"b", DIR, 0, 0)
    x = nodes[0].create_node(a.ino, b"x", REG, 0, 0)
    y = nodes[1].create_node(b.ino, b"y", DIR, 0, 0)
    # Exchange back and forth from two nodes at once: each is atomic, so after an
    # even number of them the names are where they started.
    results = run_together([
        lambda m=m: [m.rename(a.ino, b"x", b.ino, b"y", 2, never, 1, 2) for _ in range(10)]
        for m in nodes[:2]])
    assert not any(isinstance(r, FsError) for r in results), results
    assert nodes[2].lookup(a.ino, b"x") == x.ino
    assert nodes[2].lookup(b.ino, b"y") == y.ino
    assert nodes[2].get_inode(y.ino).parent == b.ino
    assert namespace_problems(nodes[2]) == []


@pytest.fixture
def own_server():
    """A server of this test's own, to stop and start (the shared one serves others)."""
    with pg_server() as server:
        yield server


def test_database_outage_waits_then_eio_and_work_resumes(own_server):
    url = own_server.new_schema()
    meta = MetaStore(open_engine(url, wait=2.0))
    try:
        meta.format(Superblock(fs_id="outage", extent_size=4 << 20), uid=0, gid=0)
        kept = meta.create_node(ROOT_INO, b"kept", REG, 0, 0)
        own_server.stop()
        # Beyond the bound: EIO, for reads and writes alike (never a traceback).
        assert err(meta.create_node, ROOT_INO, b"during", REG, 0, 0) == errno.EIO
        assert err(meta.get_inode, kept.ino) == errno.EIO
        own_server.start()
        # Within the bound: a call made while the server is down completes once it is back.
        meta.kv.wait = 60.0
        own_server.stop()
        pending = run_together([lambda: meta.create_node(ROOT_INO, b"after", REG, 0, 0),
                                own_server.start])
        assert not isinstance(pending[0], FsError), pending
        assert meta.lookup(ROOT_INO, b"kept") == kept.ino  # acknowledged before: kept
        assert meta.lookup(ROOT_INO, b"after") == pending[0].ino
        assert err(meta.lookup, ROOT_INO, b"during") == errno.ENOENT
    finally:
        meta.close()


def test_a_database_that_stops_answering_gives_eio_and_work_resumes(own_server, caplog):
    """A server that keeps its connections open and answers nothing (frozen, stuck
    on its disk): reads and writes fail with EIO once the bound has passed instead
    of waiting for ever; once it answers again, work resumes, and what failed left
    nothing behind."""
    url = own_server.new_schema()
    meta = MetaStore(open_engine(url, wait=2.0))
    try:
        meta.format(Superblock(fs_id="silent", extent_size=4 << 20), uid=0, gid=0)
        kept = meta.create_node(ROOT_INO, b"kept", REG, 0, 0)
        # Two pooled connections, open when the server stops answering.
        run_together([lambda: meta.create_node(ROOT_INO, b"a", REG, 0, 0),
                      lambda: meta.create_node(ROOT_INO, b"b", REG, 0, 0)])
        own_server.pause()
        try:
            during = run_together([lambda: meta.create_node(ROOT_INO, b"during", REG, 0, 0),
                                   lambda: meta.lookup(ROOT_INO, b"kept")])
        finally:
            own_server.resume()
        assert [getattr(r, "errno", r) for r in during] == [errno.EIO, errno.EIO]
        assert "did not answer within 2 s" in caplog.text  # on the open connections
        assert meta.lookup(ROOT_INO, b"kept") == kept.ino
        assert err(meta.lookup, ROOT_INO, b"during") == errno.ENOENT
        after = meta.create_node(ROOT_INO, b"after", REG, 0, 0)
        assert meta.lookup(ROOT_INO, b"after") == after.ino
    finally:
        meta.close()


def test_a_database_that_does_not_answer_at_open_is_one_clear_error(own_server):
    """Opening a namespace on a server that accepts and answers nothing ends (the
    connection attempt is bounded) with one line naming the database and the fix."""
    url = own_server.new_schema()
    own_server.pause()
    try:
        with pytest.raises(UserError) as caught:
            MetaStore(open_engine(url, wait=1.0))
    finally:
        own_server.resume()
    message = str(caught.value)
    assert "cannot use the metadata database postgresql://" in message, message
    assert "check --meta-url and that PostgreSQL is running" in message, message
    assert "\n" not in message


def _backend_waiting(server, event: str) -> int | None:
    import psycopg
    with psycopg.connect(server.url(), autocommit=True) as conn:
        row = conn.execute("SELECT pid FROM pg_stat_activity WHERE wait_event = %s",
                           (event,)).fetchone()
    return row[0] if row else None


def _reload(server, setting: str, value: str) -> None:
    """Reload the server's configuration and wait until it is in force. The
    postmaster reloads on a signal, after pg_reload_conf() returns, and signals the
    open backends when it has: once a new connection shows `value`, the next
    statement on any open connection runs with it too."""
    import psycopg
    server.sql("SELECT pg_reload_conf()")

    def in_force() -> bool:
        with psycopg.connect(server.url(), autocommit=True) as conn:
            return conn.execute(f"SHOW {setting}").fetchone()[0] == value
    wait_until(in_force, 30, f"{setting} = {value!r} in force")


def _cut_off_when(server, event: str, *before_kill: str) -> None:
    """Wait until a backend waits on `event` in its COMMIT, run the statements
    `before_kill`, then terminate that backend: its client loses the connection
    during COMMIT."""
    pid = wait_until(lambda: _backend_waiting(server, event), 30, f"a COMMIT waiting on {event}")
    for statement in before_kill:
        server.sql(statement)
    server.sql(f"SELECT pg_terminate_backend({pid})")


def test_a_commit_cut_off_is_looked_up_not_guessed(own_server):
    """The connection is lost during COMMIT: the engine asks the server how that
    transaction ended. Committed (locally, while it waited for a synchronous standby
    that never answers): the call succeeds, not run twice. Aborted (cut off in a
    deferred trigger): run again, once."""
    url = own_server.new_schema()
    schema = url.rsplit("%3D", 1)[1]
    meta = MetaStore(open_engine(url, wait=30.0))
    try:
        meta.format(Superblock(fs_id="cut", extent_size=4 << 20), uid=0, gid=0)
        own_server.sql("ALTER SYSTEM SET synchronous_standby_names = 'nobody'")
        _reload(own_server, "synchronous_standby_names", "nobody")
        out = run_together([
            lambda: meta.create_node(ROOT_INO, b"committed", REG, 0, 0),
            lambda: _cut_off_when(own_server, "SyncRep",
                                  "ALTER SYSTEM RESET synchronous_standby_names",
                                  "SELECT pg_reload_conf()")])
        assert not isinstance(out[0], FsError), out
        assert meta.lookup(ROOT_INO, b"committed") == out[0].ino
        assert meta.get_inode(ROOT_INO).next_cookie == FIRST_COOKIE + 1  # made once
        own_server.sql(f"""
            CREATE TABLE {schema}.armed (on_ boolean);
            INSERT INTO {schema}.armed VALUES (true);
            CREATE FUNCTION {schema}.stall() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN IF (SELECT on_ FROM {schema}.armed) THEN PERFORM pg_sleep(30); END IF;
                RETURN NULL; END $$;
            CREATE CONSTRAINT TRIGGER stall AFTER INSERT ON {schema}.tierfs_kv
                DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {schema}.stall();""")
        out = run_together([
            lambda: meta.create_node(ROOT_INO, b"retried", REG, 0, 0),
            lambda: _cut_off_when(own_server, "PgSleep", f"UPDATE {schema}.armed SET on_ = false")])
        assert not isinstance(out[0], FsError), out
        assert meta.lookup(ROOT_INO, b"retried") == out[0].ino
        assert [n for _c, n, _i in meta.readdir(ROOT_INO, 0)] == [b"committed", b"retried"]
    finally:
        meta.close()


def test_a_database_that_takes_no_writes_gives_eio_and_work_resumes(own_server, caplog):
    """A server that refuses writes (a standby the URL reaches during a failover, a
    database set read-only for maintenance) fails writes with EIO once the bound has
    passed, logged in one line, never with an error of the database driver that no
    caller expects (a FUSE request logs it as a bug, a background task restarts); a
    write that waits while the server takes writes again goes through."""
    url = own_server.new_schema()
    meta = MetaStore(open_engine(url, wait=2.0))
    try:
        meta.format(Superblock(fs_id="read-only", extent_size=4 << 20), uid=0, gid=0)
        kept = meta.create_node(ROOT_INO, b"kept", REG, 0, 0)
        own_server.sql("ALTER SYSTEM SET default_transaction_read_only = on")
        _reload(own_server, "default_transaction_read_only", "on")
        assert err(meta.create_node, ROOT_INO, b"during", REG, 0, 0) == errno.EIO
        assert "read-only transaction" in caplog.text
        assert meta.lookup(ROOT_INO, b"kept") == kept.ino  # reads go on
        meta.kv.wait = 60.0
        out = run_together([lambda: meta.create_node(ROOT_INO, b"after", REG, 0, 0),
                            lambda: (own_server.sql("ALTER SYSTEM RESET "
                                                    "default_transaction_read_only"),
                                     own_server.sql("SELECT pg_reload_conf()"))])
        assert not isinstance(out[0], FsError), out
        assert meta.lookup(ROOT_INO, b"after") == out[0].ino
        assert err(meta.lookup, ROOT_INO, b"during") == errno.ENOENT
    finally:
        meta.close()


def test_a_read_whose_commit_loses_its_connection_is_run_again(own_server, caplog):
    """A read transaction changes nothing, so a connection lost at its COMMIT (the
    server restarting) is an outage like any other: the read runs again, never EIO."""
    url = own_server.new_schema()
    meta = MetaStore(open_engine(url, wait=30.0))
    try:
        meta.format(Superblock(fs_id="read-cut", extent_size=4 << 20), uid=0, gid=0)
        cut = []

        def read_cut_before_commit():
            with meta.kv.read() as txn:
                found = txn.get(b"x")
                if not cut:  # the first attempt: its backend ends before the COMMIT
                    pid = txn.cur.execute("SELECT pg_backend_pid()").fetchone()[0]
                    own_server.sql(f"SELECT pg_terminate_backend({pid})")
                    cut.append(pid)
            return found

        assert meta.kv.run(read_cut_before_commit) is None
        assert cut and "during COMMIT" not in caplog.text
    finally:
        meta.close()


def test_a_connection_idle_longer_than_a_nat_keeps_it_is_not_used(own_server, monkeypatch):
    """A NAT or firewall between a node and the server may forget a connection that
    stayed idle (some after 4 minutes) and then drop its packets without a word: a
    request sent on it would wait the whole bound and fail with EIO, though the
    server is fine. The engine does not use a connection idle that long."""
    from tierfs.meta import postgres_pool
    clock = [1000.0]
    monkeypatch.setattr(postgres_pool, "time",
                        types.SimpleNamespace(monotonic=lambda: clock[0]), raising=False)
    proxy = ForgetfulProxy(own_server)
    meta = MetaStore(open_engine(proxy.url(own_server.new_schema()), wait=2.0))
    try:
        meta.format(Superblock(fs_id="nat", extent_size=4 << 20), uid=0, gid=0)
        run_together([lambda: meta.create_node(ROOT_INO, b"a", REG, 0, 0),
                      lambda: meta.create_node(ROOT_INO, b"b", REG, 0, 0)])
        clock[0] += getattr(postgres_pool, "MAX_IDLE_S", 60.0) + 1
        proxy.forget()  # every pooled connection now leads nowhere
        after = meta.create_node(ROOT_INO, b"after", REG, 0, 0)
        assert meta.lookup(ROOT_INO, b"after") == after.ino
    finally:
        meta.close()
        proxy.close()


def test_a_change_that_keeps_losing_to_other_nodes_ends_with_eio(postgres, caplog):
    """A change whose transaction every attempt loses to another node's (a long one
    beside a stream of short ones touching the same records) is run again only until
    the engine's bound has passed, then fails with EIO: no wait is unbounded."""
    url = postgres.new_schema()
    slow_kv, other_kv = open_engine(url, wait=1.0), open_engine(url, wait=1.0)
    other_commits = threading.Condition()
    committed = [0]
    stop = threading.Event()

    def short_change():  # reads y, writes x
        with other_kv.write() as txn:
            txn.get(b"y")
            txn.put(b"x", b"%d" % committed[0])

    def other_node():
        while not stop.is_set():
            other_kv.run(short_change)
            with other_commits:
                committed[0] += 1
                other_commits.notify_all()

    def slow_change():  # reads x, writes y: with short_change, a cycle one must lose
        with slow_kv.write() as txn:
            txn.get(b"x")
            with other_commits:  # another node's change begun after the read commits
                seen = committed[0]  # (the next one may have begun before: two)
                other_commits.wait_for(lambda: committed[0] > seen + 1 or stop.is_set(), 10)
            txn.put(b"y", b"slow")

    outcome: list = []

    def attempt():
        try:
            outcome.append(slow_kv.run(slow_change))
        except FsError as e:
            outcome.append(e)

    competitor = threading.Thread(target=other_node)
    slow = threading.Thread(target=attempt)
    competitor.start()
    slow.start()
    try:
        slow.join(60)
        assert not slow.is_alive(), "a change that keeps losing was run again for 60 s"
    finally:
        stop.set()
        competitor.join(30)
        slow.join(30)
        slow_kv.close()
        other_kv.close()
    assert [getattr(r, "errno", r) for r in outcome] == [errno.EIO]
    assert "conflicting with other nodes' changes" in caplog.text


def test_an_unreachable_database_is_one_clear_error(tmp_path):
    url = f"postgresql://postgres@/tierfs?host={tmp_path}"  # no server listens there
    with pytest.raises(UserError) as info:
        MetaStore(url)
    message = str(info.value)
    assert "cannot use the metadata database postgresql://postgres@" in message
    assert "check --meta-url and that PostgreSQL is running" in message
    assert "\n" not in message


def test_an_expired_session_is_ended_by_another_node(nodes):
    a, b = nodes[0], nodes[1]
    sa = a.open_session("node-a", 1, "/mnt/a")
    b.open_session("node-b", 2, "/mnt/b")
    held = {}
    for name, m in (("a", a), ("b", b)):  # each holds an unlinked file open, uploads one object
        node = m.create_node(ROOT_INO, name.encode(), REG, 0, 0)
        m.unlink(ROOT_INO, name.encode(), always)
        held[name] = (node.ino, m.next_object_id())
    b.heartbeat()
    assert b.expired_sessions(3600) == []
    assert [x.sid for x in b.expired_sessions(0)] == [sa]  # a's heartbeat is older than now
    assert b.end_session(sa) == (1, 1)
    assert b.orphans() == [held["b"][0]]          # b's own stay
    assert b.upload_intents() == [held["b"][1]]
    assert held["a"][1] in [obj for obj, _epoch in b.gc_pending()]
    with pytest.raises(SessionLost):
        a.heartbeat()
    assert [x.node for x in b.sessions()] == ["node-b"]


def test_a_session_is_ended_only_while_it_is_still_stale(nodes):
    """end_session() of another node re-checks inside its transaction: a heartbeat
    newer than the bound, a decision due before now (a call the engine held up
    through an outage) or a session already gone decide nothing."""
    a, b = nodes[0], nodes[1]
    sa = a.open_session("node-a", 1, "/mnt/a")
    b.open_session("node-b", 2, "/mnt/b")
    soon = time.monotonic() + 60
    assert b.end_session(sa, stale_s=3600, decide_by=soon) is None  # fresh
    a.heartbeat()
    assert b.end_session(sa, stale_s=0, decide_by=time.monotonic() - 1) is None  # held up
    a.heartbeat()
    assert b.end_session(sa, stale_s=0, decide_by=soon) == (0, 0)
    with pytest.raises(SessionLost):
        a.heartbeat()
    assert b.end_session(sa, stale_s=0, decide_by=soon) is None  # gone already
    assert [x.node for x in b.sessions()] == ["node-b"]


def test_a_node_whose_clock_runs_behind_keeps_its_session(nodes, monkeypatch):
    """Heartbeats are judged on one clock, the database's: a node whose own clock runs
    two minutes behind (no NTP on it) beats its heart on time, and another node does
    not end its session as expired (which would purge the files it holds open and
    fence it)."""
    from tierfs.meta import store as store_module
    a, b = nodes[0], nodes[1]
    real_now = store_module.now_ns
    monkeypatch.setattr(store_module, "now_ns", lambda: real_now() - 120 * 10**9)
    sa = a.open_session("node-a", 1, "/mnt/a")  # on a's clock
    a.heartbeat()
    monkeypatch.setattr(store_module, "now_ns", real_now)  # b's clock is right
    b.open_session("node-b", 2, "/mnt/b")
    assert b.expired_sessions(30) == []
    assert b.end_session(sa, stale_s=30, decide_by=time.monotonic() + 60) is None
    a.heartbeat()  # still a's session


class Seen:
    """Collects what a store's change feed reports, for waiting on."""

    def __init__(self):
        self.inodes, self.entries, self.everything = set(), set(), 0
        self.cond = threading.Condition()

    def __call__(self, inodes, entries, everything):
        with self.cond:
            self.inodes |= inodes
            self.entries |= entries
            self.everything += everything
            self.cond.notify_all()

    def reset(self) -> None:
        with self.cond:
            self.inodes, self.entries = set(), set()

    def wait_for(self, what, timeout=30.0) -> None:
        with self.cond:
            assert self.cond.wait_for(what, timeout), \
                f"not reported within {timeout} s: {self.inodes}, {self.entries}"


def test_other_nodes_changes_are_reported_and_own_are_not(nodes, postgres):
    a, b = nodes[0], nodes[1]
    seen = Seen()
    listener = b.watch(seen)
    other = MetaStore(postgres.new_schema())  # another filesystem in the same database
    try:
        assert listener.listening.wait(30)
        d = a.create_node(ROOT_INO, b"d", DIR, 0, 0)
        f = a.create_node(d.ino, b"f", REG, 0, 0)
        seen.wait_for(lambda: {(ROOT_INO, b"d"), (d.ino, b"f")} <= seen.entries
                      and {ROOT_INO, d.ino, f.ino} <= seen.inodes)
        a.rename(d.ino, b"f", ROOT_INO, b"g", 0, never, 1, 2)
        seen.wait_for(lambda: {(d.ino, b"f"), (ROOT_INO, b"g")} <= seen.entries)
        h = a.create_node(ROOT_INO, b"h", REG, 0, 0)
        seen.wait_for(lambda: (ROOT_INO, b"h") in seen.entries)
        seen.reset()  # notifications come in commit order: nothing older is on its way
        node = a.get_inode(h.ino)
        node.mode = REG & ~0o022  # an attribute change alone (setattr)
        a.put_inode(node)
        seen.wait_for(lambda: h.ino in seen.inodes)
        # b's own changes, and another filesystem's, are not reported to b; a marker
        # change from a after them shows the feed has delivered everything before it.
        seen.reset()
        mine = b.create_node(ROOT_INO, b"mine", REG, 0, 0)
        other.format(Superblock(fs_id="other", extent_size=4 << 20), uid=0, gid=0)
        other.create_node(ROOT_INO, b"elsewhere", REG, 0, 0)
        marker = a.create_node(ROOT_INO, b"marker", REG, 0, 0)
        seen.wait_for(lambda: (ROOT_INO, b"marker") in seen.entries)
        assert (ROOT_INO, b"mine") not in seen.entries and mine.ino not in seen.inodes
        assert (ROOT_INO, b"elsewhere") not in seen.entries
        assert marker.ino in seen.inodes
        assert seen.everything == 1  # once, as LISTEN took effect: nothing before is told
    finally:
        listener.stop()
        other.close()


@contextlib.contextmanager
def two_nodes_one_listening(server):
    """(a, seen): node a on a new schema of `server`, and what a second node's change
    feed has told so far, listening already."""
    url = server.new_schema()
    a, b = MetaStore(url), MetaStore(url)
    seen = Seen()
    listener = b.watch(seen)
    try:
        a.format(Superblock(fs_id="feed", extent_size=4 << 20), uid=0, gid=0)
        assert listener.listening.wait(30)
        yield a, seen
    finally:
        listener.stop()
        a.close()
        b.close()


def test_the_feed_says_everything_after_it_lost_its_connection(own_server):
    with two_nodes_one_listening(own_server) as (a, seen):
        at_start = seen.everything  # 1: as LISTEN took effect
        own_server.stop()
        own_server.start()
        seen.wait_for(lambda: seen.everything > at_start)  # changes meanwhile may be lost
        a.create_node(ROOT_INO, b"after", REG, 0, 0)
        seen.wait_for(lambda: (ROOT_INO, b"after") in seen.entries)


def test_a_notification_the_feed_cannot_read_does_not_stop_it(nodes, postgres, caplog):
    """Anyone who can reach the database can notify the filesystem's channel (another
    tierfs version, a person testing): a payload that is JSON but not what the feed
    sends is logged and read as "everything may have changed" (it may be a change all
    the same), and the feed goes on telling other nodes' changes."""
    a, b = nodes[0], nodes[1]
    seen = Seen()
    listener = b.watch(seen)
    try:
        assert listener.listening.wait(30)
        at_start = seen.everything
        for text in ('[1]', '{"inodes": ["x"]}', '{"entries": [[1, "not hex"]]}',
                     '{"inodes": 5}', '"text"'):
            postgres.sql(f"SELECT pg_notify('{b.kv.channel}', '{text}')")
        f = a.create_node(ROOT_INO, b"after", REG, 0, 0)
        seen.wait_for(lambda: (ROOT_INO, b"after") in seen.entries and f.ino in seen.inodes,
                      timeout=10)
        assert caplog.text.count("metadata change feed: a notification it cannot read") == 5
        assert seen.everything == at_start + 5
    finally:
        listener.stop()


def test_the_feed_outlives_a_server_in_recovery(own_server):
    """During a failover the URL may reach a standby, where LISTEN is refused (not a
    lost connection): the feed keeps trying, and listens again once the server is
    promoted."""
    import pathlib
    with two_nodes_one_listening(own_server) as (a, seen):
        own_server.stop()
        standby = pathlib.Path(own_server.data, "standby.signal")
        standby.touch()
        if os.geteuid() == 0:  # the server runs as postgres (pg_server.py)
            shutil.chown(standby, "postgres", "postgres")
        own_server.start()
        def refused() -> bool:
            with open(own_server.log_path, errors="replace") as f:
                return "cannot execute LISTEN during recovery" in f.read()
        wait_until(refused, 30, "the feed to try LISTEN on the standby")
        at_start = seen.everything
        own_server.sql("SELECT pg_promote()")
        seen.wait_for(lambda: seen.everything > at_start)  # listening again
        a.create_node(ROOT_INO, b"after", REG, 0, 0)
        seen.wait_for(lambda: (ROOT_INO, b"after") in seen.entries)
