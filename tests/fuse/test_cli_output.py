"""What the tierfs command prints, through a real mount: status of a mount, a
directory and a file; singular and plural; commands on paths outside any mount;
progress lines on a terminal and silence elsewhere."""
from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from tests.fuse.test_tiering import pattern, status
from tests.harness import drop_page_cache, run_cli, wait_until, write_file

MiB = 1 << 20

WHOLE_MOUNT_LINES = ("cache ", "uploads ", "bucket gc", "hit rate", "bucket ", "hot tier",
                     "integrity")
# A count of one with a plural noun, in any output of the command.
WRONG_PLURAL = re.compile(r"(?<![\d.,])1 (files|errors|extents|uploads|requests|fetches|"
                          r"evictions|objects|problems|copies|checkpoints|slots|waits|failures)\b")


def run_on_terminal(m, *args, timeout=120) -> tuple[int, str, str]:
    """Run `tierfs ARGS` with stderr on a pseudo-terminal (stdout a pipe): returns
    (exit status, stdout, what the terminal received)."""
    master, slave = os.openpty()
    # A wide terminal: the line is cut to the terminal's width (80 when unknown).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))
    try:
        proc = subprocess.Popen([sys.executable, "-m", "tierfs", *map(str, args)],
                                stdout=subprocess.PIPE, stderr=slave, env=m.env)
    finally:
        os.close(slave)
    term = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has gone
                break
            if not chunk:
                break
            term += chunk
        out = proc.stdout.read()
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        os.close(master)
    return rc, out.decode(), term.decode().replace("\r\n", "\n")  # the tty's own translation


def faulty(mount_factory, tmp_path, *args):
    """A mount on a file:// bucket steered through a fault file; returns (mount, set_faults)."""
    faults = tmp_path / "faults.json"
    m = mount_factory(args=("--extent-size", "1M", "--fault-file", str(faults), *args))

    def set_faults(**conf):
        faults.write_text(json.dumps(conf))
    return m, set_faults


# ---- status ------------------------------------------------------------------------

def test_status_of_a_file_shows_its_own_block_only(mount_factory):
    m = mount_factory(args=("--extent-size", "1M", "--upload-delay", "3600"))
    write_file(m.path("f"), pattern(3 * MiB + 100, 1))
    m.cli("sync", m.path("f"), "--wait", check=True)
    m.cli("release", m.path("f"), check=True)
    with open(m.path("f"), "r+b") as f:   # extent 1 fetched back and made dirty
        f.seek(MiB + 10)
        f.write(b"new")
    res = m.cli("status", m.path("f"), check=True)
    lines = res.stdout.splitlines()
    assert lines[0] == f"mount        {m.mountpoint}  ->  {status(m)['cold']}"
    assert lines[1] == f"file         {m.path('f')}: 3.0 MiB in 4 extents of 1.0 MiB"
    assert lines[2] == "hot          1.0 MiB"
    assert lines[3].startswith("cold only    2.0 MiB")
    assert lines[4].startswith("dirty        1.0 MiB")
    assert lines[6:] == ["  extents 0             cold", "  extents 1             hot dirty",
                         "  extents 2-3           cold"]
    for word in WHOLE_MOUNT_LINES:
        assert not any(line.startswith(word) for line in lines), res.stdout
    st = status(m, m.path("f"))
    assert st["mountpoint"] == m.mountpoint and st["pid"] == m.pid
    assert st["file"]["path"] == m.path("f") and st["file"]["dirty"] == MiB
    assert st["file"]["cold"] == 2 * MiB + 100 and st["file"]["hot"] == MiB
    assert "hot_bytes" not in st and "counters" not in st   # not the whole mount's figures


