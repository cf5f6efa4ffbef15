"""The suite's own cleanup: a test that leaves a mount fails and the mount goes,
a run stopped by SIGTERM still takes its mounts and daemons down, and a test that
hangs fails alone, with the stacks that show where."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.harness import tierfs_daemons, wait_until
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
    path = tempfile.mkdtemp(prefix="tierfs-lk-", dir="/tmp")
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
