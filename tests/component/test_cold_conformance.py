"""One behaviour contract for every cold store, then store-specific checks.

The S3 store runs against a real moto server subprocess (started once per
session, only if an S3 test is selected); each test gets its own bucket.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from tests.moto_server import free_port, make_bucket, moto_server
from tierfs.cold import ObjectStore, open_store, parse_cold_url
from tierfs.cold.faulty import FaultyStore
from tierfs.cold.file import TMP_SUFFIX, FileStore
from tierfs.cold.memory import MemoryStore
from tierfs.errors import (ColdConfigError, ColdStoreError, ObjectNotFound, PreconditionFailed,
                           UserError)

MiB = 1024 * 1024
KEY = "data/000000000000002a"


# -- fixtures ------------------------------------------------------------


@pytest.fixture(scope="session")
def moto_endpoint():
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def moto_ranges_endpoint():
    """The benchmark's variant of moto that reads only the range of a ranged GET: it
    must keep the store contract."""
    with moto_server(ranges=True) as endpoint:
        yield endpoint


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Test credentials only: nothing from the machine's AWS config leaks in."""
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture
def bucket(moto_endpoint, aws_env):
    name = f"tierfs-{uuid.uuid4().hex[:16]}"
    make_bucket(moto_endpoint, name)
    return name


@pytest.fixture(params=["memory", "file", "faulty", "s3", "s3-ranges"])
def make_store(request, tmp_path):
    """Return make(namespace) -> store; namespaces share a backend where it has one."""
    kind = request.param
    if kind == "memory":
        stores: dict[str, MemoryStore] = {}
        return lambda ns="main": stores.setdefault(ns, MemoryStore())
    if kind == "file":
        (tmp_path / "cold").mkdir()  # check() creates the store dir only when its parent exists
        return lambda ns="main": FileStore(str(tmp_path / "cold" / ns))
    if kind == "faulty":
        return lambda ns="main": FaultyStore(MemoryStore(), seed=1)
    if kind == "s3-ranges":
        endpoint = request.getfixturevalue("moto_ranges_endpoint")
        request.getfixturevalue("aws_env")
        name = f"tierfs-{uuid.uuid4().hex[:16]}"
        make_bucket(endpoint, name)
    else:
        endpoint = request.getfixturevalue("moto_endpoint")
        name = request.getfixturevalue("bucket")
    # Nested prefixes in one bucket; "main" and "main2" share a string prefix on purpose.
    from tierfs.cold.s3 import S3Store

    return lambda ns="main": S3Store(name, f"pre/{ns}", endpoint=endpoint)


@pytest.fixture
def store(make_store):
    return make_store()


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


# -- conformance -----------------------------------------------------------


def test_is_object_store(store):
    assert isinstance(store, ObjectStore)
    assert store.describe()


@pytest.mark.parametrize("n", [0, 1, 4096, 9 * MiB])
def test_round_trip(store, n):
    data = payload(n, seed=n)
    store.put(KEY, data)
    assert store.get(KEY) == data
    assert store.size(KEY) == n


@pytest.mark.parametrize("n", [0, 1, 3 * MiB + 5])
def test_put_file_and_get_file_round_trip(store, tmp_path, n):
    """Objects as large as the metadata (checkpoints) move between the bucket and a
    local file in pieces: put_file sends the file from its position, get_file writes
    the object from an offset, and both give what put and get would."""
    data = payload(n, seed=n)
    src = tmp_path / "src"
    src.write_bytes(b"skipped" + data)
    with open(src, "rb") as f:
        f.seek(len(b"skipped"))
        store.put_file(KEY, f)
    assert store.get(KEY) == data
    with open(tmp_path / "dst", "w+b") as f:
        f.write(b"kept")
        assert store.get_file(KEY, f) == n
        assert store.get_file(KEY, f, 2) == max(0, n - 2)
        assert store.get_file(KEY, f, n + 10) == 0
    assert (tmp_path / "dst").read_bytes() == b"kept" + data + data[2:]


def test_get_file_of_missing_raises_not_found(store, tmp_path):
    with open(tmp_path / "dst", "wb") as f, pytest.raises(ObjectNotFound):
        store.get_file("data/missing", f)


def test_ranged_get(store):
    data = payload(1024)
    store.put(KEY, data)
    assert store.get(KEY, 100, 50) == data[100:150]  # middle
    assert store.get(KEY, 1000) == data[1000:]  # to end
    assert store.get(KEY, 1023, 1) == data[1023:]  # last byte
    assert store.get(KEY, 1000, 100) == data[1000:]  # runs past end
    assert store.get(KEY, 1024) == b""  # starts at end
    assert store.get(KEY, 5000, 10) == b""  # starts beyond end
    assert store.get(KEY, 10, 0) == b""
    assert store.get(KEY, 0, None) == data


def test_ranged_get_of_empty_object(store):
    store.put(KEY, b"")
    assert store.get(KEY, 0, 10) == b""
    assert store.get(KEY, 5) == b""


def test_overwrite_replaces_whole_object(store):
    store.put(KEY, payload(3000, seed=1))
    new = payload(1000, seed=2)
    store.put(KEY, new)
    assert store.get(KEY) == new
    assert store.size(KEY) == 1000


def test_put_if_writes_only_over_the_version_read(store):
    """The writer lease's compare-and-swap: a write conditional on the version read
    (or on there being none) fails once anyone wrote the object in between."""
    store.put_if(KEY, b"first", None)                  # only if missing: created
    with pytest.raises(PreconditionFailed):
        store.put_if(KEY, b"second", None)             # it is there now
    data, v1 = store.get_versioned(KEY)
    assert data == b"first"
    store.put_if(KEY, b"third", v1)                    # still at v1: written
    data, v2 = store.get_versioned(KEY)
    assert data == b"third" and v2 != v1
    with pytest.raises(PreconditionFailed):
        store.put_if(KEY, b"fourth", v1)               # v1 is gone
    store.put(KEY, b"fifth")                           # anyone's plain write
    with pytest.raises(PreconditionFailed):
        store.put_if(KEY, b"sixth", v2)
    assert store.get(KEY) == b"fifth"
    store.delete(KEY)
    with pytest.raises(PreconditionFailed):
        store.put_if(KEY, b"seventh", v2)              # deleted since
    with pytest.raises(ObjectNotFound):
        store.get_versioned(KEY)


