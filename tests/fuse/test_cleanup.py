"""The suite's own cleanup: a test that leaves a mount fails and the mount goes,
a run stopped by SIGTERM still takes its mounts and daemons down, and a test that
hangs fails alone, with the stacks that show where."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests.harness import short_tmpdir, tierfs_daemons, wait_until
from tierfs.mountpoint import mounts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_pytest(*cases: str, basetemp, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--basetemp", str(basetemp),
                             *(f"tests/fuse/leaky_cases.py::{case}" for case in cases)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kw)


def tierfs_mounts_below(path) -> list[str]:
    return [p for p, kind in mounts().items() if kind == "fuse.tierfs" and p.startswith(str(path))]


def daemons_below(path) -> list[int]:
    return [pid for pid, (mnt, _s) in tierfs_daemons().items() if mnt and mnt.startswith(str(path))]


@pytest.fixture
def short_tmp():
    """A short base directory (pytest's own nest too deep for a control socket path)."""
    path = short_tmpdir("tierfs-lk-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_test_that_leaves_a_mount_fails_and_the_mount_goes(short_tmp):
    tmp_path = short_tmp
    proc = run_pytest("test_leaves_a_mount", basetemp=os.path.join(tmp_path, "run"))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    assert "the test left running" in out, out
    assert tierfs_mounts_below(tmp_path) == [] and daemons_below(tmp_path) == []


def test_a_run_stopped_by_sigterm_takes_its_mounts_down(short_tmp):
    tmp_path = short_tmp
    ready = os.path.join(tmp_path, "ready")
    proc = run_pytest("test_is_stopped_while_mounted", basetemp=os.path.join(tmp_path, "run"),
                      env=dict(os.environ, LEAKY_READY=ready))
    try:
        wait_until(lambda: os.path.exists(ready) or proc.poll() is not None, 120,
                   "the test's mount to be up")
        assert proc.poll() is None, proc.communicate()[0]
        assert tierfs_mounts_below(tmp_path), "the mount was not up"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "stopped by signal" in out, out
    assert tierfs_mounts_below(tmp_path) == [] and daemons_below(tmp_path) == []


def test_a_hung_test_fails_alone_with_its_stacks_and_the_run_goes_on(short_tmp):
    tmp_path = short_tmp
    proc = run_pytest("test_hangs_on_a_stopped_daemon", "test_runs_after_the_hung_one",
                      basetemp=os.path.join(tmp_path, "run"),
                      env=dict(os.environ, TIERFS_TEST_LIMIT_S="5"))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "test_hangs_on_a_stopped_daemon ran past its limit of 5 s" in out, out
    # The test process's stack shows the read it waited in.
    assert "in test_hangs_on_a_stopped_daemon" in out, out
    assert "daemon " in out and "its stacks:" in out, out
    assert tierfs_mounts_below(tmp_path) == [] and daemons_below(tmp_path) == []


def sweep_from_another_run() -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from tests.harness import sweep_dead_sessions as s; print(s())"],
        cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("daemon", ["running", "killed"])
def test_the_next_run_sweeps_what_a_killed_run_left(short_tmp, daemon):
    """A run killed with -9 runs no teardown: its daemon and its mount, live or
    left stale by a daemon killed too, are stopped by the next run that starts."""
    tmp_path = short_tmp
    ready = os.path.join(tmp_path, "ready")
    proc = run_pytest("test_is_stopped_while_mounted",
                      basetemp=os.path.join(tmp_path, "run"),
                      env=dict(os.environ, LEAKY_READY=ready))
    try:
        wait_until(lambda: os.path.exists(ready) or proc.poll() is not None, 120,
                   "the test's mount to be up")
        assert proc.poll() is None, proc.communicate()[0]
        proc.kill()
        proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    [mountpoint] = tierfs_mounts_below(tmp_path)
    [pid] = daemons_below(tmp_path)
    if daemon == "killed":
        os.kill(pid, signal.SIGKILL)  # its mount is left stale
        wait_until(lambda: daemons_below(tmp_path) == [], 30, f"daemon {pid} to exit")
    sweep = sweep_from_another_run()
    assert sweep.returncode == 0, sweep.stderr
    assert mountpoint in sweep.stdout, sweep.stdout
    wait_until(lambda: daemons_below(tmp_path) == [], 30, f"daemon {pid} to be stopped")
    assert tierfs_mounts_below(tmp_path) == []


def test_another_runs_sweep_leaves_a_live_runs_stale_mount_alone(mnt):
    """A run that starts beside this one (the tests above start some) sweeps only
    the mounts of runs that are gone: a mount this run's kill -9 left stale on
    purpose stays for the restart to clean up, and says so."""
    mnt.kill9()
    sweep = sweep_from_another_run()
    assert sweep.returncode == 0, sweep.stderr
    assert mounts().get(mnt.mountpoint) == "fuse.tierfs", sweep.stdout
    res = mnt.start()
    assert "removed a stale mount" in res.stdout, res.stdout
