"""Bad input: every case gets one clear line on stderr, exit status 1 (2 for a command line
that cannot be parsed), no traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import boto3
import pytest

from tests.harness import run_cli
from tierfs.meta.schema import SUPERBLOCK_OBJECT
from tierfs.mountpoint import mounts
from tests.moto_server import free_port, s3_env


def assert_clean_error(res, *fragments):
    assert res.returncode == 1, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("tierfs: ")
    assert "Traceback" not in res.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def mount_args(tmp_path, mp=None, cold=None, cache=None):
    return ["mount", cold or f"file://{tmp_path}/cold", mp or str(tmp_path / "mnt"),
            "--cache-dir", cache or str(tmp_path / "cache")]


def test_mountpoint_missing(tmp_path):
    assert_clean_error(run_cli(*mount_args(tmp_path)), "does not exist", "mkdir -p")


def test_mountpoint_not_a_directory(tmp_path):
    (tmp_path / "mnt").write_text("x")
    assert_clean_error(run_cli(*mount_args(tmp_path)), "is not a directory")


def test_mountpoint_not_empty(tmp_path):
    (tmp_path / "mnt").mkdir()
    (tmp_path / "mnt" / "file").write_text("x")
    assert_clean_error(run_cli(*mount_args(tmp_path)), "is not empty")


def test_already_mounted(mnt, tmp_path):
    res = run_cli("mount", f"file://{tmp_path}/other", mnt.mountpoint, "--cache-dir",
                  str(tmp_path / "other-cache"))
    assert_clean_error(res, "is already mounted", "tierfs umount")


def test_cache_dir_locked_by_another_daemon(mnt, tmp_path):
    (tmp_path / "mnt2").mkdir()
    before = mnt.log()
    res = run_cli(*mount_args(tmp_path, mp=str(tmp_path / "mnt2"), cold=mnt.cold_url,
                              cache=mnt.cache_dir))
    assert_clean_error(res, "in use by another tierfs daemon", f"pid {mnt.pid}")
    # The refusal is the caller's business: the live daemon's log gets nothing.
    assert mnt.log() == before


def test_mounting_a_live_mount_again_leaves_its_log_alone(mnt):
    before = mnt.log()
    res = run_cli(*mount_args(os.path.dirname(mnt.mountpoint), mp=mnt.mountpoint,
                              cold=mnt.cold_url, cache=mnt.cache_dir))
    assert_clean_error(res, "is already mounted")
    assert mnt.log() == before


def test_cache_dir_too_long_for_the_control_socket(tmp_path):
    (tmp_path / "mnt").mkdir()
    cache = tmp_path / ("c" * 120)
    res = run_cli(*mount_args(tmp_path, cache=str(cache)))
    assert_clean_error(res, "too long a path for the control socket", "shorter --cache-dir")
    assert not cache.exists() and mounts().get(str(tmp_path / "mnt")) is None


def test_cache_dir_is_a_file(tmp_path):
    (tmp_path / "mnt").mkdir()
    (tmp_path / "cache").write_text("x")
    assert_clean_error(run_cli(*mount_args(tmp_path)), "is a file, not a directory")


@pytest.mark.parametrize("cache, cold, fragment", [
    ("mnt", None, "cache dir {mnt} is the mount point"),
    ("mnt/cache", None, "cache dir {mnt}/cache is inside the mount point {mnt}"),
    ("link/cache", None, "cache dir {tmp}/link/cache is inside the mount point {mnt}"),
    ("cache", "mnt/cold", "cold location {mnt}/cold is inside the mount point {mnt}"),
])
def test_cache_dir_or_cold_location_inside_the_mount_point(tmp_path, cache, cold, fragment):
    """The mount would hide them from its own daemon, which then waits on itself: the
    mount hung, and `tierfs mount` with it. Refused in one line instead."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    (tmp_path / "link").symlink_to(mp)
    args = mount_args(tmp_path, cache=str(tmp_path / cache),
                      cold=cold and f"file://{tmp_path}/{cold}")
    try:
        res = run_cli(*args, timeout=60)
    finally:
        if mounts().get(str(mp)):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
    assert_clean_error(res, fragment.format(mnt=mp, tmp=tmp_path), "outside")
    assert not os.listdir(mp)  # nothing created in it