def test_get_missing_raises_not_found(store):
    with pytest.raises(ObjectNotFound):
        store.get("data/missing")
    with pytest.raises(ObjectNotFound):
        store.get("data/missing", 10, 5)
    with pytest.raises(ObjectNotFound):
        store.get("data/missing", 0, 0)
    assert store.size("data/missing") is None


def test_delete_is_idempotent(store):
    store.put(KEY, b"x")
    store.delete(KEY)
    store.delete(KEY)
    store.delete("data/never-existed")
    with pytest.raises(ObjectNotFound):
        store.get(KEY)
    assert store.size(KEY) is None
    assert store.list() == []


def test_list_sorted_and_filtered_by_prefix(store):
    keys = ["data/0002", "meta/x", "data/0001", "dat", "data/sub/3"]
    for k in keys:
        store.put(k, k.encode())
    assert store.list() == sorted(keys)
    assert store.list("data/") == ["data/0001", "data/0002", "data/sub/3"]
    assert store.list("dat") == ["dat", "data/0001", "data/0002", "data/sub/3"]
    assert store.list("data/sub/") == ["data/sub/3"]
    assert store.list("nope/") == []
    assert store.list("data/0001") == ["data/0001"]


def test_list_isolated_between_prefixes(make_store):
    a, b = make_store("main"), make_store("main2")
    a.put("data/1", b"a")
    b.put("data/2", b"b")
    assert a.list() == ["data/1"]
    assert b.list() == ["data/2"]
    assert a.get("data/1") == b"a"
    with pytest.raises(ObjectNotFound):
        a.get("data/2")


def test_check_ok_and_leaves_nothing(store):
    store.check()
    store.check()  # repeatable
    assert store.list() == []


@pytest.mark.parametrize("make_store", ["file", "s3"], indirect=True)
def test_checks_of_one_location_at_once_all_pass(make_store):
    """Nodes that mount one location at once (a shared namespace starting on every
    node of a job) check it at once: here a second node's whole check runs between
    the probe write and read of the first's. Before, both probed one key, and the
    first found the probe the second had deleted: its mount was refused ("cannot
    use ...: object '.tierfs-probe' not found")."""
    first, second = make_store(), make_store()
    put = first.put

    def put_then_other_check(key, data):
        put(key, data)
        second.check()

    first.put = put_then_other_check
    first.check()
    assert first.list() == []


def test_a_probe_left_in_an_empty_location_does_not_make_it_foreign(tmp_path):
    """A location holding only a check's probe (another node checking it this moment,
    or one that died in its check) is empty to a first mount, not "data that is not
    a tierfs filesystem"."""
    from tierfs.cold.base import PROBE_KEY
    from tierfs.filesystem import read_superblock

    store = FileStore(str(tmp_path))
    store.put(PROBE_KEY + ".0123", b"tierfs probe")
    assert read_superblock(store) is None


# -- file store --------------------------------------------------------------


def _all_files(root) -> set[str]:
    return {
        os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
        for d, _, files in os.walk(root)
        for f in files
    }


def test_file_put_leaves_no_temp_files(tmp_path):
    s = FileStore(str(tmp_path))
    for i in range(5):
        s.put(f"data/{i:04d}", payload(100, seed=i))
    s.put("data/0001", b"again")
    assert _all_files(tmp_path) == {f"data/{i:04d}" for i in range(5)}
    assert not any(f.endswith(TMP_SUFFIX) for f in _all_files(tmp_path))


def test_file_list_hides_temp_files(tmp_path):
    s = FileStore(str(tmp_path))
    s.put("data/1", b"x")
    (tmp_path / "data" / f"1.abc{TMP_SUFFIX}").write_bytes(b"partial")  # a crashed put
    assert s.list() == ["data/1"]


def test_file_put_atomic_under_concurrent_reads(tmp_path):
    s = FileStore(str(tmp_path))
    a, b = payload(MiB, seed=1), payload(MiB, seed=2)
    s.put(KEY, a)
    done = threading.Event()
    bad: list[str] = []
    reads = 0

    def reader():
        nonlocal reads
        while not done.is_set():
            got = s.get(KEY)
            reads += 1
            if got not in (a, b):
                bad.append(f"partial object: {len(got)} bytes")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(60):
            s.put(KEY, a if i % 2 else b)
    finally:
        done.set()
        t.join()
    assert bad == []
    assert reads > 0


def test_file_check_creates_directory(tmp_path):
    root = tmp_path / "cold"
    FileStore(str(root)).check()
    assert root.is_dir()
    assert _all_files(root) == set()


def test_file_check_missing_parent(tmp_path):
    parent = tmp_path / "no" / "such"
    with pytest.raises(ColdConfigError) as e:
        FileStore(str(parent / "cold")).check()
    msg = str(e.value)
    assert str(parent) in msg and "\n" not in msg


