"""A bound on every test. A test that hangs (a deadlocked daemon leaves a read on its
mount blocked forever) fails alone, with the stacks that show where it waited,
instead of stalling the whole run until CI gives up on it.

When a test passes its limit:
1. this process's stacks and those of the daemons it started (SIGUSR1 makes a daemon
   append them to its log), what each of their threads waits for in the kernel, and
   which processes hold /dev/fuse open are kept for the test's report;
2. those daemons are killed: every request blocked on their mounts then fails with
   ENOTCONN, so the test fails and the run goes on;
3. a test still running GRACE_S later is interrupted like Ctrl-C (the run ends with
   every fixture's teardown); one still running after that ends the process.
TIERFS_TEST_LIMIT_S sets the limit (0: none, e.g. under a debugger)."""
from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
import threading
import time
import _thread

from tests.harness import kernel_view, tierfs_daemons

LIMIT_S = float(os.environ.get("TIERFS_TEST_LIMIT_S", "300"))
GRACE_S = 60
STACKS_WAIT_S = 3  # time a daemon gets to write its stacks before it is killed


def _daemon_log(pid: int) -> str | None:
    """The log a running daemon writes (found among its open files)."""
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.endswith("/tierfs.log"):
                return target
    except OSError:
        pass
    return None


def _stderr_file(pid: int) -> str | None:
    """A daemon's stderr when it is a file (a daemon spawned by `tierfs mount` writes
    there until its log is open, its stacks included)."""
    path = f"/proc/{pid}/fd/2"
    try:
        return path if os.path.isfile(path) else None
    except OSError:
        return None


def _fuse_holders() -> str:
    """Every process with /dev/fuse open: one that outlives its daemon keeps the
    dead daemon's mount waiting instead of failing with ENOTCONN. Threads are looked
    at one by one: a killed daemon whose leader is a zombie holds its files in a
    thread that has not exited."""
    lines = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            held = set()
            for tid in os.listdir(f"/proc/{entry}/task"):
                fds = f"/proc/{entry}/task/{tid}/fd"
                held |= {fd for fd in os.listdir(fds)
                         if os.readlink(f"{fds}/{fd}") == "/dev/fuse"}
            if held:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
                lines.append(f"  pid {entry} ({len(held)} fd): {cmd or '(exited: a zombie)'}")
                lines.append(kernel_view(int(entry)))
        except OSError:
            continue
    return "\n".join(lines) or "  (none)"


def _log_size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


class Watchdog:
    def __init__(self, say, limit_s: float = LIMIT_S):
        self.say = say  # writes to the terminal, past pytest's capture
        self.limit_s = limit_s
        self._lock = threading.Lock()
        self._running: str | None = None  # nodeid of the test being run
        self._generation = 0  # tells a late timer of an earlier test to do nothing
        self._timer: threading.Timer | None = None
        self.reports: dict[str, str] = {}  # nodeid -> what the watchdog found

    def arm(self, nodeid: str) -> None:
        if self.limit_s <= 0:
            return
        with self._lock:
            self._generation += 1
            self._running = nodeid
            self._start_timer(self.limit_s, self._expired, self._generation)

    def disarm(self) -> None:
        with self._lock:
            self._running = None
            self._generation += 1
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def take_report(self, nodeid: str) -> str | None:
        """What the watchdog found, if this test ran past its limit (once)."""
        with self._lock:
            return self.reports.pop(nodeid, None)

    def _start_timer(self, delay: float, action, generation: int) -> None:
        self._timer = threading.Timer(delay, action, (generation,))
        self._timer.daemon = True
        self._timer.start()

    def _still(self, generation: int) -> str | None:
        with self._lock:
            return self._running if generation == self._generation else None

    def _expired(self, generation: int) -> None:
        nodeid = self._still(generation)
        if nodeid is None:
            return
        parts = [f"{nodeid} ran past its limit of {self.limit_s:g} s "
                 f"(TIERFS_TEST_LIMIT_S); its daemons were killed to end it.",
                 "", "stacks of the test process:", _own_stacks()]
        parts += ["", "the test process in the kernel:", kernel_view(os.getpid())]
        daemons = {pid: _daemon_log(pid) or _stderr_file(pid)
                   for pid, (_mp, owner) in tierfs_daemons().items() if owner == os.getpid()}
        sizes = {pid: _log_size(path) for pid, path in daemons.items()}
        for pid in daemons:
            _signal(pid, signal.SIGUSR1)
        time.sleep(STACKS_WAIT_S)
        for pid, path in daemons.items():
            parts += ["", f"daemon {pid} (output {path}), its stacks:",
                      _read_from(path, sizes[pid]), f"daemon {pid} in the kernel:",
                      kernel_view(pid)]
        parts += ["", "processes with /dev/fuse open:", _fuse_holders()]
        for pid in daemons:
            _signal(pid, signal.SIGKILL)
        report = "\n".join(parts)
        with self._lock:
            if generation != self._generation:
                return
            self.reports[nodeid] = report
            self._start_timer(GRACE_S, self._interrupt, generation)

    def _interrupt(self, generation: int) -> None:
        nodeid = self._still(generation)
        if nodeid is None:
            return
        self.say(f"{self.reports.get(nodeid, '')}\n\ntests: {nodeid} still ran {GRACE_S} s "
                 "after its daemons were killed; interrupting the run")
        _thread.interrupt_main()
        with self._lock:
            if generation == self._generation:
                self._start_timer(GRACE_S, self._exit, generation)

    def _exit(self, generation: int) -> None:
        nodeid = self._still(generation)
        if nodeid is None:
            return
        self.say(f"tests: {nodeid} did not stop when interrupted; ending the run here. "
                 f"Its stacks now:\n{_own_stacks()}")
        os._exit(3)


def _own_stacks() -> str:
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _read_from(path: str | None, offset: int) -> str:
    if path is None:
        return "(no log found)"
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()[-64_000:]
    except OSError as e:
        return f"(log unreadable: {e})"