def test_cache_dir_on_a_read_only_filesystem(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (tmp_path / "mnt").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ro)], check=True)
    try:
        (ro / "cache").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        res = run_cli(*mount_args(tmp_path, cache=str(ro / "cache")))
        assert_clean_error(res, "read-only filesystem", "remount it read-write")
        res = run_cli(*mount_args(tmp_path, cache=str(ro / "new-cache")))
        assert_clean_error(res, "read-only", "writable disk")
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_mount_works_from_a_directory_holding_a_tierfs_folder(mount_factory, tmp_path):
    # E.g. the parent of a clone: `python -m tierfs` there must not run ./tierfs.
    here = tmp_path / "here"
    (here / "tierfs").mkdir(parents=True)
    (here / "tierfs" / "__main__.py").write_text("raise SystemExit(7)\n")
    m = mount_factory(start=False)
    tierfs = os.path.join(os.path.dirname(sys.executable), "tierfs")  # the installed command
    res = subprocess.run([tierfs, "mount", m.cold_url, m.mountpoint, "--cache-dir",
                          m.cache_dir], capture_output=True, text=True, cwd=here, timeout=120)
    assert res.returncode == 0, res.stderr
    m.pid = m.daemon_pid()
    # The daemon does not keep the caller's directory busy either.
    assert os.readlink(f"/proc/{m.pid}/cwd") == "/"
    with open(m.path("f"), "w") as f:
        f.write("ok")
    with open(m.path("f")) as f:
        assert f.read() == "ok"