def test_file_check_root_is_a_file(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(ColdConfigError, match="not a directory"):
        FileStore(str(tmp_path / "f")).check()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_file_check_not_writable(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        with pytest.raises(ColdConfigError, match=str(root)):
            FileStore(str(root)).check()
    finally:
        root.chmod(0o755)


def test_file_store_syncs_the_entries_of_the_directories_it_creates(tmp_path, monkeypatch):
    """A new directory survives a power cut only once its entry in its parent is synced:
    without that, the cold location, or a new data/ directory with every object the
    metadata already calls uploaded, may be gone after the reboot."""
    import tierfs.cold.file as file_store

    synced = []

    def fsync_dir(path):
        synced.append(path)
        real_fsync_dir(path)

    real_fsync_dir = file_store.fsync_dir
    monkeypatch.setattr(file_store, "fsync_dir", fsync_dir)
    root = tmp_path / "cold"
    store = FileStore(str(root))
    store.check()
    assert str(tmp_path) in synced  # the location's own entry
    synced.clear()
    store.put("data/00/0000000000000001", b"uploaded")
    for created in (root / "data", root / "data" / "00"):
        assert str(created.parent) in synced, created
    synced.clear()
    store.put_if("meta/lease", b"x", None)
    assert str(root) in synced


def test_file_location_under_an_unmounted_fstab_mount_point_is_refused(tmp_path, monkeypatch):
    """The share a file:// location lives on is not mounted (yet): its empty mount point
    directory is on the local disk, and a new filesystem made there would be hidden
    once the share is mounted. Refused, saying which mount point to mount."""
    import tierfs.cold.file as file_store

    share = tmp_path / "share"
    share.mkdir()
    fstab = tmp_path / "fstab"
    fstab.write_text(f"# a comment\n/ / ext4 defaults 0 1\n"
                     f"nas:/export {share} nfs defaults,_netdev 0 0\n")
    monkeypatch.setattr(file_store, "FSTAB", str(fstab))
    for root in (share, share / "fs"):
        with pytest.raises(ColdConfigError) as e:
            FileStore(str(root)).check()
        msg = str(e.value)
        assert f"{share}, a mount point in {fstab} that is not mounted" in msg, msg
        assert "\n" not in msg
    assert list(share.iterdir()) == []  # nothing made on the disk beneath it
    fstab.write_text("/ / ext4 defaults 0 1\n")  # only mounted ones: fine
    FileStore(str(share / "fs")).check()


def test_file_store_never_recreates_a_location_gone_after_check(tmp_path):
    """The share under the location is unmounted while the daemon runs: an upload must
    fail (and be retried), not land on the disk beneath, where the metadata would call
    it uploaded and the share, once back, would not have it."""
    share = tmp_path / "share"
    store = FileStore(str(share / "fs"))
    share.mkdir()
    store.check()
    store.put("data/1", b"on the share")
    (share / "fs").rename(tmp_path / "elsewhere")  # the share went away
    for put in (lambda: store.put("data/2", b"x"), lambda: store.put_if("lease.json", b"x", None)):
        with pytest.raises(ColdStoreError, match="is it mounted") as e:
            put()
        assert e.value.transient
    assert list(share.iterdir()) == []


def test_file_store_takes_a_location_gone_after_check_for_an_outage(tmp_path):
    """The location vanishes while the daemon runs (the share unmounted, the directory
    moved away): reads, deletes, lists and sizes are transient errors, retried until it
    is back, never the answers of an empty bucket: "not found" would fail reads as data
    lost and free a lease held elsewhere, a delete would be forgotten, an empty list
    would look like a bucket without checkpoints."""
    location = tmp_path / "fs"
    store = FileStore(str(location))
    store.check()
    store.put("data/1", b"on the share")
    location.rename(tmp_path / "elsewhere")  # the share went away
    calls = {
        "get": lambda: store.get("data/1"),
        "get_file": lambda: store.get_file("data/1", io.BytesIO()),
        "get_versioned": lambda: store.get_versioned("lease.json"),
        "delete": lambda: store.delete("data/1"),
        "list": lambda: store.list("data/"),
        "size": lambda: store.size("data/1"),
    }
    for name, call in calls.items():
        with pytest.raises(ColdStoreError, match="is it mounted") as e:
            call()
        assert e.value.transient and not isinstance(e.value, ObjectNotFound), name
    (tmp_path / "elsewhere").rename(location)  # back
    assert store.list("data/") == ["data/1"]
    assert store.get("data/1") == b"on the share"  # the delete while gone did nothing
    store.delete("data/1")
    assert store.list("data/") == []


@contextlib.contextmanager
def mounted(*args: str):
    """mount ARGS...; the last one, the mount point, is unmounted at the end if it still is."""
    subprocess.run(["mount", *args], check=True)
    try:
        yield
    finally:
        if os.path.ismount(args[-1]):
            subprocess.run(["umount", args[-1]], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a share needs root")
@pytest.mark.parametrize("below", ["", "fs"])
def test_file_store_takes_a_share_unmounted_under_it_for_an_outage(tmp_path, below):
    """The location is the root of a share (below="") or a directory on it whose name is
    also on the disk beneath (made there before the share was first mounted): once the
    share is unmounted the directory beneath is there, empty. Every call is a transient
    error until the share is back, never a put on the local disk (hidden once the share
    is back, though the metadata calls it uploaded) nor an answer from an empty bucket."""
    server, share = tmp_path / "server", tmp_path / "share"
    (share / "fs").mkdir(parents=True)  # the mount point, and a directory beneath the share
    server.mkdir()
    with mounted("-t", "tmpfs", "-o", "size=4m", "tmpfs", str(server)):
        (server / "fs").mkdir()
        with mounted("--bind", str(server), str(share)):  # the share's export, mounted
            store = FileStore(str(share / below))
            store.check()
            store.put("data/1", b"on the share")
            subprocess.run(["umount", str(share)], check=True)  # the share went away
            calls = {
                "put": lambda: store.put("data/2", b"x"),
                "put_if": lambda: store.put_if("lease.json", b"x", None),
                "get": lambda: store.get("data/1"),
                "delete": lambda: store.delete("data/1"),
                "list": lambda: store.list("data/"),
                "size": lambda: store.size("data/1"),
            }
            for name, call in calls.items():
                gone = re.escape(f"{share}, the filesystem") + ".* no longer mounted"
                with pytest.raises(ColdStoreError, match=gone) as e:
                    call()
                assert e.value.transient and not isinstance(e.value, ObjectNotFound), name
                assert "\n" not in str(e.value)
            assert [p.name for p in share.rglob("*")] == ["fs"]  # nothing on the disk beneath
        with mounted("--bind", str(server), str(share)):  # back
            assert store.get("data/1") == b"on the share"
            store.put("data/2", b"x")
            assert store.list("data/") == ["data/1", "data/2"]
        assert (server / below / "data" / "2").read_bytes() == b"x"


@pytest.mark.parametrize("key", ["", "/abs", "../x", "a//b", "a/./b", "x" + TMP_SUFFIX])
def test_file_rejects_bad_keys(tmp_path, key):
    with pytest.raises(ValueError):
        FileStore(str(tmp_path)).put(key, b"x")


# -- s3 store ------------------------------------------------------------------


def test_s3_check_missing_bucket(moto_endpoint, aws_env):
    from tierfs.cold.s3 import S3Store

    with pytest.raises(ColdConfigError) as e:
        S3Store("no-such-bucket-tierfs", "p", endpoint=moto_endpoint).check()
    msg = str(e.value)
    assert "'no-such-bucket-tierfs'" in msg and moto_endpoint in msg
    assert "aws s3 mb s3://no-such-bucket-tierfs" in msg


def test_s3_ops_on_missing_bucket_are_config_errors(moto_endpoint, aws_env):
    from tierfs.cold.s3 import S3Store

    s = S3Store("no-such-bucket-tierfs", endpoint=moto_endpoint)
    with pytest.raises(ColdConfigError, match="does not exist"):
        s.put(KEY, b"x")
    with pytest.raises(ColdConfigError, match="does not exist"):
        s.list()


def test_s3_unreachable_endpoint(aws_env):
    from tierfs.cold.s3 import S3Store

    endpoint = f"http://127.0.0.1:{free_port()}"  # bound then released: nothing listens
    s = S3Store("some-bucket", endpoint=endpoint, connect_timeout=1, read_timeout=1)
    start = time.monotonic()
    with pytest.raises(ColdConfigError) as e:
        s.check()
    assert time.monotonic() - start < 5
    assert endpoint in str(e.value) and "--s3-endpoint" in str(e.value)
    # Outside check() the same failure is transient, so callers retry it.
    with pytest.raises(ColdStoreError) as e2:
        s.get(KEY)
    assert e2.value.transient and not isinstance(e2.value, ColdConfigError)


@contextlib.contextmanager
def tcp_proxy(upstream: str, pump):
    """A TCP proxy to `upstream` (http://HOST:PORT): for each connection, two threads
    run pump(src, dst, answers, stop), one for the requests (answers False) and one
    for the answers. Yields its endpoint URL; closes everything at the end."""
    host, port = upstream.rsplit("//", 1)[1].split(":")
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    sockets, threads = [listener], []

    def accept():
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener closed
            server = socket.create_connection((host, int(port)))
            sockets.extend((client, server))
            for src, dst, answers in ((client, server, False), (server, client, True)):
                t = threading.Thread(target=pump, args=(src, dst, answers, stop), daemon=True)
                t.start()
                threads.append(t)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        acceptor.join()
        for t in threads:
            t.join()


def trickling_proxy(upstream: str, chunk: int = 64, pause: float = 0.05,
                    headers: bool = False):
    """A TCP proxy passing requests and the answers' headers through, then each body
    `chunk` bytes every `pause` seconds: a server or a network that trickles, never
    silent long enough for a socket timeout. `headers`: the headers trickle too."""
    def pump(src, dst, trickle: bool, stop):
        head = b""
        try:
            while not stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if trickle and head is not None and not headers:  # headers at once
                    head += data
                    if b"\r\n\r\n" not in head:
                        continue
                    cut = head.index(b"\r\n\r\n") + 4
                    dst.sendall(head[:cut])
                    data, head = head[cut:], None
                for i in range(0, len(data), chunk if trickle else len(data)):
                    if stop.wait(pause if trickle else 0):
                        return
                    dst.sendall(data[i:i + (chunk if trickle else len(data))])
        except OSError:
            pass  # either side closed

    return tcp_proxy(upstream, pump)


def cutting_proxy(upstream: str, cut: str | None, strip: bytes | None = None):
    """A TCP proxy that closes the connection partway through each answer: after its
    status line (cut="status") or after its headers (cut="body"), as a network or a
    middlebox that drops it there; None: the answers go through whole. `strip`: a
    request header it removes (b"Range"), as a middlebox that does not pass it on."""
    marker = b"\r\n" if cut == "status" else b"\r\n\r\n"

    def pump(src, dst, cutting: bool, stop):
        answer = b""
        try:
            while not stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if strip and not cutting:  # a request (headers in one piece here)
                    data = re.sub(rb"\r\n" + strip + rb":[^\r]*", b"", data, flags=re.I)
                if not cutting or cut is None:
                    dst.sendall(data)
                    continue
                answer += data
                if marker in answer:
                    dst.sendall(answer[:answer.index(marker) + len(marker)])
                    break
        except OSError:
            pass  # either side closed
        finally:
            if cutting:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_RDWR)

    return tcp_proxy(upstream, pump)


@pytest.mark.parametrize("cut, op", [("status", "size"), ("status", "get"),
                                     ("status", "get_versioned"), ("status", "list"),
                                     ("body", "list"), ("body", "get"),
                                     ("status", "get_range"), ("body", "get_range")])
def test_s3_answer_cut_short_is_a_transient_error(moto_endpoint, bucket, cut, op):
    """The connection drops partway through an answer. http.client takes headers that
    end with the connection for whole ones, and botocore a body shorter than its
    Content-Length for the whole body (it reads non-streamed bodies without that
    check): before, a HEAD raised KeyError (no ContentLength), a GET returned b"" for
    an object that holds data, a versioned GET raised KeyError (no ETag) and a LIST
    returned no keys. Each is now a transient error, retried like a reset."""
    from tierfs.cold.s3 import S3Store

    S3Store(bucket, endpoint=moto_endpoint).put(KEY, b"some data")
    with cutting_proxy(moto_endpoint, cut) as endpoint:
        s3 = S3Store(bucket, endpoint=endpoint, read_timeout=5)
        calls = {"size": lambda: s3.size(KEY), "get": lambda: s3.get(KEY),
                 "get_range": lambda: s3.get(KEY, 1, 5),
                 "get_versioned": lambda: s3.get_versioned(KEY), "list": s3.list}
        with pytest.raises(ColdStoreError) as e:
            calls[op]()
    assert e.value.transient, e.value
    assert "\n" not in str(e.value)


@contextlib.contextmanager
def keepalive_proxy(upstream: str, refuse_presigned: bool = False, slow_down: int = 0):
    """An HTTP/1.1 proxy for GETs that keeps each client's connection open between
    requests, as S3 does (moto's server closes its own after every answer). Yields
    its endpoint URL and a Counter of the connections clients opened ("connections"),
    the GETs ("gets") and those sent as presigned URLs ("presigned"). With
    `refuse_presigned`, those are answered 403, as under a bucket policy that allows
    only requests signed in their headers; the first `slow_down` GETs are answered
    503 SlowDown, as by a bucket under load."""
    import collections
    import http.client
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = collections.Counter()
    host, port = upstream.rsplit("//", 1)[1].split(":")

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            super().setup()
            seen["connections"] += 1

        def log_message(self, *args):
            pass

        def refuse(self, status: int, code: str):
            body = f"<Error><Code>{code}</Code></Error>".encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            seen["gets"] += 1
            presigned = "X-Amz-Signature=" in self.path
            seen["presigned"] += presigned
            if presigned and refuse_presigned:
                return self.refuse(403, "AccessDenied")
            if seen["gets"] <= slow_down:
                return self.refuse(503, "SlowDown")
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            try:
                conn.request("GET", self.path, headers=dict(self.headers))
                answer = conn.getresponse()
                body = answer.read()
            finally:
                conn.close()
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in ("connection", "content-length", "transfer-encoding"):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_s3_gets_are_presigned_and_reuse_their_connection(moto_endpoint, bucket):
    """A GET is one presigned request, sent without botocore's request and answer
    machinery (most of a GET's CPU in the daemon). Against a server that keeps
    connections open (S3 does), GETs one after another run on one connection: each
    body is read to its end and its connection goes back to the pool (a body left
    unfinished would cost a connection, over TLS a handshake, per GET)."""
    from tierfs.cold.s3 import S3Store

    data = payload(3 << 20)
    S3Store(bucket, endpoint=moto_endpoint).put(KEY, data)
    with keepalive_proxy(moto_endpoint) as (endpoint, seen):
        s3 = S3Store(bucket, endpoint=endpoint)
        for i in range(6):
            off = i * 100_003
            assert s3.get(KEY, off, 2 << 20) == data[off:off + (2 << 20)]
        assert s3.get(KEY, 100, 10) == data[100:110]
        assert s3.get(KEY) == data
        assert s3.get(KEY, len(data) - 5) == data[-5:]
        assert (seen["gets"], seen["presigned"]) == (9, 9)
        with tempfile.TemporaryFile() as f:  # into a file, its first bytes skipped
            assert s3.get_file(KEY, f, 1000) == len(data) - 1000
            f.seek(0)
            assert f.read() == data[1000:]
        assert s3.get(KEY, 5, 7) == data[5:12]
        assert seen["connections"] == 1


def test_s3_get_errors_are_named_by_boto3(moto_endpoint, bucket):
    """A presigned GET answered with an error is asked again through boto3, which
    names it: a missing object is ObjectNotFound, a range past the end is empty.
    Presigned GETs go on after such errors."""
    from tierfs.cold.s3 import S3Store

    S3Store(bucket, endpoint=moto_endpoint).put(KEY, b"0123456789")
    with keepalive_proxy(moto_endpoint) as (endpoint, seen):
        s3 = S3Store(bucket, endpoint=endpoint)
        with pytest.raises(ObjectNotFound):
            s3.get("data/missing", 0, 4)
        assert s3.get(KEY, 20, 4) == b""
        assert (seen["gets"], seen["presigned"]) == (4, 2)
        assert s3.get(KEY, 2, 3) == b"234"
        assert (seen["gets"], seen["presigned"]) == (5, 3)


def test_s3_presigned_gets_refused_turn_them_off(moto_endpoint, bucket):
    """Where presigned URLs are refused (403: a bucket policy that allows only
    requests signed in their headers), the GET goes through boto3 and so do later
    ones: one request each, not two."""
    from tierfs.cold.s3 import S3Store

    S3Store(bucket, endpoint=moto_endpoint).put(KEY, b"0123456789")
    with keepalive_proxy(moto_endpoint, refuse_presigned=True) as (endpoint, seen):
        s3 = S3Store(bucket, endpoint=endpoint)
        assert s3.get(KEY, 1, 3) == b"123"
        assert (seen["gets"], seen["presigned"]) == (2, 1)
        assert s3.get(KEY, 4, 2) == b"45"
        assert s3.get(KEY) == b"0123456789"
        assert (seen["gets"], seen["presigned"]) == (4, 1)


def test_s3_presigned_gets_are_tried_again_after_a_while(moto_endpoint, bucket):
    """A refusal turns presigned GETs off for presigned_retry_s only (a 403 may be
    credentials revoked for a while, not a policy): within it a GET is one request
    through boto3, past it a GET is tried presigned again."""
    from tierfs.cold.s3 import PRESIGNED_RETRY_S, S3Store

    S3Store(bucket, endpoint=moto_endpoint).put(KEY, b"0123456789")
    with keepalive_proxy(moto_endpoint, refuse_presigned=True) as (endpoint, seen):
        s3 = S3Store(bucket, endpoint=endpoint)
        assert s3.presigned_retry_s == PRESIGNED_RETRY_S >= 60
        assert s3.get(KEY, 1, 3) == b"123"
        assert s3.get(KEY, 4, 2) == b"45"
        assert (seen["gets"], seen["presigned"]) == (3, 1)
        s3.presigned_retry_s = 0  # the while is over
        assert s3.get(KEY, 7, 3) == b"789"
        assert (seen["gets"], seen["presigned"]) == (5, 2)  # tried, refused again


def test_s3_get_of_a_throttling_bucket_is_retried(moto_endpoint, bucket):
    """A presigned GET answered 503 SlowDown is asked again through boto3; answered
    so again, the error is transient and named, and the retry gets the data."""
    from tierfs.cold.retry import RetryingStore
    from tierfs.cold.s3 import S3Store

    S3Store(bucket, endpoint=moto_endpoint).put(KEY, b"0123456789")
    with keepalive_proxy(moto_endpoint, slow_down=2) as (endpoint, seen):
        s3 = S3Store(bucket, endpoint=endpoint)
        with pytest.raises(ColdStoreError) as e:
            s3.get(KEY, 1, 3)
        assert e.value.transient and "SlowDown" in str(e.value)
        assert (seen["gets"], seen["presigned"]) == (2, 1)
        assert RetryingStore(s3, timeout=10, base=0.01, cap=0.05).get(KEY, 1, 3) == b"123"
        assert (seen["gets"], seen["presigned"]) == (3, 2)


def test_s3_ranged_get_through_a_middlebox_that_drops_the_range(moto_endpoint, bucket):
    """A proxy or an S3-compatible server that ignores the Range header answers a
    ranged GET with the whole object (200, not 206): the store still returns the
    range asked for. Before, it returned the whole object, which every read of a
    small file packed with others took for a checksum mismatch (EIO, counted as
    damage)."""
    from tierfs.cold.s3 import S3Store

    data = payload(1024)
    S3Store(bucket, endpoint=moto_endpoint).put(KEY, data)
    with cutting_proxy(moto_endpoint, None, strip=b"Range") as endpoint:
        s3 = S3Store(bucket, endpoint=endpoint)
        assert s3.get(KEY, 100, 50) == data[100:150]
        assert s3.get(KEY, 1000) == data[1000:]
        assert s3.get(KEY, 1000, 100) == data[1000:]
        assert s3.get(KEY, 5000, 10) == b""
        with tempfile.TemporaryFile() as f:  # a checkpoint's LMDB file, after its header
            assert s3.get_file(KEY, f, 1000) == 24
            f.seek(0)
            assert f.read() == data[1000:]


def test_s3_get_of_a_trickling_body_is_bounded(moto_endpoint, bucket):
    """A body that trickles in (a degraded network or server), each byte within the
    socket's read timeout, must not hold the GET, its worker thread and its S3 slot
    for ever: past --cold-timeout (plus time for its size) the GET fails, transient
    (retried), naming the setting."""
    from tierfs.cold.s3 import S3Store

    data = payload(8192)
    S3Store(bucket, endpoint=moto_endpoint).put(KEY, data)
    with trickling_proxy(moto_endpoint) as endpoint:
        s3 = S3Store(bucket, endpoint=endpoint, read_timeout=5, get_timeout=0.5)
        assert s3.get(KEY, 0, 64) == data[:64]  # a body that fits in time arrives
        with pytest.raises(ColdStoreError) as e:
            s3.get(KEY)
    assert e.value.transient and "--cold-timeout" in str(e.value)


@pytest.mark.parametrize("op", ["put", "size", "list", "delete"])
def test_s3_request_whose_answer_trickles_is_bounded(moto_endpoint, bucket, op):
    """An answer that trickles in from its first byte (its status line and headers),
    each byte within the socket's read timeout: the request fails once it has run for
    --cold-timeout (plus time for the bytes it sends), transient (retried), naming the
    setting. Before, only a GET's body was bounded: any other request, or a GET whose
    headers trickled, held its worker thread and its S3 slot as long as the server
    went on, so that uploads and cold reads queued behind it."""
    from tierfs.cold.s3 import S3Store

    S3Store(bucket, endpoint=moto_endpoint).put(KEY, b"x")
    with trickling_proxy(moto_endpoint, chunk=4, headers=True) as endpoint:
        s3 = S3Store(bucket, endpoint=endpoint, read_timeout=5, get_timeout=0.5)
        calls = {"put": lambda: s3.put(KEY, b"y"), "size": lambda: s3.size(KEY),
                 "list": lambda: s3.list(), "delete": lambda: s3.delete(KEY)}
        with pytest.raises(ColdStoreError) as e:
            calls[op]()
    assert e.value.transient and "--cold-timeout" in str(e.value), e.value
    assert "\n" not in str(e.value)


def test_s3_get_of_an_archived_object_says_so(moto_endpoint, bucket):
    """A lifecycle rule of the bucket moved an object to an archive storage class
    (Glacier): S3 refuses its GET with 403 InvalidObjectState. The error says the
    object is archived and how to get it back; before, it blamed the credentials
    ("access denied to bucket ...: check AWS credentials"), which are fine."""
    import boto3

    from tierfs.cold.s3 import S3Store

    boto3.client("s3", endpoint_url=moto_endpoint).put_object(
        Bucket=bucket, Key=KEY, Body=b"cold data", StorageClass="GLACIER")
    with pytest.raises(ColdStoreError) as e:
        S3Store(bucket, endpoint=moto_endpoint).get(KEY)
    msg = str(e.value)
    assert "archive" in msg and "restore-object" in msg and KEY in msg, msg
    assert "credentials" not in msg and "\n" not in msg, msg
    assert not e.value.transient


@contextlib.contextmanager
def skewed_s3_endpoint(skew_s: float):
    """An HTTP endpoint that refuses every request as S3 does when the client's clock
    is off by more than 15 minutes (403 RequestTimeTooSkewed; a HEAD has no body to
    name the code), its Date header `skew_s` seconds from this machine's clock.
    Yields its URL."""
    from email.utils import formatdate
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Refuse(BaseHTTPRequestHandler):
        def _refuse(self):
            body = b"" if self.command == "HEAD" else (
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>RequestTimeTooSkewed"
                b"</Code><Message>The difference between the request time and the current "
                b"time is too large.</Message></Error>")
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response_only(403)
            self.send_header("Date", formatdate(time.time() + skew_s, usegmt=True))
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = do_DELETE = _refuse

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_s3_refusal_for_a_skewed_clock_names_the_clock(aws_env):
    """S3 refuses every request of a node whose clock is off by more than 15 minutes
    (a VM or container without NTP): the mount's check and every later request say
    that the clock is off and how to fix it. Before, they said "access denied to
    bucket ...: check AWS credentials" (a HEAD's 403 names no code), and the user
    looked for a fault in credentials that are fine."""
    from tierfs.cold.s3 import S3Store

    with skewed_s3_endpoint(3600) as endpoint:
        s3 = S3Store("some-bucket", endpoint=endpoint)
        for call in (s3.check, lambda: s3.get(KEY), lambda: s3.put(KEY, b"x")):
            with pytest.raises(ColdConfigError) as e:
                call()
            msg = str(e.value)
            assert "clock" in msg and "NTP" in msg and "credentials" not in msg, msg
            assert "\n" not in msg


def test_s3_no_credentials(moto_endpoint, aws_env, monkeypatch):
    from tierfs.cold.s3 import S3Store

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ColdConfigError, match="no AWS credentials found"):
        S3Store("any-bucket", endpoint=moto_endpoint).check()


# moto's server accepts any credentials, so wrong keys cannot be shown end to
# end here; the mapping of the server's replies is checked with a stubbed client.
@pytest.mark.parametrize(
    "code, status, expected, transient",
    [
        ("AccessDenied", 403, ColdConfigError, False),
        ("InvalidAccessKeyId", 403, ColdConfigError, False),
        ("SignatureDoesNotMatch", 403, ColdConfigError, False),
        ("NoSuchBucket", 404, ColdConfigError, False),
        ("NoSuchKey", 404, ObjectNotFound, False),
        ("SlowDown", 503, ColdStoreError, True),
        ("InternalError", 500, ColdStoreError, True),
        ("InvalidArgument", 400, ColdStoreError, False),
    ],
)
def test_s3_error_mapping(aws_env, code, status, expected, transient):
    from botocore.stub import Stubber

    from tierfs.cold.s3 import S3Store

    s = S3Store("b-test", "p", endpoint="http://127.0.0.1:9")
    s.presigned_gets = False  # presigned GETs do not go through the stubbed call
    with Stubber(s._client) as stub:
        stub.add_client_error("get_object", service_error_code=code, http_status_code=status)
        with pytest.raises(ColdStoreError) as e:
            s.get(KEY)
    assert type(e.value) is expected
    assert e.value.transient is transient
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        assert "credentials" in str(e.value) and "'b-test'" in str(e.value)


@pytest.fixture
def small_parts(monkeypatch):
    """Multipart uploads from 6 MiB, in parts of 5 MiB (S3's and moto's smallest)."""
    import tierfs.cold.s3 as s3

    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 6 * MiB, raising=False)
    monkeypatch.setattr(s3, "MULTIPART_PART", 5 * MiB, raising=False)


