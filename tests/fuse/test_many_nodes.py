"""Three mounts of one filesystem, as three nodes hold it: each its own mount point
and cache dir, the namespace in one PostgreSQL schema, the data in one moto
bucket. Close-to-open consistency, names seen across nodes, concurrent namespace
changes and a sequence of data changes against models, a node killed with -9,
PostgreSQL restarted."""
from __future__ import annotations

import errno
import json
import os
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.fuse.test_tiering import status
from tests.harness import read_file, wait_until, write_file
from tests.moto_server import s3_env
from tests.pg_server import pg_server
from tierfs.meta import MetaStore, schema

NODES = 3
MiB = 1 << 20
# What a daemon logs, and must, when requests fail while its database does not answer
# (a COMMIT cut off that way has an outcome it cannot learn until the server is back).
DATABASE_AWAY = (r"metadata database .* (did not answer within|unreachable for|"
                 r"connection lost during COMMIT)")


def written_open(path: str, data: bytes):
    """A file created with `data` written (and flushed to the mount), left open."""
    f = open(path, "wb")
    f.write(data)
    f.flush()
    return f


def close_fails_with_eio(f) -> None:
    """close() while the database is away: the file cannot be published."""
    with pytest.raises(OSError) as closing:
        f.close()
    assert closing.value.errno == errno.EIO


def nodename(m) -> str:
    return os.path.basename(m.mountpoint)


@pytest.fixture
def nodes(mount_factory, s3_url, s3_endpoint, postgres):
    """Three mounted nodes of one new filesystem."""
    env = dict(os.environ, **s3_env(s3_endpoint))
    url = postgres.new_schema()
    args = ("--meta-url", url, "--session-timeout", "6")
    first, *others = [mount_factory(cold_url=s3_url, env=env, name=f"n{i}", args=args,
                                    start=False) for i in range(NODES)]
    first.start()  # makes the filesystem; the others join it at once, as nodes of a job do
    with ThreadPoolExecutor(len(others)) as pool:
        for started in [pool.submit(m.start) for m in others]:
            started.result()
    return [first, *others]


def test_close_to_open_across_nodes(nodes):
    a, b, c = nodes
    data = os.urandom(3 * 1024 * 1024 + 17)
    write_file(a.path("ckpt.bin"), data)  # returns after close()
    assert read_file(b.path("ckpt.bin")) == data
    assert os.stat(c.path("ckpt.bin")).st_size == len(data)
    # Rewritten shorter on B: A's next open sees B's bytes, not its own cached ones.
    short = os.urandom(1000)
    write_file(b.path("ckpt.bin"), short)
    assert read_file(a.path("ckpt.bin")) == short
    assert os.stat(a.path("ckpt.bin")).st_size == len(short)
    # Appended on C after A read it: A's next open sees the longer file.
    with open(c.path("ckpt.bin"), "ab") as f:
        f.write(b"tail")
    assert read_file(a.path("ckpt.bin")) == short + b"tail"


def test_data_waits_for_the_writer_to_upload(nodes):
    """B opens a file whose data is still only on A (just closed there): B waits for
    A's upload and gets A's bytes, never zeros."""
    a, b, _c = nodes
    data = os.urandom(9 * 1024 * 1024)
    write_file(a.path("big.bin"), data)
    assert read_file(b.path("big.bin")) == data
    with open(a.path("big.bin"), "r+b") as f:
        f.seek(5 * 1024 * 1024)
        f.write(b"X" * 4096)
        f.flush()
        os.fsync(f.fileno())
    want = bytearray(data)
    want[5 << 20:(5 << 20) + 4096] = b"X" * 4096
    assert read_file(b.path("big.bin")) == bytes(want)


def test_a_write_that_waits_while_its_file_is_pushed_is_published(
        mount_factory, s3_url, s3_endpoint, postgres, tmp_path):
    """A write on B waits for the cold extent it partly overwrites while B pushes the
    file (`sync --wait` here; a finished upload does the same). That push must not
    count the file as published: B's close then publishes the write, and A reads it."""
    env = dict(os.environ, **s3_env(s3_endpoint))
    common = ("--meta-url", postgres.new_schema(), "--session-timeout", "6",
              "--extent-size", "1M")
    faults = tmp_path / "faults.json"
    a = mount_factory(cold_url=s3_url, env=env, name="a", args=common)
    b = mount_factory(cold_url=s3_url, env=env, name="b",
                      args=(*common, "--fault-file", str(faults)))
    data = os.urandom(2 * MiB)
    write_file(b.path("f"), data)
    b.cli("sync", b.path("f"), "--wait", check=True)
    b.cli("release", b.path("f"), check=True)
    faults.write_text(json.dumps({"hang": True, "hang_ops": ["get"]}))
    wrote = []

    def write() -> None:
        fd = os.open(b.path("f"), os.O_RDWR)
        try:
            wrote.append(os.pwrite(fd, b"new", MiB + 10))
        finally:
            os.close(fd)
    writer = threading.Thread(target=write)
    writer.start()
    try:
        wait_until(lambda: status(b)["fetches_in_flight"] >= 1, 30, "the write's fetch")
        b.cli("sync", b.path("f"), "--wait", check=True)
    finally:
        faults.write_text(json.dumps({}))
        writer.join(60)
    assert wrote == [3]
    want = bytearray(data)
    want[MiB + 10:MiB + 13] = b"new"
    assert read_file(a.path("f")) == bytes(want)