def test_daemon_dying_before_it_can_log_shows_why(tmp_path):
    # A broken install: the daemon cannot even import its FUSE binding.
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "pyfuse3.py").write_text("raise ImportError('pyfuse3 is broken here')\n")
    (tmp_path / "mnt").mkdir()
    env = dict(os.environ, PYTHONPATH=str(fake))
    res = subprocess.run([sys.executable, "-m", "tierfs", *mount_args(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert_clean_error(res, "exited with status 1 before mounting",
                       "ImportError: pyfuse3 is broken here")
    assert str(tmp_path / "mnt") not in mounts()


def test_cache_dir_not_creatable(tmp_path):
    (tmp_path / "mnt").mkdir()
    (tmp_path / "afile").write_text("x")
    res = run_cli(*mount_args(tmp_path, cache=str(tmp_path / "afile" / "cache")))
    assert_clean_error(res, "cannot create cache dir")


@pytest.mark.parametrize("url,fragment", [
    ("relative/path", "is not a URL"),
    ("ftp://host/x", "scheme"),
    ("s3://", "bucket"),
])
def test_malformed_cold_url(tmp_path, url, fragment):
    (tmp_path / "mnt").mkdir()
    assert_clean_error(run_cli(*mount_args(tmp_path, cold=url)), fragment)


@pytest.mark.allow_log_errors  # the refused mount logs its reason
def test_other_format_version(mount_factory):
    m = mount_factory()
    m.umount()
    sb_path = m.cold_url[len("file://"):] + "/tierfs.json"
    with open(sb_path) as f:
        sb = json.load(f)
    sb["format"] = 99
    with open(sb_path, "w") as f:
        json.dump(sb, f)
    res = m.cli("mount", m.cold_url, m.mountpoint, "--cache-dir", m.cache_dir)
    assert_clean_error(res, "format version 99")


@pytest.mark.allow_log_errors  # the refused mount logs its reason
def test_cache_dir_of_another_filesystem(mount_factory, tmp_path):
    a = mount_factory(name="a")
    b = mount_factory(name="b")
    a.umount()
    b.umount()
    res = a.cli("mount", a.cold_url, a.mountpoint, "--cache-dir", b.cache_dir)
    assert_clean_error(res, "belongs to filesystem")


def test_location_with_foreign_data(tmp_path):
    (tmp_path / "mnt").mkdir()
    (tmp_path / "cold").mkdir()
    (tmp_path / "cold" / "photo.jpg").write_bytes(b"\xff\xd8")
    assert_clean_error(run_cli(*mount_args(tmp_path)), "not a tierfs filesystem")


def test_fusermount3_missing(tmp_path):
    (tmp_path / "mnt").mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    env = dict(os.environ, PATH=str(bindir))
    res = subprocess.run([sys.executable, "-m", "tierfs", *mount_args(tmp_path)],
                                       capture_output=True, text=True, env=env)
    assert_clean_error(res, "fusermount3 not found", "apt-get install fuse3")


def test_stale_mount_after_kill9_is_cleaned(mnt):
    with open(mnt.path("f"), "wb") as f:
        f.write(b"data")
        os.fsync(f.fileno())
    mnt.kill9()
    res = mnt.start()
    assert "removed a stale mount" in res.stdout
    with open(mnt.path("f"), "rb") as f:
        assert f.read() == b"data"


@pytest.mark.parametrize("args, fragment, see", [
    (["frobnicate"], "invalid choice: 'frobnicate'", "tierfs --help"),
    (["mount", "--no-such-option"], "unrecognized arguments: --no-such-option", "tierfs --help"),
    (["fsck"], "required: COLD_URL", "tierfs fsck --help"),
    (["mount", "--cache-size"], "--cache-size: expected one argument", "tierfs mount --help"),
])
def test_usage_errors_are_one_line_naming_the_help(args, fragment, see):
    res = run_cli(*args)
    assert res.returncode == 2, res
    assert res.stderr.strip().splitlines() == [res.stderr.strip()], res.stderr
    assert fragment in res.stderr and f"(see {see})" in res.stderr, res.stderr
    assert res.stdout == ""


def test_umount_not_mounted(tmp_path):
    assert_clean_error(run_cli("umount", str(tmp_path)), "is not mounted")


def test_umount_of_a_path_that_does_not_exist(tmp_path):
    assert_clean_error(run_cli("umount", str(tmp_path / "nope")), "does not exist")


def test_umount_of_a_directory_inside_a_mount(mnt):
    os.mkdir(mnt.path("sub"))
    res = run_cli("umount", mnt.path("sub"))
    assert_clean_error(res, "is inside the tierfs mount at", f"tierfs umount {mnt.mountpoint}")
    assert mnt.mounted


def test_status_into_a_closed_pipe_is_quiet(mnt):
    r, w = os.pipe()
    os.close(r)  # like `| head` that has stopped reading
    try:
        res = subprocess.run([sys.executable, "-m", "tierfs", "status", mnt.mountpoint],
                             stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert res.returncode == 0 and res.stderr == ""


def test_umount_busy(mnt):
    with open(mnt.path("f"), "w") as f:
        res = mnt.cli("umount", mnt.mountpoint)
        assert_clean_error(res, "is busy", "fuser -vm")
    assert mnt.mounted


# ---- S3 locations -------------------------------------------------------------------

@pytest.fixture
def s3env(s3_endpoint):
    return dict(os.environ, **s3_env(s3_endpoint))


def test_s3_bucket_missing(tmp_path, s3env):
    (tmp_path / "mnt").mkdir()
    res = run_cli(*mount_args(tmp_path, cold="s3://no-such-bucket-tierfs/x"), env=s3env)
    assert_clean_error(res, "no-such-bucket-tierfs")


def test_s3_endpoint_unreachable(tmp_path, s3env):
    (tmp_path / "mnt").mkdir()
    port = free_port()
    res = run_cli(*mount_args(tmp_path, cold="s3://somebucket/x"), "--s3-endpoint",
                  f"http://127.0.0.1:{port}", env=s3env)
    assert_clean_error(res, f"127.0.0.1:{port}")


def test_s3_prefix_with_foreign_data(tmp_path, s3env, s3_url, s3_endpoint):
    (tmp_path / "mnt").mkdir()
    bucket, prefix = s3_url[5:].split("/", 1)
    boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").put_object(
        Bucket=bucket, Key=f"{prefix}/dataset/part-0000.parquet", Body=b"PAR1")
    res = run_cli(*mount_args(tmp_path, cold=s3_url), env=s3env)
    assert_clean_error(res, "not a tierfs filesystem")


def test_hot_tier_too_small_for_one_request(tmp_path):
    """A 1 MiB request can touch 5 extents of 256 KiB: a 1 MiB hot tier would fail the
    first such write with ENOSPC, so the mount is refused, naming the minimum."""
    (tmp_path / "mnt").mkdir()
    res = run_cli(*mount_args(tmp_path), "--cache-size", "1M", "--extent-size", "256K")
    assert_clean_error(res, "--cache-size 1.0 MiB is too small", "touch 5 extents",
                       "needs at least 1.2 MiB")
    res = run_cli(*mount_args(tmp_path), "--cache-size", "2M", "--extent-size", "256K")
    assert res.returncode == 0, res.stderr
    assert run_cli("umount", str(tmp_path / "mnt")).returncode == 0


def test_a_refused_first_mount_leaves_the_extent_size_open(tmp_path):
    """A cache disk too small for the default 4 MiB extents refuses the first mount
    before the filesystem exists, so a smaller --extent-size is still taken."""
    small = tmp_path / "small"
    small.mkdir()
    (tmp_path / "mnt").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(small)], check=True)
    try:
        args = mount_args(tmp_path, cache=str(small / "cache")) + ["--min-free", "0"]
        assert_clean_error(run_cli(*args), "too full for the hot tier", "needs at least 8.0 MiB")
        assert not (tmp_path / "cold" / SUPERBLOCK_OBJECT).exists()
        res = run_cli(*args, "--extent-size", "64K")
        assert res.returncode == 0, res.stderr
        assert "extent size 65536" in res.stdout + res.stderr
        assert run_cli("umount", str(tmp_path / "mnt")).returncode == 0
    finally:
        if str(tmp_path / "mnt") in mounts():
            run_cli("umount", str(tmp_path / "mnt"))
        subprocess.run(["umount", str(small)], check=True)


def test_a_request_past_the_daemons_limit_gets_its_answer_not_a_broken_pipe(mnt):
    """The daemon answers a request line longer than it takes, then closes: a client
    still sending gets that answer, an error, never a BrokenPipeError (which the
    command line would take for a closed output and exit 0 on)."""
    from tierfs.client import call
    from tierfs.errors import UserError
    from tierfs.fs.control import MAX_REQUEST
    paths = [mnt.path("p" * 1000)] * (MAX_REQUEST // 1000 + 16)
    with pytest.raises(UserError, match="hint failed: request too long"):
        call(mnt.mountpoint, "hint", paths=paths)
    assert call(mnt.mountpoint, "ping")["ok"]  # the daemon goes on


def test_a_flood_of_control_connections_costs_the_socket_not_the_mount(mount_factory):
    """Any local user may connect to the control socket. Connections past the cap are
    closed at once: the mount keeps reading, and the socket answers again once the
    flood ends."""
    import resource
    import socket

    from tierfs.fs.control import MAX_CONNECTIONS
    from tests.harness import read_file, wait_until, write_file
    m = mount_factory()
    write_file(m.path("f"), b"still here")
    sock_path = os.path.join(m.cache_dir, "control.sock")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, MAX_CONNECTIONS + 512), hard))
    flood = []
    try:
        for _ in range(MAX_CONNECTIONS + 10):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            flood.append(s)
            s.connect(sock_path)
        last = flood[-1]
        last.settimeout(30)
        assert last.recv(1) == b""  # closed by the daemon: over the cap
        assert read_file(m.path("f")) == b"still here"
    finally:
        for s in flood:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    wait_until(lambda: m.cli("status", m.mountpoint).returncode == 0, 30,
               "the control socket to answer again")
    assert "connections are open; closing new ones" in m.log()