def _bucket_client(endpoint: str):
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _fail_part(s3, number: int) -> None:
    """Make the connection reset at each try of part `number` of the next multipart
    upload (only that upload: another one starting over goes through)."""
    import botocore.exceptions as bce

    doomed = []

    def reset(request, **_kwargs):
        upload = re.search(r"uploadId=([^&]+)", request.url).group(1)
        if not doomed:
            doomed.append(upload)
        if upload == doomed[0] and re.search(rf"partNumber={number}(&|$)", request.url):
            raise bce.ConnectionClosedError(endpoint_url=request.url)
    s3._client.meta.events.register("before-send.s3.UploadPart", reset)


def test_s3_put_file_above_the_threshold_goes_up_in_parts(moto_endpoint, bucket, small_parts,
                                                          tmp_path):
    """S3 refuses a single PutObject above 5 GiB, and a checkpoint of about 10 million
    files is larger: before, every checkpoint of such a namespace failed for good. A
    file above MULTIPART_THRESHOLD goes up as a multipart upload, read as it is sent,
    and reads back the same."""
    from tierfs.cold.s3 import S3Store

    data = payload(12 * MiB + 5)
    (tmp_path / "src").write_bytes(b"skipped" + data)
    s3 = S3Store(bucket, "pre", endpoint=moto_endpoint)
    with open(tmp_path / "src", "rb") as f:
        f.seek(len(b"skipped"))
        s3.put_file(KEY, f)
    assert s3.get(KEY) == data
    client = _bucket_client(moto_endpoint)
    assert client.head_object(Bucket=bucket, Key=f"pre/{KEY}")["ETag"].endswith('-3"')
    assert "Uploads" not in client.list_multipart_uploads(Bucket=bucket)