def test_status_of_a_directory_totals_everything_below_it(mount_factory):
    m = mount_factory(args=("--extent-size", "1M", "--upload-delay", "3600"))
    os.makedirs(m.path("ds/sub"))
    sizes = {"ds/cold": 3 * MiB + 5, "ds/pinned": 2 * MiB, "ds/sub/dirty": MiB + 7}
    write_file(m.path("ds/cold"), pattern(sizes["ds/cold"], 1))
    write_file(m.path("ds/pinned"), pattern(sizes["ds/pinned"], 2))
    write_file(m.path("outside"), pattern(5 * MiB, 3))        # not below ds: not counted
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", m.path("ds/cold"), check=True)
    m.cli("pin", m.path("ds/pinned"), check=True)
    write_file(m.path("ds/sub/dirty"), pattern(sizes["ds/sub/dirty"], 4))  # not uploaded
    os.link(m.path("ds/pinned"), m.path("ds/sub/link"))       # one file, two names
    os.symlink("pinned", m.path("ds/symlink"))
    total = sum(sizes.values())
    st = status(m, m.path("ds"))
    assert "hot_bytes" not in st
    d = st["directory"]
    assert d == {"path": m.path("ds"), "files": 3, "directories": 1, "other": 1,
                 "bytes": total, "hot": sizes["ds/pinned"] + sizes["ds/sub/dirty"],
                 "cold": sizes["ds/cold"], "dirty": sizes["ds/sub/dirty"],
                 "pinned": sizes["ds/pinned"], "complete": True, "entries_limit": d["entries_limit"]}
    res = m.cli("status", m.path("ds"), check=True)
    lines = res.stdout.splitlines()
    assert lines[1] == (f"directory    {m.path('ds')}: 3 files (6.0 MiB), 1 subdirectory, "
                        f"1 other entry")
    assert lines[2:6] == ["hot          3.0 MiB",
                          "cold only    3.0 MiB (in the bucket, not on the hot tier)",
                          "dirty        1.0 MiB (not in the bucket yet)",
                          "pinned       2.0 MiB"]
    for word in WHOLE_MOUNT_LINES:
        assert not any(line.startswith(word) for line in lines), res.stdout
    # The mount point keeps the whole-mount block.
    res = m.cli("status", m.mountpoint, check=True)
    starts = [line.split()[0] for line in res.stdout.splitlines()]
    assert "hit" in starts and "directory" not in starts


def test_status_counts_uploads_in_progress_against_the_slots(mount_factory, tmp_path):
    """The uploader holds every extent handed to it; only --upload-parallel of them
    upload at a time, the others wait for a slot."""
    m, set_faults = faulty(mount_factory, tmp_path, "--upload-parallel", "3",
                           "--upload-delay", "3600")
    set_faults(hang=True)                       # every bucket call blocks
    try:
        write_file(m.path("f"), pattern(10 * MiB, 5))
        m.cli("sync", m.path("f"), check=True)  # upload now, without waiting
        st = wait_until(lambda: (s := status(m))["uploads_running"] == 3 and s, 30,
                        "three uploads to hang in the bucket")
        assert st["upload_slots"] == 3 and st["uploads_queued"] == 7
        res = m.cli("status", m.mountpoint, check=True)
        assert "3 of 3 upload slots busy, 7 extents queued" in res.stdout
    finally:
        set_faults()
    wait_until(lambda: status(m)["dirty_bytes"] == 0, 60, "the uploads to finish")
    res = m.cli("status", m.mountpoint, check=True)
    assert "0 of 3 upload slots busy" in res.stdout and "queued" not in res.stdout


def test_status_of_the_mount_says_where_the_cache_limit_comes_from(mount_factory):
    m = mount_factory(args=("--cache-size", "64M", "--min-free", "0"))
    st = status(m)
    assert st["cache_limit"] == 64 * MiB and st["cache_limit_note"].startswith("--cache-size")
    res = m.cli("status", m.mountpoint, check=True)
    assert f"cache        limit 64.0 MiB [{st['cache_limit_note']}], policy lru\n" in res.stdout
    m.remount("--cache-size", "0")                       # 0: the default share of the disk
    st = status(m)
    assert st["cache_limit_note"].startswith("default: 90% of ")
    res = m.cli("status", m.mountpoint, check=True)
    assert f"[{st['cache_limit_note']}], policy lru" in res.stdout