@pytest.mark.parametrize("command", ["fsck", "recover"])
def test_an_offline_command_whose_bucket_fails_it_says_so_in_one_line(mount_factory, tmp_path,
                                                                      command):
    """The offline commands pass the bucket's check, then a read fails for good (here
    each object they read is a symbolic link to itself): recover says so in one line
    naming the bucket's error, exit 1, no traceback; fsck --verify-data names the
    object it could not check among its findings and checks the rest, exit 4."""
    m = mount_factory()
    with open(m.path("f"), "wb") as f:
        f.write(b"x" * 4096)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.umount()
    bucket = m.cold_url[len("file://"):]
    # fsck --verify-data reads the file's object; recover reads the checkpoints.
    prefix = "data" if command == "fsck" else "meta"
    found = []
    for root, _dirs, files in os.walk(os.path.join(bucket, prefix)):
        for name in files:
            path = os.path.join(root, name)
            os.unlink(path)
            os.symlink(name, path)
            found.append(path)
    assert found, f"no {prefix} objects in {bucket}"
    if command == "fsck":
        res = m.cli("fsck", m.cold_url, "--cache-dir", m.cache_dir, "--verify-data")
        assert res.returncode == 4 and "Traceback" not in res.stdout + res.stderr, res
        finding = [ln for ln in res.stdout.splitlines() if "its data was not checked" in ln]
        assert len(finding) == 1, res.stdout
        assert "Too many levels of symbolic links" in finding[0], finding[0]
    else:
        res = m.cli("recover", m.cold_url, "--cache-dir", str(tmp_path / "new-cache"))
        assert_clean_error(res, "Too many levels of symbolic links")