def test_s3_checkpoint_above_the_threshold_goes_up_in_parts_and_reads_back(
        moto_endpoint, bucket, small_parts, tmp_path):
    """A checkpoint (its header, then the LMDB copy) larger than MULTIPART_THRESHOLD
    goes up in parts, in the same format: recovery reads it back and verifies it."""
    from tierfs.cold.s3 import S3Store
    from tierfs.tier.checkpoint import checkpoint_name, get_checkpoint, put_checkpoint

    data = payload(11 * MiB)
    (tmp_path / "data.mdb").write_bytes(data)
    s3 = S3Store(bucket, endpoint=moto_endpoint)
    assert put_checkpoint(s3, 7, str(tmp_path / "data.mdb")) == len(data)
    client = _bucket_client(moto_endpoint)
    assert client.head_object(Bucket=bucket, Key=checkpoint_name(7))["ETag"].endswith('-3"')
    get_checkpoint(s3, 7, str(tmp_path / "back.mdb"))
    assert (tmp_path / "back.mdb").read_bytes() == data


def test_s3_put_file_that_fails_in_a_part_leaves_no_parts(moto_endpoint, bucket, small_parts,
                                                          tmp_path):
    """A multipart upload that fails partway is aborted, so that no parts stay in the
    bucket (billed, unseen); a retry starts over and puts the whole file."""
    from tierfs.cold.retry import RetryingStore
    from tierfs.cold.s3 import S3Store

    data = payload(12 * MiB)
    (tmp_path / "src").write_bytes(data)
    client = _bucket_client(moto_endpoint)
    s3 = S3Store(bucket, endpoint=moto_endpoint)
    _fail_part(s3, 2)
    with open(tmp_path / "src", "rb") as f, pytest.raises(ColdStoreError) as e:
        s3.put_file(KEY, f)
    assert e.value.transient
    assert "Uploads" not in client.list_multipart_uploads(Bucket=bucket)
    assert s3.size(KEY) is None

    s3 = S3Store(bucket, endpoint=moto_endpoint)
    _fail_part(s3, 3)
    with open(tmp_path / "src", "rb") as f:
        RetryingStore(s3, base=0.01).put_file(KEY, f)
    assert s3.get(KEY) == data
    assert "Uploads" not in client.list_multipart_uploads(Bucket=bucket)


