"""Tests that leave a mount behind on purpose, run by test_cleanup.py in a pytest of
their own (the name keeps the main run from collecting them)."""
import os
import time

from tests.harness import Mount


def test_leaves_a_mount(tmp_path):
    Mount(str(tmp_path), f"file://{tmp_path}/cold").start()


def test_is_stopped_while_mounted(tmp_path):
    Mount(str(tmp_path), f"file://{tmp_path}/cold").start()
    with open(os.environ["LEAKY_READY"], "w") as f:
        f.write(str(tmp_path))
    time.sleep(300)  # until the signal comes
