"""A daemon that dies while its FUSE connection stays open leaves a mount that hangs
instead of failing with ENOTCONN. That happens when a thread of the daemon is stuck in
the kernel as it is killed (on a shared namespace, invalidating a name in a directory
whose lock a writer on the mount holds while it waits for the daemon): the thread, and
with it the connection, waits for a reply nobody will send. The daemon's connection
guard aborts the connection as soon as the daemon's main thread dies; where the guard
is gone too, a new mount on the same mount point and `tierfs umount` must see the hang,
abort the connection and go on, never hang. The tests hold the connection open with a
copy of the daemon's /dev/fuse descriptor (pidfd_getfd), which keeps it alive exactly
as the stuck thread does."""
from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import socket
import subprocess
import sys

import pytest

from tests.harness import (cli_on_a_stopped_daemon, guard_pid, read_file, wait_until,
                           write_file)
from tests.moto_server import s3_env
from tests.pg_server import pg_server
from tierfs import registry
from tierfs.client import answer_wait_s
from tierfs.mountpoint import DEAD_MOUNT, abort_connection, answers, mount_device, mounts

# pidfd_getfd(2): the same number on every architecture that has the generic table.
SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438}.get(platform.machine())

# Commands on a stopped daemon wait this long for its answer, then as long for a ping
# (10 s each by default): the tests need not wait out the default.
QUICK_ANSWERS = dict(os.environ, TIERFS_ANSWER_WAIT="2")
ANSWER_WAIT_S = answer_wait_s(QUICK_ANSWERS)


def hold_connection(pid: int) -> int:
    """A copy, in this process, of the daemon's /dev/fuse descriptor."""
    if SYS_PIDFD_GETFD is None:
        pytest.skip(f"pidfd_getfd's number is not known here ({platform.machine()})")
    target = next(int(fd) for fd in os.listdir(f"/proc/{pid}/fd")
                  if os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/fuse")
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:  # an old kernel, or a seccomp filter (some containers)
        pytest.skip(f"pidfd_open failed: {e.strerror}")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
        if fd < 0:
            pytest.skip(f"pidfd_getfd failed: {os.strerror(ctypes.get_errno())}")
        return fd
    finally:
        os.close(pidfd)


def kill_guard(daemon_pid: int) -> None:
    """Kill the daemon's connection guard, as a kill of its whole cgroup might."""
    pid = guard_pid(daemon_pid)
    assert pid is not None, "every daemon runs a connection guard"
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: guard_pid(daemon_pid) != pid or _zombie(pid), 30, "the guard to die")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def dead_mount(path: str) -> bool:
    """Whether calls on the mount fail as on a dead daemon's (never hangs itself)."""
    try:
        answers(path, timeout=1)
    except OSError as e:
        return e.errno in DEAD_MOUNT
    return False


@pytest.fixture
def hung(mount_factory):
    """A mount whose daemon was killed, with its guard, while its connection
    stayed open."""
    m = mount_factory()
    write_file(m.path("f"), b"kept")
    m.cli("sync", m.mountpoint, "--wait", check=True)
    held = hold_connection(m.pid)
    try:
        kill_guard(m.pid)
        m.kill9()
        assert m.mounted and not answers(m.mountpoint, timeout=1), \
            "the dead daemon's mount should hang, not fail"
        yield m
    finally:
        os.close(held)


def test_a_new_mount_aborts_the_hung_mount_a_killed_daemon_left(hung):
    res = hung.start()
    assert "aborted the hung mount" in res.stdout, res.stdout
    assert read_file(hung.path("f")) == b"kept"
    hung.umount()


def test_umount_removes_the_hung_mount_a_killed_daemon_left(hung):
    res = hung.cli("umount", hung.mountpoint)
    # A killed daemon's last changes may not be in the bucket: exit 3, as for any.
    assert res.returncode == 3, res.stderr
    assert "aborted the hung mount" in res.stderr and "safe in its cache dir" in res.stderr
    assert not hung.mounted