def test_s3_connections_of_all_the_calls_that_may_run_at_once_are_kept(moto_endpoint, bucket,
                                                                        caplog):
    """The engine runs up to 32 S3 calls at once, and the lease, sync and control
    calls run on threads of their own beside them. Before, the client kept at most 32
    connections: each one beyond was closed as its call ended ("Connection pool is
    full, discarding connection", logged every time) and opened again for the next."""
    from tierfs.cold.s3 import S3Store

    calls = 32 + 8
    s3 = S3Store(bucket, endpoint=moto_endpoint)
    s3.put(KEY, b"data")
    # Each GET holds its connection until its body is read: all of them at once here.
    together = threading.Barrier(calls, timeout=60)
    s3._client.meta.events.register("after-call.s3.GetObject",
                                    lambda **_kwargs: together.wait())
    errors = []

    def get():
        try:
            assert s3.get(KEY) == b"data"
        except Exception as e:  # reported below
            errors.append(e)
            together.abort()

    caplog.set_level(logging.WARNING, logger="urllib3.connectionpool")
    threads = [threading.Thread(target=get) for _ in range(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not [r for r in caplog.records if "pool is full" in r.getMessage()]


def test_s3_request_that_fails_is_sent_once(moto_endpoint, bucket):
    """tierfs retries failed requests itself (RetryingStore, with its time budget and
    its counts): the store sends each request once. Before, botocore sent a request
    that failed once more of its own accord, so a request the watchdog ended for
    running past --cold-timeout failed only after twice that."""
    import botocore.exceptions as bce

    from tierfs.cold.s3 import S3Store

    s3 = S3Store(bucket, endpoint=moto_endpoint)
    sent = []

    def reset(request, **_kwargs):
        sent.append(request.url)
        raise bce.ConnectionClosedError(endpoint_url=request.url)
    s3._client.meta.events.register("before-send.s3.GetObject", reset)
    with pytest.raises(ColdStoreError) as e:
        s3.get(KEY)
    assert e.value.transient
    assert len(sent) == 1, sent


def test_s3_endpoint_from_environment(moto_endpoint, bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    s = open_store(f"s3://{bucket}/some/prefix/")
    s.check()
    s.put(KEY, b"hello")
    assert s.get(KEY) == b"hello"
    assert s.describe() == f"s3://{bucket}/some/prefix"
    assert "testing" not in s.describe()


def test_s3_path_style(moto_endpoint, bucket):
    s = open_store(f"s3://{bucket}", s3_endpoint=moto_endpoint, s3_path_style=True, s3_region="us-east-1")
    s.put(KEY, b"path style")
    assert s.get(KEY, 5) == b"style"
    assert s.list() == [KEY]


# -- URLs and open_store -----------------------------------------------------------


@pytest.mark.parametrize(
    "url, expected",
    [
        ("file:///var/cold", ("file", "/var/cold", "")),
        ("file:///var/cold/", ("file", "/var/cold", "")),
        ("s3://bucket", ("s3", "bucket", "")),
        ("s3://bucket/", ("s3", "bucket", "")),
        ("s3://my.bucket-1/a/b/", ("s3", "my.bucket-1", "a/b")),
        ("s3://b12/tierfs", ("s3", "b12", "tierfs")),
    ],
)
def test_parse_cold_url_good(url, expected):
    assert parse_cold_url(url) == expected


@pytest.mark.parametrize(
    "url, words",
    [
        ("foo", "is not a URL"),
        ("/abs/path", "file:///abs/path"),
        ("", "is not a URL"),
        ("ftp://host/x", "unknown scheme 'ftp'"),
        ("file://relative", "file:///abs/path"),
        ("file://relative/path", "file:///abs/path"),
        ("s3://", "names no bucket"),
        ("s3:///prefix", "names no bucket"),
        ("s3://Bad_Bucket/x", "invalid bucket name 'Bad_Bucket'"),
        ("s3://ab", "invalid bucket name"),
        ("s3://-abc", "invalid bucket name"),
        ("s3://a..b", "invalid bucket name"),
        ("s3://192.168.1.1", "invalid bucket name"),
        ("s3://" + "a" * 64, "invalid bucket name"),
        ("s3://bucket/a//b", "empty path segment"),
    ],
)
def test_parse_cold_url_bad(url, words):
    with pytest.raises(UserError) as e:
        parse_cold_url(url)
    msg = str(e.value)
    assert words in msg
    assert repr(url) in msg and "\n" not in msg


def test_open_store_file(tmp_path):
    s = open_store(f"file://{tmp_path}/cold/")
    assert isinstance(s, FileStore)
    assert s.describe() == f"file://{tmp_path}/cold"


def test_open_store_bad_url_is_user_error():
    with pytest.raises(UserError):
        open_store("cold-dir")


def test_import_does_not_load_boto3():
    code = (
        "import sys, tierfs.cold as c; c.open_store('file:///tmp/x'); "
        "assert 'boto3' not in sys.modules and 'botocore' not in sys.modules"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# -- faulty store -----------------------------------------------------------------


def test_faulty_outage():
    s = FaultyStore(MemoryStore())
    s.put(KEY, b"x")
    s.outage = True
    for op in (lambda: s.get(KEY), lambda: s.put(KEY, b"y"), s.list, lambda: s.size(KEY), lambda: s.delete(KEY)):
        with pytest.raises(ColdStoreError, match="injected outage") as e:
            op()
        assert e.value.transient
    s.outage = False
    assert s.get(KEY) == b"x"  # nothing changed during the outage
    assert s.calls == {"put": 2, "get": 2, "list": 1, "size": 1, "delete": 1}


def test_faulty_corrupt_keys_flip_one_byte():
    inner = MemoryStore()
    s = FaultyStore(inner, seed=3)
    data = payload(4096)
    s.put(KEY, data)
    s.put("data/ok", data)
    s.corrupt_keys = {KEY}
    got = s.get(KEY)
    assert len(got) == len(data)
    assert sum(x != y for x, y in zip(got, data)) == 1
    assert s.get("data/ok") == data
    assert inner.get(KEY) == data  # the stored copy is intact


def _failure_pattern(seed: int) -> list[bool]:
    s = FaultyStore(MemoryStore(), seed=seed)
    s.fail_rate = 0.5
    pattern = []
    for i in range(64):
        try:
            s.put(f"k{i}", b"v")
            pattern.append(False)
        except ColdStoreError as e:
            assert e.transient
            pattern.append(True)
    return pattern


def test_faulty_fail_rate_is_deterministic():
    first = _failure_pattern(7)
    assert first == _failure_pattern(7)
    assert any(first) and not all(first)
    assert first != _failure_pattern(8)


def test_faulty_latency():
    s = FaultyStore(MemoryStore())
    s.latency_s = 0.05
    start = time.monotonic()
    s.size(KEY)
    assert time.monotonic() - start >= 0.05


class _Body:
    """The raw body of a canned HTTP response."""

    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_kw):
        yield self.data


def throttle(s3, operation: str, times: int) -> dict:
    """Make the S3 endpoint answer the next `times` requests of `operation` (botocore's
    name: HeadBucket, PutObject...) with 503 SlowDown, as a bucket under load does.
    The request does not reach the server. Returns the count of those left."""
    from botocore.awsrequest import AWSResponse

    left = {"n": times}
    body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
            b"<Message>Please reduce your request rate.</Message></Error>")

    def slow_down(request, **_kw):
        if left["n"] > 0:
            left["n"] -= 1
            return AWSResponse(request.url, 503, {"Content-Type": "application/xml"},
                               _Body(body))
        return None

    s3._client.meta.events.register(f"before-send.s3.{operation}", slow_down)
    return left


@pytest.mark.parametrize("operation", ["HeadBucket", "PutObject", "GetObject"])
def test_s3_check_of_a_throttling_bucket_is_retried(moto_endpoint, bucket, operation):
    """A mount's check of a bucket that answers 503 SlowDown for a moment (many nodes
    starting at once) is retried like any other request, not taken for a
    misconfiguration that refuses the mount."""
    from tierfs.cold.retry import RetryingStore
    from tierfs.cold.s3 import S3Store

    s3 = S3Store(bucket, "p", endpoint=moto_endpoint)
    s3.presigned_gets = False  # the throttle is a botocore hook: presigned GETs pass it by
    left = throttle(s3, operation, 2)
    RetryingStore(s3, timeout=10, base=0.01, cap=0.05).check()
    assert left["n"] == 0  # it was throttled, and got through


def test_s3_check_of_a_bucket_that_keeps_throttling_says_so(moto_endpoint, bucket):
    """Throttled past the retries: the error names the throttling and is no
    configuration error (which would tell the user to fix a setting)."""
    from tierfs.cold.retry import RetryingStore
    from tierfs.cold.s3 import S3Store

    s3 = S3Store(bucket, "p", endpoint=moto_endpoint)
    throttle(s3, "PutObject", 10 ** 6)
    with pytest.raises(ColdStoreError) as e:
        RetryingStore(s3, timeout=0.2, base=0.01, cap=0.05).check()
    assert "SlowDown" in str(e.value) and not isinstance(e.value, ColdConfigError)