def test_names_seen_across_nodes(nodes):
    a, b, c = nodes
    os.mkdir(a.path("d"))
    write_file(a.path("d", "x"), b"x")
    assert os.listdir(b.path("d")) == ["x"]
    os.rename(b.path("d", "x"), b.path("d", "y"))
    # A had looked "x" up; the change feed makes its kernel forget that name.
    wait_until(lambda: sorted(os.listdir(a.path("d"))) == ["y"], 10, "rename seen on A")
    wait_until(lambda: not os.path.exists(a.path("d", "x")), 10, "old name gone on A")
    assert read_file(c.path("d", "y")) == b"x"
    os.symlink("y", c.path("d", "s"))
    os.link(c.path("d", "y"), c.path("d", "h"))
    wait_until(lambda: os.stat(a.path("d", "y")).st_nlink == 2, 10, "link count on A")
    assert os.readlink(a.path("d", "s")) == "y"
    os.setxattr(a.path("d", "y"), "user.k", b"v")
    assert os.getxattr(b.path("d", "y"), "user.k") == b"v"
    os.chmod(b.path("d", "y"), 0o600)
    wait_until(lambda: os.stat(c.path("d", "y")).st_mode & 0o777 == 0o600, 10, "chmod on C")
    # The same in the mount's root, which the kernel holds without a lookup.
    write_file(a.path("top"), b"t")
    assert os.stat(b.path("top")).st_size == 1
    os.rename(a.path("top"), a.path("top2"))
    wait_until(lambda: not os.path.exists(b.path("top")), 10, "old root name gone on B")
    assert read_file(b.path("top2")) == b"t"