def test_a_mount_that_hangs_with_its_daemon_alive_is_left_alone(mount_factory):
    """A stopped daemon is not a dead one: umount says what is wrong and gives up
    after a bounded wait; the mount works again once the daemon runs."""
    m = mount_factory()
    write_file(m.path("f"), b"kept")
    os.kill(m.pid, signal.SIGSTOP)
    try:
        res = m.cli("umount", m.mountpoint)
        assert res.returncode != 0
        assert "does not answer" in res.stderr and "/abort" in res.stderr, res.stderr
        assert m.mounted
    finally:
        os.kill(m.pid, signal.SIGCONT)
    assert read_file(m.path("f")) == b"kept"


def test_status_of_a_stopped_daemons_mount_says_it_does_not_answer(mount_factory):
    """`tierfs status` is what an operator runs when a mount misbehaves: on a daemon
    stopped (or stuck) before it started, its stat and xattr of the path waited in the
    kernel for ever, as did the first stat of a path named to prefetch & co. They now
    find the daemon from the mount table and the registry, ping it, and end with one
    line naming its pid and the fix."""
    m = mount_factory(env=QUICK_ANSWERS)
    write_file(m.path("f"), b"kept")
    os.kill(m.pid, signal.SIGSTOP)
    try:
        results = [m.cli(*args, timeout=60) for args in (
            ("status", m.mountpoint), ("status", m.path("f")),
            ("prefetch", m.path("not-looked-up-yet")))]
    finally:
        os.kill(m.pid, signal.SIGCONT)
    for res in results:
        assert res.returncode == 1, res
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
        assert "does not answer" in lines[0] and f"kill -CONT {m.pid}" in lines[0], lines[0]
    assert "hot" in m.cli("status", m.path("f"), check=True).stdout  # answers again


def test_status_finds_a_stopped_daemon_mounted_through_a_symlinked_path(mount_factory,
                                                                         tmp_path):
    """A mount made through a path with a symlink in it: the mount table names the
    resolved mount point, the registry named the path as given, so status found no
    daemon without asking the mount and waited in the kernel on a stopped one."""
    m = mount_factory(start=False, env=QUICK_ANSWERS)
    link = tmp_path / "via-link"
    link.symlink_to(tmp_path)
    m.cli("mount", m.cold_url, link / os.path.basename(m.mountpoint), "--cache-dir",
          m.cache_dir, check=True)
    m.pid = m.daemon_pid()
    os.kill(m.pid, signal.SIGSTOP)
    try:
        res = m.cli("status", m.mountpoint, timeout=60)
    finally:
        os.kill(m.pid, signal.SIGCONT)
    assert res.returncode == 1, res
    assert "does not answer" in res.stderr and f"kill -CONT {m.pid}" in res.stderr, res.stderr


def test_sync_wait_on_a_daemon_stopped_meanwhile_ends_and_says_so(mount_factory, tmp_path):
    """A daemon stopped (or stuck) while `tierfs sync --wait` waits for it: the command
    waited for ever, past its own --timeout. It ends once the daemon has said nothing
    for SYNC_SILENCE_S (three answer waits; it sends progress every half second), with
    exit 3: the data is not known to be in the bucket."""
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({}))
    m = mount_factory(args=("--fault-file", str(faults), "--upload-delay", "3600"),
                      env=QUICK_ANSWERS)
    faults.write_text(json.dumps({"hang": True, "hang_ops": ["put"]}))  # uploads wait
    write_file(m.path("f"), b"not in the bucket yet")
    try:
        sync = cli_on_a_stopped_daemon(m, ["sync", m.mountpoint, "--wait", "--timeout", "3600"],
                                       "sync", 3 * ANSWER_WAIT_S + 60)
    finally:
        faults.write_text(json.dumps({}))
    out, err = sync.stdout, sync.stderr
    assert sync.returncode == 3, (out, err)
    assert "said nothing" in err and "not known to be in the bucket" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_prefetch_on_a_daemon_stopped_meanwhile_ends_and_says_so(mount_factory, tmp_path):
    """A daemon stopped (or stuck) while `tierfs prefetch` waits for its answer: the
    command waited for ever. A prefetch may rightly take long (it fetches), so the
    command pings the daemon on a second connection when the answer is late, and
    ends with one line and exit 1 once the ping goes unanswered too."""
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({}))
    m = mount_factory(args=("--fault-file", str(faults), "--extent-size", "64K"),
                      env=QUICK_ANSWERS)
    m.allowed_log.append(r"did not answer within .*--cold-timeout")  # the fetch held up
    write_file(m.path("f"), b"cold data" * 10_000)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", m.path("f"), check=True)
    faults.write_text(json.dumps({"hang": True, "hang_ops": ["get"]}))  # fetches wait
    try:
        prefetch = cli_on_a_stopped_daemon(m, ["prefetch", m.path("f")], "prefetch_many",
                                           2 * ANSWER_WAIT_S + 60)
    finally:
        faults.write_text(json.dumps({}))
    out, err = prefetch.stdout, prefetch.stderr
    assert prefetch.returncode == 1, (out, err)
    assert "does not answer" in err and m.cache_dir in err, err
    assert f"kill -CONT {m.pid}" in err, err  # the daemon named by its pid
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert read_file(m.path("f")) == b"cold data" * 10_000  # the daemon runs again


