"""Tests that leave a mount behind on purpose, run by test_cleanup.py in a pytest of
their own (the name keeps the main run from collecting them)."""
import os
import signal
import time

from tests.harness import Mount


def test_leaves_a_mount(tmp_path):
    Mount(str(tmp_path), f"file://{tmp_path}/cold").start()


def test_is_stopped_while_mounted(tmp_path):
    Mount(str(tmp_path), f"file://{tmp_path}/cold").start()
    with open(os.environ["LEAKY_READY"], "w") as f:
        f.write(str(tmp_path))
    time.sleep(300)  # until the signal comes


def test_hangs_on_a_stopped_daemon(tmp_path):
    """A read that a daemon never answers (it is stopped): only the watchdog ends it."""
    m = Mount(str(tmp_path), f"file://{tmp_path}/cold")
    m.start()
    try:
        with open(m.path("f"), "wb") as f:
            f.write(b"x")
        os.kill(m.pid, signal.SIGSTOP)
        with open(m.path("f"), "rb") as f:
            f.read()
    finally:
        m.cleanup()


def test_runs_after_the_hung_one():
    assert True  # passes: the run goes on after a hung test