def at_once(fn) -> list:
    """fn(i) for every node i, each in a thread of its own, started together: what each
    returned, or the OSError it raised."""
    start = threading.Barrier(NODES)
    results: list = [None] * NODES

    def run(i):
        start.wait()
        try:
            results[i] = fn(i)
        except OSError as e:
            results[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(NODES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_one_create_wins(nodes):
    """Three nodes create one name at once with O_EXCL: one wins, two get EEXIST."""
    for round_ in range(5):
        def create(i):
            fd = os.open(nodes[i].path(f"race{round_}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, f"node{i}".encode())
            os.close(fd)
            return "ok"
        results = [r.errno if isinstance(r, OSError) else r for r in at_once(create)]
        assert sorted(results, key=str) == sorted(["ok", errno.EEXIST, errno.EEXIST], key=str)
        winner = results.index("ok")
        for m in nodes:
            assert read_file(m.path(f"race{round_}")) == f"node{winner}".encode()


def test_creates_without_o_excl_all_open_the_one_file(nodes):
    """Three nodes open one new name with O_CREAT but not O_EXCL at once, as ranks
    opening one log do: every open succeeds (POSIX), on the one file there is."""
    for round_ in range(8):
        def open_it(i):
            fd = os.open(nodes[i].path(f"log{round_}"), os.O_CREAT | os.O_WRONLY)
            try:
                return os.fstat(fd).st_ino
            finally:
                os.close(fd)
        results = at_once(open_it)
        assert len(set(results)) == 1 and isinstance(results[0], int), results


def feed_connection(m) -> str:
    """The application_name of a node's change feed connection (postgres_kv)."""
    return f"tierfs feed {socket.gethostname()} pid {m.pid}"[:63]


def test_an_open_sees_a_close_the_change_feed_has_not_told(nodes, postgres):
    """B looks a file up while A still writes it, so B's kernel holds its size as 0.
    With B's change feed held up, only B's open() can tell B's kernel that A closed
    the file with bytes in it: B reads them, not an empty file. (A node that lost
    an O_EXCL race looked the winner's file up the same way.)"""
    a, b, _c = nodes
    with postgres.frozen_backends(feed_connection(b)):
        fd = os.open(a.path("f"), os.O_CREAT | os.O_WRONLY)
        try:
            assert os.stat(b.path("f")).st_size == 0
            os.write(fd, b"written on A")
        finally:
            os.close(fd)
        assert read_file(b.path("f")) == b"written on A"
        assert os.stat(b.path("f")).st_size == len(b"written on A")


def test_an_open_after_a_tiering_command_still_drops_old_pages(nodes, postgres):
    """B has read a file (its pages and attributes cached); A rewrites it. With B's
    change feed held up, `tierfs status` on B brings A's records into B's copy
    first: B's next open must still drop the old pages and attributes."""
    a, b, _c = nodes
    write_file(a.path("f"), b"old bytes")
    assert read_file(b.path("f")) == b"old bytes"
    os.stat(b.path("f"))  # the atime a read leaves stale, fetched: all attributes cached
    with postgres.frozen_backends(feed_connection(b)):
        write_file(a.path("f"), b"new bytes")
        b.cli("status", b.path("f"), check=True)
        assert read_file(b.path("f")) == b"new bytes"
        assert os.stat(b.path("f")).st_mtime_ns == os.stat(a.path("f")).st_mtime_ns


def test_concurrent_namespace_changes_match_a_model(nodes):
    """Creates, renames and unlinks of a few names in one directory from three
    nodes at once. Each operation is atomic, so the directory ends as some serial
    order of the successful ones leaves it: every name left holds the content of
    the one create it came from, and the counts add up."""
    os.mkdir(nodes[0].path("shared"))
    names = [f"f{i}" for i in range(6)]
    created, unlinked, renamed_over = [0] * NODES, [0] * NODES, [0] * NODES
    contents: set[bytes] = set()
    lock = threading.Lock()

    def worker(i):
        rng = random.Random(i)
        d = nodes[i].path("shared")
        for n in range(60):
            op = rng.random()
            src = os.path.join(d, rng.choice(names))
            try:
                if op < 0.4:
                    body = f"{i}-{n}".encode()
                    fd = os.open(src, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                    os.write(fd, body)
                    os.close(fd)
                    with lock:
                        contents.add(body)
                    created[i] += 1
                elif op < 0.7:
                    os.unlink(src)
                    unlinked[i] += 1
                else:
                    dst = os.path.join(d, rng.choice(names))
                    if src == dst:
                        continue
                    existed = os.path.exists(dst)
                    os.rename(src, dst)
                    if existed:  # may be stale: checked below by content, not count
                        renamed_over[i] += 1
            except FileNotFoundError:
                pass
            except FileExistsError:
                pass
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(NODES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
        assert not t.is_alive()
    left = sorted(os.listdir(nodes[0].path("shared")))
    for m in nodes:  # every node sees the same directory once the feed delivered
        wait_until(lambda: sorted(os.listdir(m.path("shared"))) == left, 10, "same listing")
    seen = set()
    for name in left:
        body = read_file(nodes[1].path("shared", name))
        assert body in contents, f"{name} holds {body!r}, which no create wrote"
        assert body not in seen, f"two names hold {body!r}: one file counted twice"
        seen.add(body)
    assert len(left) <= sum(created) - sum(unlinked)
    r = nodes[2].cli("fsck", nodes[2].cold_url, "--meta-url", nodes[2].args[1])
    assert r.returncode == 0, r.stdout + r.stderr


def test_data_changed_on_any_node_matches_a_model(mount_factory, s3_url, s3_endpoint,
                                                   postgres):
    """Close-to-open data across nodes, against a model: a seeded sequence of partial
    writes, appends, rewrites and truncates of four files, each done on a random node
    and closed, then the file read whole on another node (sometimes on every node).
    Hot tiers of six 1 MiB extents for files of up to 3 MiB: extents are uploaded,
    evicted and fetched back all along, and a node often changes an extent that only
    another node has written so far."""
    env = dict(os.environ, **s3_env(s3_endpoint))
    args = ("--meta-url", postgres.new_schema(), "--extent-size", "1M", "--cache-size", "6M",
            "--upload-delay", "0.05")
    ms = [mount_factory(cold_url=s3_url, env=env, name=f"n{i}", args=args)
          for i in range(NODES)]
    rng = random.Random(7)
    files = {f"f{i}": bytearray() for i in range(4)}
    limit = 3 << 20

    def check(node, name: str, when: str) -> None:
        got = read_file(node.path(name))
        want = bytes(files[name])
        if got != want:
            at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                      min(len(got), len(want)))
            pytest.fail(f"{when}: {name} read on {nodename(node)} differs from offset {at} "
                        f"(read {len(got)} bytes, expected {len(want)})")

    for step in range(120):
        name = rng.choice(sorted(files))
        model = files[name]
        writer = rng.choice(ms)
        op = rng.random()
        path = writer.path(name)
        if op < 0.45 or not os.path.exists(path):  # a partial write (it may leave a hole)
            off = rng.randrange(0, limit - 1)
            data = rng.randbytes(rng.randrange(1, min(512 << 10, limit - off) + 1))
            with open(path, "r+b" if os.path.exists(path) else "wb") as f:
                f.seek(off)
                f.write(data)
            model.extend(bytes(max(0, off - len(model))))
            model[off:off + len(data)] = data
            what = f"write of {len(data)} bytes at {off}"
        elif op < 0.6:
            data = rng.randbytes(rng.randrange(0, min(256 << 10, limit - len(model)) + 1))
            with open(path, "ab") as f:
                f.write(data)
            model += data
            what = f"append of {len(data)} bytes"
        elif op < 0.75:
            data = rng.randbytes(rng.randrange(0, limit))
            write_file(path, data)
            model[:] = data
            what = f"rewrite with {len(data)} bytes"
        else:
            size = rng.choice([0, rng.randrange(0, limit), len(model) // 2,
                               (len(model) // (1 << 20)) << 20])
            os.truncate(path, size)
            if size < len(model):
                del model[size:]
            else:
                model.extend(bytes(size - len(model)))
            what = f"truncate to {size}"
        when = f"step {step}, after a {what} on {nodename(writer)}"
        readers = ms if rng.random() < 0.2 else [rng.choice([m for m in ms if m is not writer])]
        for node in readers:
            check(node, name, when)
    for node in ms:
        for name in files:
            check(node, name, "at the end")
    fetched = sum(status(m)["counters"].get("cold_reads", 0) for m in ms)
    assert fetched > 0, "no extent came back from the bucket: the hot tiers never filled"


@pytest.mark.allow_log_errors
def test_node_killed_with_data_not_uploaded(mount_factory, s3_url, s3_endpoint, postgres,
                                            tmp_path):
    """A fsyncs a file whose upload cannot finish (its bucket refuses), then dies by
    kill -9 while both nodes create files. B keeps working; B's keeper ends A's
    session after the timeout; B's open of A's file is EIO naming A, never zeros. A
    mounts again with its cache dir: what it acknowledged (fsynced, or closed before
    it died) is published and uploaded, B reads all of it, fsck is clean."""
    env = dict(os.environ, **s3_env(s3_endpoint))
    url = postgres.new_schema()
    args = ("--meta-url", url, "--session-timeout", "6", "--cold-timeout", "3")
    faults = tmp_path / "faults.json"
    a = mount_factory(cold_url=s3_url, env=env, name="a",
                      args=args + ("--fault-file", str(faults)))
    b = mount_factory(cold_url=s3_url, env=env, name="b", args=args)
    safe = os.urandom(2 << 20)
    write_file(a.path("safe.bin"), safe)
    assert read_file(b.path("safe.bin")) == safe  # uploaded: B fetched it from the bucket
    faults.write_text('{"outage": true}')
    held = os.urandom(3 << 20)
    with open(a.path("held.bin"), "wb") as f:
        f.write(held)
        f.flush()
        os.fsync(f.fileno())  # acknowledged: on A's NVMe, published as held by A
    # Both nodes keep creating files; A dies in the middle of it, B goes on.
    closed: dict[str, list[str]] = {"a": [], "b": []}
    errors: list[str] = []
    stop = threading.Event()

    def writer(m, tag):
        n = 0
        while not stop.is_set():
            name = f"{tag}{n:05d}"
            try:
                write_file(m.path("load", name), name.encode() * 100)
            except OSError as e:
                if tag == "b":
                    errors.append(f"{name}: {e}")
                return  # A's daemon is gone
            closed[tag].append(name)
            n += 1
    os.mkdir(a.path("load"))
    threads = [threading.Thread(target=writer, args=(m, tag)) for m, tag in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(closed["a"]) >= 20 and len(closed["b"]) >= 20, 60,
                   "both nodes writing")
        a.kill9()
        done_b = len(closed["b"])
        wait_until(lambda: len(closed["b"]) >= done_b + 50 or errors, 60, "B writing on")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:5]
    wait_until(lambda: "ended the expired session" in b.log(), 30, "B to end A's session")
    with pytest.raises(OSError) as e:
        read_file(b.path("held.bin"))
    assert e.value.errno == errno.EIO
    assert "never uploaded" in b.log() and "which is gone" in b.log()
    write_file(b.path("after.bin"), b"B still works")  # the others keep working
    assert read_file(b.path("safe.bin")) == safe
    faults.write_text("{}")
    a.start()
    wait_until(lambda: _reads(b.path("held.bin")) == held, 60,
               "A's acknowledged data to reach B after A mounted again")
    # Every file whose close() returned on A before it died.
    wait_until(lambda: all(_reads(b.path("load", n)) == n.encode() * 100 for n in closed["a"]),
               60, "A's closed files to reach B", interval=0.5)
    for name in closed["b"]:
        assert read_file(a.path("load", name)) == name.encode() * 100, name
    assert read_file(a.path("after.bin")) == b"B still works"
    r = b.cli("fsck", s3_url, "--meta-url", url)
    assert r.returncode == 0, r.stdout + r.stderr
    a.allowed_log = b.allowed_log = [r"never uploaded", r"upload of .* failed",
                                     r"reads fail with EIO", r"read failed"]


def _reads(path: str) -> bytes | None:
    try:
        return read_file(path)
    except OSError:
        return None


def test_database_restart_during_metadata_load(nodes, postgres):
    """PostgreSQL restarts while two nodes create files: requests wait and go on,
    every create that succeeded is there afterwards, on every node."""
    a, b, c = nodes
    os.mkdir(a.path("load"))
    made: list[str] = []
    errors: list[str] = []
    stop = threading.Event()

    def create(m, tag):
        n = 0
        while not stop.is_set() and n < 2000:
            name = f"{tag}{n}"
            try:
                write_file(m.path("load", name), name.encode())
                made.append(name)
            except OSError as e:
                errors.append(f"{name}: {e}")
            n += 1
    threads = [threading.Thread(target=create, args=(m, t)) for m, t in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    wait_until(lambda: len(made) >= 50, 60, "creates before the restart")
    postgres.stop()
    postgres.start()
    count = len(made)
    wait_until(lambda: len(made) >= count + 50, 60, "creates after the restart")
    stop.set()
    for t in threads:
        t.join(120)
    assert not errors, errors[:5]
    for m in nodes:
        names = set(os.listdir(m.path("load")))
        assert set(made) <= names
    for name in random.Random(1).sample(made, 20):
        assert read_file(c.path("load", name)) == name.encode()


@pytest.fixture
def own_postgres():
    """A server of this test's own, to pause (the session's serves others); set up
    before the mounts, so it outlives them."""
    with pg_server() as server:
        yield server


def test_a_database_that_stops_answering_fails_requests_then_work_resumes(
        own_postgres, mount_factory, s3_url, s3_endpoint):
    """The server keeps its connections open and answers nothing (frozen, stuck on its
    disk): a request that needs it fails with EIO after --meta-timeout instead of
    waiting for ever; once it answers again the mount works, and what was written
    before is there."""
    m = mount_factory(cold_url=s3_url, env=dict(os.environ, **s3_env(s3_endpoint)),
                      args=("--meta-url", own_postgres.new_schema(), "--meta-timeout", "3"))
    m.allowed_log.append(DATABASE_AWAY)
    write_file(m.path("kept"), b"kept")  # its upload and publication meet the silence
    outcome: list = []

    def look_up_a_new_name():
        try:
            os.stat(m.path("never-seen"))
            outcome.append("found")
        except OSError as e:
            outcome.append(e.errno)
    own_postgres.pause()
    try:
        probe = threading.Thread(target=look_up_a_new_name, daemon=True)
        probe.start()
        probe.join(60)
        assert not probe.is_alive(), "a lookup waited for the silent database without a bound"
    finally:
        own_postgres.resume()
    assert outcome == [errno.EIO]
    assert read_file(m.path("kept")) == b"kept"
    write_file(m.path("after"), b"after")
    assert sorted(os.listdir(m.mountpoint)) == ["after", "kept"]
    m.umount()


def test_close_and_umount_while_the_database_does_not_answer_lose_nothing(
        own_postgres, mount_factory, s3_url, s3_endpoint):
    """A file is closed while the server does not answer: close() fails with EIO (its
    data is not published, nor uploaded: an object id comes from the database), then
    umount ends within its bounds and says what is not in the bucket; the next mount
    uploads and publishes it, and another node reads it."""
    env = dict(os.environ, **s3_env(s3_endpoint))
    args = ("--meta-url", own_postgres.new_schema(), "--meta-timeout", "2")
    a = mount_factory(cold_url=s3_url, env=env, name="a",
                      args=(*args, "--unmount-upload-timeout", "6"))
    a.allowed_log.append(DATABASE_AWAY)
    data = os.urandom(1024 * 1024 + 5)
    f = written_open(a.path("f"), data)
    own_postgres.pause()
    try:
        close_fails_with_eio(f)
        res = a.cli("umount", a.mountpoint, timeout=120)
    finally:
        own_postgres.resume()
    a.pid = None
    assert res.returncode == 3, res.stderr
    assert "is not in the bucket yet" in res.stderr and "uploads on the next mount" in res.stderr
    assert not a.mounted
    a.start()
    a.cli("sync", a.mountpoint, "--wait", check=True)
    b = mount_factory(cold_url=s3_url, env=env, name="b", args=args)
    assert read_file(b.path("f")) == data


def test_an_outage_longer_than_the_session_timeout_ends_no_session(nodes, postgres):
    """PostgreSQL is away longer than the session timeout (8 s against 6 s), so every
    heartbeat is that old when it returns; no node ends another's session for it:
    each judges others only after a whole timeout of its own heartbeats on time.
    Afterwards every node still writes, and sees what the others wrote."""
    def checks():
        return [status(m)["counters"].get("session_checks", 0) for m in nodes]
    wait_until(lambda: min(checks()) >= 1, 60, "each node to judge sessions once")
    before = checks()
    postgres.stop()
    try:
        time.sleep(8)  # the outage itself: it must outlast the 6 s timeout
    finally:
        postgres.start()
    # Each node completes two more checks: at least one of them wholly after the outage.
    wait_until(lambda: all(now >= then + 2 for now, then in zip(checks(), before)), 60,
               "checks after the outage", interval=0.5)
    for m in nodes:
        assert "ended the expired session" not in m.log()
        assert "taken over" not in m.log()
    for i, m in enumerate(nodes):
        write_file(m.path(f"after{i}"), b"%d" % i)
    for m in nodes:
        assert [read_file(m.path(f"after{i}")) for i in range(NODES)] == [b"0", b"1", b"2"]


def test_distributed_checkpoint_from_three_ranks(mount_factory, s3_url, s3_endpoint,
                                                 postgres):
    """torch.distributed.checkpoint saves from three ranks (gloo, CPU), each through
    its own mount into one directory; a fourth mount loads every tensor back."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("numpy")  # torch.distributed's gather_object needs it
    import socket
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp

    from tests.fuse import dcp_rank
    env = dict(os.environ, **s3_env(s3_endpoint))
    args = ("--meta-url", postgres.new_schema())
    mounts = [mount_factory(cold_url=s3_url, env=env, name=f"r{i}", args=args)
              for i in range(4)]
    os.mkdir(mounts[0].path("ckpt"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = [subprocess.Popen([sys.executable, dcp_rank.__file__, str(r), "3", port,
                               mounts[r].path("ckpt")], stderr=subprocess.PIPE, text=True)
             for r in range(3)]
    for p in ranks:
        _out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    names = sorted(os.listdir(mounts[3].path("ckpt")))
    assert ".metadata" in names and len([n for n in names if n.endswith(".distcp")]) == 3
    want = {k: v for r in range(3) for k, v in dcp_rank.state(r).items()}
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, checkpoint_id=mounts[3].path("ckpt"))
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _state(path: str) -> dict:
    import json
    return json.loads(os.getxattr(path, "user.tierfs.state"))


def test_tiering_commands_on_a_shared_namespace(nodes):
    """sync --wait, prefetch, the state xattr and tierfs.open work on every node;
    hot bytes are each node's own."""
    import tierfs
    a, b, _c = nodes
    data = os.urandom(6 << 20)
    write_file(a.path("f.bin"), data)
    a.cli("sync", "--wait", a.mountpoint, check=True)
    assert _state(a.path("f.bin"))["dirty"] == 0
    assert _state(b.path("f.bin"))["hot"] == 0  # B never read it
    b.cli("prefetch", b.path("f.bin"), check=True)
    assert _state(b.path("f.bin"))["hot"] == len(data)
    with tierfs.open(b.path("f.bin"), "rb") as f:  # falls back to the mount
        assert f.read() == data
    with tierfs.open(b.path("g.bin"), "wb") as f:
        f.write(b"written on B")
    assert read_file(a.path("g.bin")) == b"written on B"


def _refused(m, *args) -> str:
    r = m.cli("mount", m.cold_url, m.mountpoint, "--cache-dir", m.cache_dir, *args)
    assert r.returncode != 0 and not m.mounted
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_mixing_engines_is_refused(mount_factory, postgres, tmp_path):
    """A one-node (LMDB) filesystem is not mounted with --meta-url over a database
    that lacks it, nor a shared one without; a cache dir serves one kind only."""
    url = postgres.new_schema()
    lmdb_fs = mount_factory(name="one")
    lmdb_fs.allowed_log = [r"whose namespace is not in this database",
                           r"use an empty --cache-dir with --meta-url"]
    write_file(lmdb_fs.path("x"), b"x")
    lmdb_fs.umount()
    assert "tierfs dump" in _refused(lmdb_fs, "--meta-url", url)
    shared = mount_factory(name="many", args=("--meta-url", url))
    shared.umount()
    shared.allowed_log = [r"kept in a shared database"]
    shared.args = []
    assert "--meta-url" in _refused(shared)
    other = mount_factory(name="other", start=False)
    other.cold_url = shared.cold_url
    other.cache_dir = lmdb_fs.cache_dir  # holds another filesystem's LMDB namespace
    other.allowed_log = lmdb_fs.allowed_log  # the same log
    assert "cache dir" in _refused(other, "--meta-url", url)
    shared.args = ["--meta-url", url]
    shared.start()
    assert os.listdir(shared.mountpoint) == []


def test_a_node_that_lost_its_cache_dir_mounts_again(nodes):
    """B's NVMe is replaced: an empty cache dir mounts the same namespace and reads
    every file from the bucket; what B wrote before is there."""
    import shutil
    a, b, _c = nodes
    write_file(a.path("from-a"), b"a" * 100_000)
    write_file(b.path("from-b"), b"b" * 100_000)
    b.cli("sync", "--wait", b.mountpoint, check=True)
    b.umount()
    shutil.rmtree(b.cache_dir)
    b.start()
    assert read_file(b.path("from-a")) == b"a" * 100_000
    assert read_file(b.path("from-b")) == b"b" * 100_000
    # Fetched into the new hot tier: a reader has its bytes before the install ends.
    wait_until(lambda: _state(b.path("from-b"))["hot"] == 100_000, 30,
               "the fetched file to be installed in the new hot tier")


def _gc_queue(m) -> set[int]:
    """Object ids in a live node's own gc table (LMDB allows a second reader)."""
    import lmdb
    env = lmdb.open(os.path.join(m.cache_dir, "meta"), readonly=True, subdir=True,
                    max_dbs=0)
    try:
        with env.begin() as txn:
            return {schema.read_u64(k, 1) for k, _v in txn.cursor()
                    if k[:1] == b"G"}
    finally:
        env.close()


def test_an_object_a_file_names_again_is_not_deleted(mount_factory, s3_url, s3_endpoint,
                                                     postgres):
    """B holds a file open; A rewrites it (its objects go to gc); B then changes one
    extent and closes, so the file is B's version again, whose other extent names
    the object A's rewrite dropped. That object must leave every gc queue, the
    shared one and A's own: deleting it loses the file's data."""
    env = dict(os.environ, **s3_env(s3_endpoint))
    url = postgres.new_schema()
    args = ("--meta-url", url, "--session-timeout", "6", "--extent-size", "1M")
    a = mount_factory(cold_url=s3_url, env=env, name="a", args=args)
    b = mount_factory(cold_url=s3_url, env=env, name="b", args=args)
    first = os.urandom(2 * MiB)
    write_file(b.path("f"), first)
    b.cli("sync", b.path("f"), "--wait", check=True)
    assert read_file(a.path("f")) == first  # A's copy names B's objects
    fd = os.open(b.path("f"), os.O_RDWR)
    try:
        write_file(a.path("f"), os.urandom(2 * MiB))  # O_TRUNC: A drops B's objects
        a.cli("sync", a.path("f"), "--wait", check=True)
        os.pwrite(fd, b"B", MiB + 10)
    finally:
        os.close(fd)  # B publishes its version: extent 0 names its first object again
    b.cli("sync", b.path("f"), "--wait", check=True)
    store = MetaStore(url)
    try:
        ino = os.stat(b.path("f")).st_ino
        named = {e.obj_id for e in store.file_view(ino)[1].values() if e.obj_id}
        shared_gc = {obj for obj, _epoch in store.gc_pending()}
    finally:
        store.close()
    assert named and not named & shared_gc, "the shared gc would delete the file's data"
    assert not named & _gc_queue(a), "A's own gc would delete the file's data"
    want = bytearray(first)
    want[MiB + 10] = ord("B")
    assert read_file(a.path("f")) == bytes(want)


def _feed_backend(postgres, m, listening: bool = False) -> int | None:
    """The server process of a node's change feed connection (LISTEN done, if asked)."""
    import psycopg
    with psycopg.connect(postgres.url("postgres"), autocommit=True) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s"
            " AND (NOT %s OR (state = 'idle' AND query LIKE 'LISTEN%%'))",
            (f"tierfs feed % pid {m.pid}", listening)).fetchone()
    return row[0] if row else None


def test_names_changed_while_the_feed_was_away_are_not_kept(nodes, postgres):
    """B's change feed loses its connection and cannot come back at once; meanwhile A
    replaces a file B has looked up (rename over it, as an atomic update does). Once
    the feed is back, B's kernel must not keep the old name for --attr-timeout: it
    opens the new file, not the one the name used to be."""
    a, b, _c = nodes
    write_file(a.path("f"), b"old")
    write_file(a.path("f.tmp"), b"new")
    write_file(a.path("g"), b"g")
    assert read_file(b.path("f")) == b"old"  # B's kernel holds the name f
    assert os.stat(b.path("g")).st_size == 1
    os.stat(a.path("f.tmp"))  # A's pooled connections stay open for its rename
    feed = _feed_backend(postgres, b)
    assert feed is not None
    postgres.sql("ALTER DATABASE tierfs ALLOW_CONNECTIONS false", "postgres")
    try:
        postgres.sql(f"SELECT pg_terminate_backend({feed})", "postgres")
        wait_until(lambda: "change feed lost its connection" in b.log(), 30,
                   "B's feed to notice its connection is gone")
        os.rename(a.path("f.tmp"), a.path("f"))  # no notification reaches B
    finally:
        postgres.sql("ALTER DATABASE tierfs ALLOW_CONNECTIONS true", "postgres")
    wait_until(lambda: _feed_backend(postgres, b, listening=True), 30, "B's feed back")
    # A later change B hears of: by then B has handled the feed's return as well.
    write_file(a.path("g"), b"gg")
    wait_until(lambda: os.stat(b.path("g")).st_size == 2, 30, "B to hear of g")
    assert os.stat(b.path("f")).st_ino == os.stat(a.path("f")).st_ino
    assert read_file(b.path("f")) == b"new"
    b.allowed_log.append("change feed lost its connection")


def test_a_feed_whose_server_stops_answering_comes_back(mount_factory, s3_url, s3_endpoint,
                                                        postgres):
    """B's change feed connection stays open but nothing comes through it any more
    (its server process stuck; a firewall or NAT that dropped the idle connection
    does the same). B must notice and listen again, not stay deaf for good while
    the kernel caches what it was told (here for an hour)."""
    env = dict(os.environ, **s3_env(s3_endpoint))
    args = ("--meta-url", postgres.new_schema(), "--meta-timeout", "2",
            "--attr-timeout", "3600")
    a = mount_factory(cold_url=s3_url, env=env, name="a", args=args)
    write_file(a.path("g"), b"g")
    # B starts after that change: no notification of it can race B's lookup (which
    # would answer the kernel uncached), so B's kernel holds g's size for the hour.
    b = mount_factory(cold_url=s3_url, env=env, name="b", args=args)
    wait_until(lambda: _feed_backend(postgres, b, listening=True), 30, "B's feed")
    assert os.stat(b.path("g")).st_size == 1
    with postgres.frozen_backends(feed_connection(b)):
        write_file(a.path("g"), b"gg")
        wait_until(lambda: os.stat(b.path("g")).st_size == 2, 60,
                   "B's feed to listen again and drop what B's kernel caches")
    b.allowed_log.append("change feed lost its connection")


def _local_records(m, ino: int) -> list[bytes]:
    """The keys a live node's own LMDB holds for an inode (its record, its extents)."""
    import lmdb
    env = lmdb.open(os.path.join(m.cache_dir, "meta"), readonly=True, subdir=True,
                    max_dbs=0)
    try:
        with env.begin() as txn:
            return [k for k, _v in txn.cursor() if k == schema.inode_key(ino)
                    or k.startswith(schema.extent_prefix(ino))]
    finally:
        env.close()


def test_a_file_purged_by_another_node_leaves_no_copy_here(nodes):
    """B read a file (its records and a hot copy are in B's cache dir); A removes it.
    B's copy goes too: records and hot copies of files gone from the namespace must
    not pile up on every node that once read them."""
    a, b, _c = nodes
    data = os.urandom(MiB)
    write_file(a.path("f"), data)
    assert read_file(b.path("f")) == data
    ino = os.stat(b.path("f")).st_ino
    assert _local_records(b, ino) and status(b)["hot_extents"] == 1
    os.unlink(a.path("f"))
    wait_until(lambda: not _local_records(b, ino), 30, "B to drop its copy of the file")
    assert status(b)["hot_extents"] == 0


def test_a_close_that_could_not_publish_is_published_once_the_database_is_back(
        own_postgres, mount_factory, s3_url, s3_endpoint):
    """A's close() meets a database that does not answer: EIO, the file's new size
    is not published. Once the database answers again A publishes it by itself, so B
    sees what A closed, not the empty file, without waiting for A's next close,
    upload (an hour away here) or mount."""
    env = dict(os.environ, **s3_env(s3_endpoint))
    args = ("--meta-url", own_postgres.new_schema(), "--meta-timeout", "2",
            "--upload-delay", "3600")
    a = mount_factory(cold_url=s3_url, env=env, name="a", args=args)
    b = mount_factory(cold_url=s3_url, env=env, name="b", args=args)
    # B's own requests (its heartbeat) may meet the outage too, and must say so.
    a.allowed_log.append(DATABASE_AWAY)
    b.allowed_log.append(DATABASE_AWAY)
    data = os.urandom(100_000)
    f = written_open(a.path("f"), data)
    own_postgres.pause()
    try:
        close_fails_with_eio(f)
    finally:
        own_postgres.resume()
    wait_until(lambda: _reads(b.path("f")) == data, 60, "A's closed file to reach B")