def test_scrub_of_many_files_on_a_daemon_stopped_meanwhile_ends_at_once(mount_factory,
                                                                         tmp_path):
    """`tierfs scrub` asks for one file after another: on a daemon stopped meanwhile,
    each file's request waited for its ping to go unanswered, and the command went
    on to the next, a file at a time, for as long as the tree is large. The first
    file the daemon does not answer for ends the command."""
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({}))
    m = mount_factory(args=("--fault-file", str(faults), "--extent-size", "64K"),
                      env=QUICK_ANSWERS)
    m.allowed_log.append(r"did not answer within .*--cold-timeout")  # the reads held up
    os.mkdir(m.path("d"))
    for i in range(12):
        write_file(m.path("d", f"f{i}"), b"data %d" % i)
    m.cli("sync", m.mountpoint, "--wait", check=True)
    faults.write_text(json.dumps({"hang": True, "hang_ops": ["get"]}))  # bucket reads wait
    try:
        # One round of an answer wait and a ping, not one per file (12 files, 2 at a
        # time: 6 rounds, 24 s).
        scrub = cli_on_a_stopped_daemon(m, ["scrub", "-j", "2", m.path("d")], "scrub",
                                        3 * (2 * ANSWER_WAIT_S) + 3)
    finally:
        faults.write_text(json.dumps({}))
    out, err = scrub.stdout, scrub.stderr
    assert scrub.returncode == 1, (out, err)
    assert "does not answer" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def _daemons_of(cache_dir: str) -> list[int]:
    """Pids of the tierfs daemons started on `cache_dir`."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"tierfs" in argv and cache_dir.encode() in argv and b"--foreground" in argv:
            pids.append(int(entry))
    return pids


def test_a_daemon_that_hangs_while_starting_fails_the_mount_and_is_stopped(mount_factory,
                                                                           tmp_path):
    """A bucket that takes every request and answers none, from the start: `tierfs
    mount` waited for ever for its daemon to say it is up. It now waits at most
    --start-timeout, then stops the daemon and fails with one line, leaving nothing
    mounted or running."""
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({}))
    m = mount_factory(args=("--fault-file", str(faults)))
    m.umount()
    faults.write_text(json.dumps({"hang": True}))
    env = dict(m.env or os.environ, TIERFS_START_TIMEOUT="5")
    try:
        res = subprocess.run([sys.executable, "-m", "tierfs", "mount", m.cold_url, m.mountpoint,
                              "--cache-dir", m.cache_dir, "--fault-file", str(faults)],
                             env=env, capture_output=True, text=True, timeout=120)
    finally:
        for pid in _daemons_of(m.cache_dir):  # before the bucket answers again
            os.kill(pid, signal.SIGKILL)
        faults.write_text(json.dumps({}))
    assert res.returncode == 1, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "did not finish starting within 5s" in lines[0] and "--start-timeout" in lines[0]
    assert m.mountpoint not in mounts()
    assert _daemons_of(m.cache_dir) == []
    m.start()  # the cache dir is free again: the next mount starts
    assert m.mounted


@pytest.mark.parametrize("signum,words", [(signal.SIGINT, "interrupted"),
                                           (signal.SIGTERM, "stopped by SIGTERM"),
                                           (signal.SIGHUP, "stopped by SIGHUP")],
                         ids=["ctrl-c", "sigterm", "sighup"])
def test_ctrl_c_while_the_daemon_starts_stops_it_and_leaves_nothing_mounted(mount_factory,
                                                                            tmp_path, signum,
                                                                            words):
    """Ctrl-C on `tierfs mount` while its daemon is held up (a bucket that takes every
    request and answers none): the command returned 130 and left the daemon starting
    in the background, to mount later; SIGTERM (a service manager giving up on the
    start) and SIGHUP (the terminal closed) ended the command and left it too. Each
    now stops the daemon and says so in one line, exit 128 + the signal; nothing is
    left mounted or running."""
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({}))
    m = mount_factory(args=("--fault-file", str(faults)))
    m.umount()
    faults.write_text(json.dumps({"hang": True}))
    cmd = subprocess.Popen([sys.executable, "-m", "tierfs", "mount", m.cold_url, m.mountpoint,
                            "--cache-dir", m.cache_dir, "--fault-file", str(faults)],
                           env=m.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _daemons_of(m.cache_dir), 60, "the daemon to start")
        cmd.send_signal(signum)
        out, err = cmd.communicate(timeout=60)
        faults.write_text(json.dumps({}))  # a daemon left behind would now mount
        daemons_left = _daemons_of(m.cache_dir)
    finally:
        if cmd.poll() is None:
            cmd.kill()
            cmd.communicate()
        for pid in _daemons_of(m.cache_dir):
            os.kill(pid, signal.SIGKILL)
        faults.write_text(json.dumps({}))
    assert daemons_left == [], "the daemon kept starting after the command ended"
    assert cmd.returncode == 128 + signum, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0] and "daemon stopped" in lines[0], lines[0]
    assert m.mountpoint not in mounts()
    m.start()  # the cache dir is free again: the next mount starts
    assert m.mounted


def test_the_guard_aborts_the_connection_a_killed_daemon_left_open(mount_factory):
    """No command needed: calls on the mount fail with ENOTCONN instead of waiting,
    the log says why, and the next mount replaces the dead one."""
    m = mount_factory()
    write_file(m.path("f"), b"kept")
    m.cli("sync", m.mountpoint, "--wait", check=True)
    held = hold_connection(m.pid)
    try:
        m.kill9()
        wait_until(lambda: dead_mount(m.mountpoint), 30,
                   "the guard to abort the dead daemon's connection")
        # The guard writes its line once the abort is done.
        wait_until(lambda: "its FUSE connection was aborted" in m.log(), 30, "the guard's note")
    finally:
        os.close(held)
    res = m.start()
    assert "aborted the hung mount" not in res.stdout, "the mount was dead, not hung"
    assert read_file(m.path("f")) == b"kept"
    m.umount()


def test_a_clean_unmount_stops_the_guard_and_aborts_nothing(mount_factory):
    m = mount_factory()
    pid = guard_pid(m.pid)
    assert pid is not None, "every daemon runs a connection guard"
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[-2] == m.log_path.encode(), "it logs to the daemon's log"
    m.umount()
    assert not os.path.exists(f"/proc/{pid}"), "the daemon reaps its guard as it exits"
    assert "tierfs.guard" not in m.log()
    m.start()
    write_file(m.path("g"), b"still works")
    assert read_file(m.path("g")) == b"still works"
    m.umount()


def test_a_daemon_leaves_the_registry_when_its_session_ends(mount_factory, tmp_path):
    """The kernel hands a mount's device number to the next mount as soon as the mount
    ends, while its daemon may upload for a while yet: the daemon's registry entry
    and guard go when its FUSE session ends, not when it exits (a late exit removed
    the entry of the mount that got the number, and tierfs umount then took that
    mount's live daemon for a dead one)."""
    faults = tmp_path / "faults.json"
    m = mount_factory(args=("--fault-file", str(faults), "--upload-delay", "600"))
    write_file(m.path("f"), b"dirty until the final flush")
    dev, pid, guard = mount_device(m.mountpoint), m.pid, guard_pid(m.pid)
    assert registry.serving(dev, m.mountpoint)["pid"] == pid and guard is not None
    bucket = m.cold_url[len("file://"):]
    before = objects(bucket)
    set_faults(faults, {"hang": True, "hang_ops": ["put"]})  # the final flush waits
    subprocess.run(["fusermount3", "-u", m.mountpoint], check=True)
    wait_until(lambda: registry.serving(dev, m.mountpoint) is None and _zombie(guard), 20,
               "the entry and the guard to go")
    assert registry.main_thread_runs(pid), "the daemon is still flushing"
    assert objects(bucket) == before, "its final upload has not ended yet"
    set_faults(faults, {})  # the upload goes on
    wait_until(lambda: not registry.main_thread_runs(pid), 60, "the daemon to exit")
    m.pid = None
    assert "unmounted cleanly" in m.log()


def objects(bucket: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _dirs, files in os.walk(bucket) for f in files)


def set_faults(path, conf: dict) -> None:
    """Replace the fault file whole: a daemon must never read it half written."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(conf))
    os.replace(tmp, path)


@pytest.fixture
def own_postgres():
    """A server of this test's own (some of its backends get stopped); set up before
    the mounts, so it outlives them."""
    with pg_server() as server:
        yield server


def _pool_backends(server, daemon_pid: int) -> list[int]:
    """The server processes of the daemon's pooled connections (not its feed's), told
    apart by the application name each connection gives."""
    import psycopg
    name = f"tierfs {socket.gethostname()} pid {daemon_pid}"[:63]
    with psycopg.connect(server.url(), autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                            (name,)).fetchall()
    return [r[0] for r in rows]


def _thread_in_kernel_function(pid: int, function: str) -> bool:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stack") as f:
                if function in f.read():
                    return True
        except OSError:
            continue
    return False


def test_the_guard_frees_a_daemon_killed_while_its_feed_waits_for_a_directory(
        own_postgres, mount_factory, s3_url, s3_endpoint):
    """The hang itself, on a shared namespace: a writer creating d/x on node A holds
    d's lock while A waits for the database; node B creates d/y, and A's change feed,
    invalidating that name in the kernel, waits for d's lock. A is killed: without the
    guard, the writer and A's feed thread wait for each other for ever (the writer in
    an unkillable wait: the kernel waits out a request the daemon has read), and so
    does every caller of the mount."""
    env = dict(os.environ, **s3_env(s3_endpoint))
    args = ("--meta-url", own_postgres.new_schema(), "--meta-timeout", "120")
    a = mount_factory(cold_url=s3_url, env=env, name="a", args=args)
    b = mount_factory(cold_url=s3_url, env=env, name="b", args=args)
    os.mkdir(a.path("d"))
    assert os.listdir(a.path("d")) == [] and os.listdir(b.path("d")) == []
    stopped = _pool_backends(own_postgres, a.pid)
    assert stopped, "node A holds pooled connections"
    for pid in stopped:  # A's requests now wait for the database; its feed still hears
        os.kill(pid, signal.SIGSTOP)
    writer = None
    try:
        writer = subprocess.Popen([sys.executable, "-c", f"open({a.path('d', 'x')!r}, 'w')"],
                                  stderr=subprocess.PIPE, text=True)
        wait_until(lambda: _thread_in_kernel_function(writer.pid, "fuse_"), 30,
                   "the writer to wait for node A")
        write_file(b.path("d", "y"), b"from b")
        daemon = a.pid
        wait_until(lambda: _thread_in_kernel_function(daemon, "fuse_reverse_inval_entry"), 30,
                   "node A's feed thread to wait for the directory's lock")
        a.kill9()
        try:
            _, said = writer.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the writer still waits 30 s after node A was killed: the mount hangs")
        assert writer.returncode != 0
        assert any(os.strerror(e) in said for e in DEAD_MOUNT), said
        wait_until(lambda: registry.exited(daemon), 30, "node A's process to exit")
        wait_until(lambda: "its FUSE connection was aborted" in a.log(), 30, "the guard's note")
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if writer is not None and writer.poll() is None:
            writer.kill()
            try:
                writer.wait(timeout=10)
            except subprocess.TimeoutExpired:  # its request is with a dead daemon: the
                dev = mount_device(a.mountpoint)  # kernel waits it out, unkillably,
                if dev is not None:  # until the connection is aborted
                    abort_connection(dev)
                writer.wait(timeout=30)
    assert read_file(b.path("d", "y")) == b"from b"
    a.start()
    assert read_file(a.path("d", "y")) == b"from b"
