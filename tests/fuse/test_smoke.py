import concurrent.futures
import json
import os
import signal

from tests.harness import wait_until


def test_write_read_remount(mnt):
    with open(mnt.path("hello.txt"), "wb") as f:
        f.write(b"hello tierfs\n" * 1000)
    os.mkdir(mnt.path("dir"))
    mnt.remount()
    with open(mnt.path("hello.txt"), "rb") as f:
        assert f.read() == b"hello tierfs\n" * 1000
    assert sorted(os.listdir(mnt.mountpoint)) == ["dir", "hello.txt"]


def test_parallel_requests_are_taken_from_the_queue(mnt):
    """Requests that queue up while the daemon is busy are read without a trip
    through trio's epoll (tierfs/fs/request_wait.py): pyfuse3 must really call it."""
    for i in range(8):
        with open(mnt.path(f"f{i}"), "wb") as f:
            f.write(b"x" * 4096)

    def opener(i):
        for _ in range(300):
            os.close(os.open(mnt.path(f"f{i}"), os.O_RDONLY))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(opener, range(8)))
    status = mnt.cli("status", mnt.mountpoint, "--json", check=True)
    counters = json.loads(status.stdout)["counters"]
    assert counters.get("fuse_requests_queued", 0) > 0


def test_sigusr1_writes_every_daemon_thread_stack_to_the_log(mnt):
    """What a stuck daemon waits for can be seen without stopping it."""
    with open(mnt.path("before"), "wb") as f:
        f.write(b"x")
    os.kill(mnt.pid, signal.SIGUSR1)
    # The main thread's frames, not just the handler's (written a thread at a time).
    wait_until(lambda: "in run_daemon" in mnt.log(), 30, "the main thread's stack in the log")
    assert "most recent call first" in mnt.log()
    with open(mnt.path("after"), "wb") as f:  # the daemon goes on serving
        f.write(b"y")
    assert open(mnt.path("before"), "rb").read() == b"x"
    assert mnt.unexpected_log_lines() == []