@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
def test_a_bucket_failing_after_its_check_refuses_the_mount_in_one_line(tmp_path, existing):
    """The bucket answers the mount's check, then fails every request (an outage, or
    throttling that outlasts the retries) while the mount reads its superblock and
    lease: one line saying so and what to do, exit 1, no traceback in the log."""
    (tmp_path / "mnt").mkdir()
    faults = tmp_path / "faults.json"
    faults.write_text("{}")
    args = [*mount_args(tmp_path), "--fault-file", str(faults), "--cold-timeout", "1"]
    if existing:
        assert run_cli(*args).returncode == 0
        assert run_cli("umount", str(tmp_path / "mnt")).returncode == 0
    faults.write_text(json.dumps({"outage": True}))
    res = run_cli(*args)
    assert_clean_error(res, "injected outage", "then try again")
    assert "internal error" not in res.stderr
    log = (tmp_path / "cache" / "tierfs.log").read_text()
    assert "Traceback" not in log, log


@pytest.mark.parametrize("content", ['["a", "list"]', '"text"', 'null',
                                     '{"fs_id": "x", "extent_size": "4M", "format": 2}'])
def test_a_foreign_tierfs_json_is_refused_in_one_line(tmp_path, content):
    """The location holds a tierfs.json that another tool wrote (valid JSON, but not a
    superblock): the mount says the location is not a tierfs filesystem, not
    "internal error: TypeError" (or a crash later on an extent size that is text)."""
    (tmp_path / "mnt").mkdir()
    (tmp_path / "cold").mkdir()
    (tmp_path / "cold" / SUPERBLOCK_OBJECT).write_text(content)
    res = run_cli(*mount_args(tmp_path))
    assert_clean_error(res, "is not a valid tierfs superblock")


def test_unfinished_requests_hold_a_bounded_amount_of_the_daemons_memory(mount_factory):
    """Any local user may connect and send a request line without its end: the daemon
    holds such lines up to MAX_BUFFERED bytes in all (not MAX_CONNECTIONS times
    MAX_REQUEST), refuses the next with an answer, and serves everyone once they end."""
    import select
    import socket

    from tierfs.client import call
    from tierfs.fs.control import MAX_BUFFERED, MAX_REQUEST
    m = mount_factory()
    sock_path = os.path.join(m.cache_dir, "control.sock")
    unfinished = b'{"cmd": "hint", "paths": ["' + b"p" * (MAX_REQUEST - 64)
    fit = MAX_BUFFERED // len(unfinished)
    held = []
    try:
        # A send returns once the daemon has read (nearly) all of it: held, or refused
        # with an answer (then the rest of the send breaks: the answer waits to be read).
        for _ in range(fit + 2):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.append(s)
            s.settimeout(30)
            s.connect(sock_path)
            try:
                s.sendall(unfinished)
            except (BrokenPipeError, ConnectionResetError):
                pass
        answered = select.select(held, [], [], 30)[0]
        assert answered, f"{len(held)} unfinished requests were all held"
        first = min(held.index(s) for s in answered)
        answer = json.loads(held[first].recv(4096))
        assert answer == {"ok": False, "error": "the daemon holds too many unfinished "
                                                "requests; try again"}, answer
        assert first >= fit - 1, f"refused after {first} unfinished requests, not {fit - 1}"
    finally:
        for s in held:
            s.close()
    assert call(m.mountpoint, "ping")["ok"]
    assert "unfinished requests are held; refusing more" in m.log()


