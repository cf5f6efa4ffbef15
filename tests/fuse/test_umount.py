"""`tierfs umount` with an upload backlog: progress on a terminal, quiet otherwise."""
from __future__ import annotations

import errno
import json
import os
import pty
import signal
import subprocess
import sys

import pytest

from tests.fuse.test_durability import hot_files
from tests.fuse.test_tiering import pattern, status
from tests.harness import read_file, write_file

KiB = 1 << 10


def slow_bucket_mount(mount_factory, tmp_path, files: int):
    """A mount whose bucket answers every call after 0.2 s, with `files` small files
    not uploaded yet: unmounting it takes at least files * 0.2 s."""
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"latency_s": 0.2}))
    m = mount_factory(args=("--fault-file", str(faults), "--upload-parallel", "1",
                            "--upload-delay", "3600"))
    for i in range(files):
        write_file(m.path(f"f{i}"), pattern(64 * KiB, i))
    assert status(m)["dirty_extents"] == files
    return m


def run_on_terminal(argv: list[str]) -> tuple[int, str]:
    """Run a command with a pseudo-terminal as stdin, stdout and stderr."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave)
        os.close(slave)
        out = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            out += chunk
        return proc.wait(timeout=120), out.decode(errors="replace")
    finally:
        os.close(master)


def test_umount_shows_upload_progress_on_a_terminal(mount_factory, tmp_path):
    m = slow_bucket_mount(mount_factory, tmp_path, files=8)
    rc, out = run_on_terminal([sys.executable, "-m", "tierfs", "umount", m.mountpoint])
    m.pid = None
    assert rc == 0, out
    assert "uploading before unmount:" in out and "of 512.0 KiB" in out
    assert f"unmounted {m.mountpoint}" in out
    assert not m.mounted


def test_umount_is_quiet_when_not_on_a_terminal(mount_factory, tmp_path):
    m = slow_bucket_mount(mount_factory, tmp_path, files=4)
    res = m.cli("umount", m.mountpoint)
    m.pid = None
    assert res.returncode == 0, res.stderr
    assert res.stderr == "" and res.stdout == f"unmounted {m.mountpoint}\n"


def test_foreground_daemon_tells_systemd_when_mounted_and_umount_finds_it_by_config(
        mount_factory, tmp_path):
    """What deploy/tierfs@.service relies on: Type=notify gets READY=1 only once the
    mount answers (and STOPPING=1 as it unmounts), and ExecStop finds the mount point
    in the instance's TOML file."""
    import socket
    m = mount_factory(start=False)
    conf = tmp_path / "train.toml"
    conf.write_text(f'cold_url = "{m.cold_url}"\nmountpoint = "{m.mountpoint}"\n'
                    f'cache_dir = "{m.cache_dir}"\n')
    sock_path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(sock_path)
        sock.settimeout(60)
        daemon = subprocess.Popen(
            [sys.executable, "-m", "tierfs", "mount", "--config", str(conf), "--foreground"],
            env=dict(os.environ, NOTIFY_SOCKET=sock_path), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        m.pid = daemon.pid
        try:
            assert sock.recv(256) == b"READY=1"
            assert m.mounted
            write_file(m.path("f"), b"ready")
            res = m.cli("umount", "--config", str(conf))
            assert res.returncode == 0, res.stderr
            assert res.stdout == f"unmounted {m.mountpoint}\n"
            assert daemon.wait(timeout=60) == 0
            m.pid = None
            assert sock.recv(256) == b"STOPPING=1"  # sent as the unmount began
        finally:
            if daemon.poll() is None:
                daemon.kill()
            daemon.communicate()


@pytest.mark.allow_log_errors
def test_umount_says_data_whose_hot_file_was_deleted_is_lost(mount_factory):
    """A dirty extent whose hot file was deleted behind the daemon's back can never
    upload: sync --wait and umount say so (exit 3) at once, instead of waiting out their
    timeouts; umount takes the final checkpoint and no longer promises that the data
    uploads on the next mount."""
    m = mount_factory(args=("--upload-delay", "3600", "--unmount-upload-timeout", "20"))
    m.allowed_log += ["hot file missing", "dirty hot file missing"]
    write_file(m.path("kept"), pattern(64 * KiB, 1))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    before = set(hot_files(m))
    for i in range(2):  # small files: they upload packed, their hot files read by path
        write_file(m.path(f"gone{i}"), pattern(64 * KiB, 2 + i))
    for path in set(hot_files(m)) - before:
        os.unlink(path)
    res = m.cli("sync", m.mountpoint, "--wait", "--timeout", "20")
    assert res.returncode == 3 and "2 extents (131072 bytes) are lost" in res.stderr, res.stderr
    res = m.cli("umount", m.mountpoint)
    m.pid = None
    assert res.returncode == 3, res.stderr
    assert "128.0 KiB in 2 extents is lost" in res.stderr, res.stderr
    assert "fsck --repair" in res.stderr and "next mount" not in res.stderr
    assert "final metadata checkpoint" not in res.stderr  # it was not skipped


def test_umount_of_a_mount_point_with_odd_characters(mount_factory):
    """/proc/self/mounts escapes space, tab, newline and backslash: a mount point with
    any of them is still found (it was taken for not mounted, and left mounted)."""
    m = mount_factory(name="odd \\ \tname")
    write_file(m.path("f"), b"x")
    res = m.cli("umount", m.mountpoint)
    assert res.returncode == 0, res.stderr
    m.pid = None
    assert res.stdout == f"unmounted {m.mountpoint}\n"
    with open("/proc/self/mounts") as f:
        assert "odd\\040\\134\\040\\011name-mnt" not in f.read()


def _held_in_final_checkpoint(mount_factory, tmp_path):
    """A mount whose next checkpoint the bucket takes and never answers (until its
    fault file is emptied): its daemon is held up in the final checkpoint of an
    unmount. Returns (the mount, its fault file)."""
    faults = tmp_path / "faults.json"
    faults.write_text("{}")
    m = mount_factory(args=("--fault-file", str(faults)))
    os.mkdir(m.path("d"))  # a change the final checkpoint has to take to the bucket
    faults.write_text(json.dumps({"hang": True, "hang_ops": ["put"]}))
    return m, faults


@pytest.mark.allow_log_errors
def test_umount_of_a_daemon_killed_while_it_unmounts_is_not_reported_clean(mount_factory,
                                                                         tmp_path):
    """The daemon dies (OOM killer) during its final flush, before it could write its
    exit report: umount cannot know what reached the bucket, so it says so (exit 3)
    instead of 'unmounted' and exit 0."""
    from tests.harness import wait_until
    m, _faults = _held_in_final_checkpoint(mount_factory, tmp_path)
    umount = _start_umount(m)
    try:
        wait_until(lambda: not m.mounted, 60, "the kernel to let go of the mount")
        m.kill9()  # stuck in its final checkpoint, which the bucket does not answer
        out, err = umount.communicate(timeout=60)
    finally:
        if umount.poll() is None:
            umount.kill()
        umount.communicate()
    assert umount.returncode == 3, (out, err)
    assert out == "" and "ended before it finished unmounting" in err, err
    assert f"{m.cache_dir}/tierfs.log" in err


def test_umount_timeout_bounds_the_wait_for_a_daemon_that_does_not_exit(mount_factory,
                                                                         tmp_path):
    """After the kernel let go of the mount, umount waits for the daemon to exit: a
    daemon held up in its final checkpoint (a bucket that takes the request and never
    answers) kept it waiting a fixed hour, with no option to change that. --timeout
    bounds the wait; its end is one line naming the daemon, exit 3 (what it has not
    uploaded is not known to be in the bucket)."""
    from tests.harness import wait_until
    from tierfs import registry
    m, faults = _held_in_final_checkpoint(mount_factory, tmp_path)
    pid = m.pid
    try:
        res = m.cli("umount", m.mountpoint, "--timeout", "3", timeout=120)
        assert not m.mounted
        assert registry.main_thread_runs(pid), "the daemon should still be held up"
    finally:
        faults.write_text("{}")  # the checkpoint goes through, and the daemon exits
    wait_until(lambda: not registry.main_thread_runs(pid), 120, f"daemon {pid} to exit")
    m.pid = None
    assert res.returncode == 3, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"(pid {pid}) has not exited 3s after the unmount" in lines[0], lines[0]
    assert f"kill -USR1 {pid}" in lines[0]


def _start_umount(m, env=None) -> subprocess.Popen:
    # PYTHONFAULTHANDLER: a SIGABRT makes it print its threads' stacks (_interrupted).
    return subprocess.Popen([sys.executable, "-m", "tierfs", "umount", m.mountpoint],
                            env=dict(env or m.env or os.environ, PYTHONFAULTHANDLER="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _process_tree(pid: int) -> str:
    """A line per process of the tree at `pid`: its state, where in the kernel it
    waits, its signal masks (is SIGINT ignored, caught, pending?), its command."""
    lines, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{p}/wchan") as f:
                wchan = f.read() or "-"
            with open(f"/proc/{p}/status") as f:  # signals ignored, caught, pending
                masks = " ".join(line.split()[0] + line.split()[1] for line in f
                                 if line.startswith(("SigIgn", "SigCgt", "SigPnd", "ShdPnd")))
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue  # gone meanwhile
        lines.append(f"  pid {p} state {state} waiting in {wchan} ({masks}): {cmd}")
    return "\n".join(lines)


def _interrupted(umount: subprocess.Popen, ready, what: str) -> tuple[str, str]:
    """Ctrl-C to a running `tierfs umount` once ready(); its (stdout, stderr). One
    that has not ended 60 s later fails the test with where it and its children wait
    and its threads' stacks, and is killed."""
    from tests.harness import wait_until
    try:
        wait_until(ready, 60, what)
        assert umount.poll() is None, umount.communicate()
        umount.send_signal(signal.SIGINT)
        try:
            return umount.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            where = _process_tree(umount.pid)
            umount.send_signal(signal.SIGABRT)
            try:
                stacks = umount.communicate(timeout=10)[1]
            except subprocess.TimeoutExpired:
                stacks = "(no stacks: SIGABRT did not end it within 10 s)"
            pytest.fail(f"tierfs umount had not ended 60 s after Ctrl-C:\n{where}\n{stacks}")
    finally:
        if umount.poll() is None:
            umount.kill()
            umount.communicate()


def test_ctrl_c_while_umount_waits_for_the_daemon_says_what_goes_on(mount_factory, tmp_path):
    """Ctrl-C while umount waits for a daemon held up in its final checkpoint: the
    command exited 130 without a word, leaving the user to guess whether the
    filesystem was unmounted and what became of the data. It now says in one line that
    the mount is gone and which daemon goes on in the background."""
    from tests.harness import wait_until
    from tierfs import registry
    m, faults = _held_in_final_checkpoint(mount_factory, tmp_path)
    pid = m.pid
    umount = _start_umount(m)
    try:
        out, err = _interrupted(umount, lambda: not m.mounted,
                                "the kernel to let go of the mount")
        still_running = registry.main_thread_runs(pid)
    finally:
        faults.write_text("{}")  # the checkpoint goes through, and the daemon exits
    wait_until(lambda: not registry.main_thread_runs(pid), 120, f"daemon {pid} to exit")
    m.pid = None
    assert still_running, "the daemon should have gone on after the interrupt"
    assert umount.returncode == 130, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "interrupted" in lines[0] and f"(pid {pid}) goes on" in lines[0], lines[0]
    assert m.cache_dir in lines[0], lines[0]


def _umount_with_slow_fusermount(m, tmp_path, script: str) -> subprocess.Popen:
    """tierfs umount with a fusermount3 on PATH that runs `script` around the real one
    (called as "$REAL" "$@"), and marks its start in tmp_path/started."""
    import shutil
    shim_dir = tmp_path / "shim"
    shim_dir.mkdir()
    shim = shim_dir / "fusermount3"
    shim.write_text(f'#!/bin/sh\nREAL={shutil.which("fusermount3")}\n'
                    f'touch {tmp_path}/started\n{script}\n')
    shim.chmod(0o755)
    env = dict(m.env or os.environ)
    env["PATH"] = f"{shim_dir}:{env['PATH']}"
    return _start_umount(m, env)


def test_ctrl_c_after_the_kernel_let_go_but_before_fusermount_returned(mount_factory,
                                                                        tmp_path):
    """Ctrl-C in the moment between the kernel letting go of the mount and fusermount3
    exiting: umount exited 130 without a word (a failure seen in CI). It says the mount
    is gone and the daemon goes on, as for an interrupt a moment later."""
    from tests.harness import wait_until
    from tierfs import registry
    m, faults = _held_in_final_checkpoint(mount_factory, tmp_path)
    pid = m.pid
    umount = _umount_with_slow_fusermount(m, tmp_path, '"$REAL" "$@" && sleep 2')
    try:
        out, err = _interrupted(umount, lambda: not m.mounted,
                                "the kernel to let go of the mount")
    finally:
        faults.write_text("{}")  # the checkpoint goes through, and the daemon exits
    wait_until(lambda: not registry.main_thread_runs(pid), 120, f"daemon {pid} to exit")
    m.pid = None
    assert umount.returncode == 130, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"{m.mountpoint} is unmounted" in lines[0] and f"(pid {pid}) goes on" in lines[0]


def test_ctrl_c_before_the_kernel_let_go_says_the_mount_is_still_there(mount_factory,
                                                                      tmp_path):
    """Ctrl-C while fusermount3 has not unmounted yet (here: it never gets to): umount
    says the filesystem is still mounted and how to finish, instead of a silent 130."""
    m = mount_factory()
    write_file(m.path("kept"), b"still here")
    umount = _umount_with_slow_fusermount(m, tmp_path, 'sleep 60; "$REAL" "$@"')
    out, err = _interrupted(umount, (tmp_path / "started").exists, "fusermount3 to start")
    assert umount.returncode == 130, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"{m.mountpoint} is still mounted" in lines[0], lines[0]
    assert f"tierfs umount {m.mountpoint}" in lines[0], lines[0]
    assert m.mounted and read_file(m.path("kept")) == b"still here"


def test_umount_refuses_a_timeout_that_is_no_bounded_wait(mount_factory):
    """NaN would make the wait endless: refused in one line before anything is done."""
    m = mount_factory()
    for bad in ("nan", "-1"):
        res = m.cli("umount", m.mountpoint, "--timeout", bad)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res
        assert "--timeout" in res.stderr and m.mounted


@pytest.mark.allow_log_errors
def test_dirty_data_whose_hot_file_vanished_while_unmounted_is_reported_lost(mount_factory):
    """The daemon died with data not uploaded, and its hot file was deleted before the
    next mount: sync --wait and umount said everything was in the bucket (exit 0)."""
    m = mount_factory(args=("--upload-delay", "3600"))
    m.allowed_log += ["hot file missing"]
    write_file(m.path("kept"), pattern(64 * KiB, 1))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    before = set(hot_files(m))
    write_file(m.path("gone"), pattern(100 * KiB, 2))
    os.sync()
    m.kill9()
    (gone,) = set(hot_files(m)) - before
    os.unlink(gone)
    m.start()
    with pytest.raises(OSError) as err:  # a read of it fails; it stays counted as lost
        read_file(m.path("gone"))
    assert err.value.errno == errno.EIO
    res = m.cli("sync", m.mountpoint, "--wait", "--timeout", "20")
    assert res.returncode == 3 and "1 extents (102400 bytes) are lost" in res.stderr, res.stderr
    res = m.cli("umount", m.mountpoint)
    m.pid = None
    assert res.returncode == 3 and "100.0 KiB in 1 extents is lost" in res.stderr, res.stderr


def test_umount_through_a_symlink_to_the_mount_point(mount_factory, tmp_path):
    """A symlink naming the mount point (/mnt/data -> /nvme/mnt) unmounts it; it was
    said to be 'not mounted'."""
    m = mount_factory()
    link = tmp_path / "link"
    link.symlink_to(m.mountpoint)
    res = m.cli("umount", str(link))
    assert res.returncode == 0, res.stderr
    m.pid = None
    assert res.stdout == f"unmounted {m.mountpoint}\n" and not m.mounted


def test_umount_through_a_symlinked_directory_above_the_mount_point(mount_factory,
                                                                     tmp_path):
    """The path the mount was made with (/data/mnt, /data -> /nvme) unmounts it, also
    where a directory above the mount point is the symlink; it was said to be 'not
    mounted'."""
    m = mount_factory()
    link = tmp_path / "via-link"
    link.symlink_to(tmp_path)
    res = m.cli("umount", str(link / os.path.basename(m.mountpoint)))
    assert res.returncode == 0, res.stderr
    m.pid = None
    assert res.stdout == f"unmounted {m.mountpoint}\n" and not m.mounted


def test_umount_of_a_killed_daemons_mount_does_not_say_all_is_in_the_bucket(mount_factory):
    """The daemon was killed with data not uploaded: umount removed its stale mount and
    exited 0, which promises everything is in the bucket. It exits 3 and says where
    the data waits; the next mount uploads it."""
    m = mount_factory(args=("--upload-delay", "3600"))
    write_file(m.path("f"), pattern(64 * KiB, 5))
    assert status(m)["dirty_extents"] == 1
    m.kill9()
    res = m.cli("umount", m.mountpoint)
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert res.stdout == "" and "removed the stale mount" in res.stderr, res.stderr
    assert f"safe in its cache dir {m.cache_dir}" in res.stderr, res.stderr
    assert not m.mounted
    m.start()
    assert read_file(m.path("f")) == pattern(64 * KiB, 5)