@pytest.mark.allow_log_errors
def test_counts_of_one_are_singular(mount_factory):
    m = mount_factory(args=("--extent-size", "1M", "--upload-delay", "3600"))
    m.allowed_log.append("hot copy is damaged")
    os.makedirs(m.path("one"))
    write_file(m.path("one/f"), pattern(100_000, 6))
    outputs = []
    res = m.cli("status", m.mountpoint, check=True)
    outputs.append(res.stdout)
    lines = res.stdout.splitlines()
    assert lines[1] == "hot          97.7 KiB in 1 extent"
    assert lines[3] == "dirty        97.7 KiB in 1 extent"
    res = m.cli("release", m.path("one/f"), check=True)
    outputs.append(res.stdout)
    assert "in 1 file; kept 1 dirty extent (" in res.stdout
    res = m.cli("sync", m.mountpoint, "--wait", check=True)
    res = m.cli("status", m.mountpoint, check=True)
    outputs.append(res.stdout)
    assert re.search(r"\b1 upload \(", res.stdout), res.stdout
    res = m.cli("status", m.path("one"), check=True)
    outputs.append(res.stdout)
    assert ": 1 file (97.7 KiB), 0 subdirectories" in res.stdout
    res = m.cli("prefetch", m.path("one/f"), check=True)
    outputs.append(res.stdout)
    assert res.stdout.startswith("prefetched 1 file:")
    hot = os.path.join(m.cache_dir, "hot")
    [hot_file] = [os.path.join(r, f) for r, _d, fs in os.walk(hot) for f in fs]
    with open(hot_file, "r+b") as f:            # rot one hot copy behind the daemon's back
        f.seek(10)
        f.write(b"\0rot\0")
    res = m.cli("scrub", m.path("one"), check=True)
    outputs.append(res.stdout)
    assert res.stdout.startswith("scrubbed 1 file in ")
    assert ("0 hot extents ok, 1 damaged hot copy replaced from the bucket, 1 object ok, "
            "0 damaged objects, 0 dirty extents not checked") in res.stdout
    res = m.cli("status", m.mountpoint, check=True)
    outputs.append(res.stdout)
    for out in outputs:
        assert not WRONG_PLURAL.search(out), out


# ---- paths outside any mount ---------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ("scrub", "{dir}"), ("prefetch", "{file}"), ("prefetch", "-r", "{dir}"),
    ("release", "{file}"), ("release", "-r", "{dir}"), ("pin", "{file}"),
    ("unpin", "-r", "{dir}"), ("sync", "{dir}"), ("sync", "{file}", "--wait"),
    ("status", "{dir}"), ("status", "{file}"),
])
def test_commands_on_a_path_outside_any_mount_fail_at_once(tmp_path, argv):
    outside = tmp_path / "plain"
    outside.mkdir()
    (outside / "a.bin").write_bytes(b"x" * 1000)
    paths = {"dir": str(outside), "file": str(outside / "a.bin")}
    argv = [a.format(**paths) for a in argv]
    named = next(a for a in argv[1:] if not a.startswith("-"))
    res = run_cli(*argv)
    assert res.returncode == 1, res
    assert res.stdout == ""                      # no "scrubbed 0 files" or the like
    assert res.stderr == f"tierfs: {named} is not inside a tierfs mount\n"


def test_a_second_path_outside_the_mount_fails_before_any_work(mount_factory, tmp_path):
    m = mount_factory()
    write_file(m.path("f"), b"y" * 1000)
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"x")
    res = m.cli("pin", m.path("f"), str(outside))
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr == f"tierfs: {outside} is not inside a tierfs mount\n"
    assert status(m, m.path("f"))["file"]["pinned"] == 0   # nothing was done


# ---- progress --------------------------------------------------------------------------