def test_a_request_that_is_not_a_json_object_gets_an_error(mnt):
    import socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(os.path.join(mnt.cache_dir, "control.sock"))
        s.sendall(b"[1, 2]\n")
        assert json.loads(s.recv(4096)) == {"ok": False, "error": "a request is a JSON object"}
    assert "Traceback" not in mnt.log()


@pytest.mark.parametrize("line, names", [
    (b"not json at all", "JSON"),
    (b"[" * 100_000, "JSON"),
    (b'{"cmd": "release"}', '"ino"'),
    (b'{"cmd": "release", "ino": "five"}', '"ino"'),
    (b'{"cmd": "scrub", "ino": -1}', '"ino"'),
    (b'{"cmd": "unpin", "ino": 1180591620717411303424}', '"ino"'),
    (b'{"cmd": "status", "ino": 1.5}', '"ino"'),
    (b'{"cmd": "status", "dir_ino": 1, "limit": "all"}', '"limit"'),
    (b'{"cmd": "release_many", "inos": 5}', '"inos"'),
    (b'{"cmd": "unpin_many", "inos": [1, "x"]}', '"inos"'),
    (b'{"cmd": "prefetch_many"}', '"inos"'),
    (b'{"cmd": "prefetch_many", "inos": [1], "parallel": "many"}', '"parallel"'),
    (b'{"cmd": "sync", "inos": 7}', '"inos"'),
    (b'{"cmd": "sync", "wait": true, "timeout": "soon"}', '"timeout"'),
    (b'{"cmd": "hint", "paths": "a/b"}', '"paths"'),
    (b'{"cmd": "status", "dir_ino": 1, "limit": Infinity}', '"limit"'),
    (b'{"cmd": "prefetch_many", "inos": [1], "parallel": Infinity}', '"parallel"'),
    (b'{"cmd": "direct_open", "ino": 1180591620717411303424, "first_extent": 0, '
     b'"token": "t"}', "ino"),
])
def test_a_malformed_request_gets_one_error_naming_what_is_wrong(mnt, line, names):
    """Any local user may write to the control socket. A line that is not JSON, or a
    command whose arguments are missing or of the wrong type, got no answer (the
    client waited for one) and, for the arguments, an ERROR traceback in the log."""
    import socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(os.path.join(mnt.cache_dir, "control.sock"))
        s.sendall(line + b"\n")
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    lines = answer.splitlines()
    assert len(lines) == 1, answer
    reply = json.loads(lines[0])
    assert reply["ok"] is False and names in reply["error"], reply
    assert "Traceback" not in mnt.log()
    from tierfs.client import call
    assert call(mnt.mountpoint, "ping")["ok"]  # the daemon goes on


@pytest.mark.parametrize("args, names", [
    ({"hold": 5}, '"hold"'),
    ({"hold": ["a", "b"]}, '"hold"'),
    ({"hold": [1 << 70, (1 << 70) + 1]}, '"hold"'),
    ({"release": 5}, '"release"'),
    ({"release": ["x"]}, '"release"'),
])
def test_a_malformed_direct_write_request_gets_one_error_naming_what_is_wrong(mnt, args,
                                                                              names):
    """The direct write session's own requests: extents to hold or release that are no
    extent numbers logged an ERROR traceback and dropped the connection unanswered."""
    import socket
    fd = os.open(mnt.path("w"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(os.path.join(mnt.cache_dir, "control.sock"))
            f = s.makefile("rb")
            s.sendall(json.dumps({"cmd": "direct_write", "op": "open", "fd": fd,
                                  "keep": True}).encode() + b"\n")
            opened = json.loads(f.readline())
            assert opened["ok"], opened
            s.sendall(json.dumps({"cmd": "direct_write", "session": opened["session"],
                                  "keep": True, **args}).encode() + b"\n")
            reply = json.loads(f.readline() or b"null")
            assert reply is not None and reply["ok"] is False and names in reply["error"], reply
    finally:
        os.close(fd)
    assert "Traceback" not in mnt.log()