def test_sync_wait_shows_progress_on_a_terminal_only(mount_factory, tmp_path):
    # Every bucket call takes 0.3 s: the waits last long enough for progress lines.
    m, set_faults = faulty(mount_factory, tmp_path, "--upload-delay", "3600",
                           "--upload-parallel", "2")
    set_faults(latency_s=0.3)
    write_file(m.path("a"), pattern(8 * MiB, 7))
    rc, out, term = run_on_terminal(m, "sync", m.mountpoint, "--wait")
    assert rc == 0 and "everything is in the bucket" in out
    lines = term.split("\n")
    assert lines[-1] == "" and len(lines) == 2, term  # one refreshed line, ended by a newline
    shown = [s.strip() for s in lines[0].split("\r") if s.strip()]
    assert any(re.fullmatch(r"uploading: [\d.]+ (B|KiB|MiB) of 8\.0 MiB \(\d+%\), "
                            r"[\d.]+ (B|KiB|MiB)/s, ETA \d+s \(\d of 2 upload slots busy\)",
                            s) for s in shown), shown
    assert shown[-1].startswith("uploading: 8.0 MiB of 8.0 MiB (100%)"), shown
    write_file(m.path("b"), pattern(8 * MiB, 8))
    res = m.cli("sync", m.mountpoint, "--wait", check=True)   # stderr is a pipe
    assert res.stderr == "" and "everything is in the bucket" in res.stdout
    assert status(m)["dirty_bytes"] == 0


def test_prefetch_counts_the_bytes_of_one_large_file(mount_factory, tmp_path):
    m, set_faults = faulty(mount_factory, tmp_path)
    write_file(m.path("big"), pattern(8 * MiB, 9))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", m.path("big"), check=True)
    drop_page_cache(m.mountpoint)
    set_faults(latency_s=0.3)    # 8 fetches, 2 at a time: over a second
    rc, out, term = run_on_terminal(m, "prefetch", "-j", "2", m.path("big"))
    assert rc == 0 and out.startswith("prefetched 1 file: 8.0 MiB fetched"), out
    shown = [s.strip() for s in term.rstrip("\n").split("\r") if s.strip()]
    # Part of the one file done: the line moves before the file is complete.
    partial = [s for s in shown if re.match(r"prefetch: [1-7]\.0 MiB of 8\.0 MiB \(\d+%\)", s)]
    assert partial, shown
    assert term.endswith("\n") and shown[-1].startswith("prefetch: 8.0 MiB of 8.0 MiB (100%)")
    res = m.cli("release", m.path("big"), check=True)
    res = m.cli("prefetch", m.path("big"), check=True)     # stderr is a pipe: quiet
    assert res.stderr == ""


def test_fsck_reports_the_bytes_it_verifies(mount_factory):
    from tierfs.filesystem import meta_dir, open_cold
    from tierfs.config import MountConfig
    from tierfs.hot import HotStore
    from tierfs.meta import MetaStore
    from tierfs.tier.fsck import Fsck

    m = mount_factory(args=("--extent-size", "1M"))
    write_file(m.path("a"), pattern(3 * MiB + 5, 10))
    write_file(m.path("b"), pattern(MiB // 2, 11))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", m.path("a"), check=True)            # a is read from the bucket only
    m.umount()
    meta = MetaStore(meta_dir(m.cache_dir))
    hot = HotStore(os.path.join(m.cache_dir, "hot"))
    calls = []
    try:
        cold = open_cold(MountConfig(m.cold_url, "", m.cache_dir))
        findings = Fsck(meta, hot, cold, MiB, repair=False, verify_data=True,
                        on_progress=lambda done, total: calls.append((done, total))).run()
    finally:
        hot.close()
        meta.close()
    assert findings == []
    # a: its objects; b: its hot copy and its object.
    expect = (3 * MiB + 5) + 2 * (MiB // 2)
    assert calls and all(total == expect for _d, total in calls)
    dones = [d for d, _t in calls]
    assert dones == sorted(dones) and dones[-1] == expect and len(dones) == 5
