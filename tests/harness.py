"""Mount the real tierfs daemon for tests and always clean up after it."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from tierfs import registry
from tierfs.client import daemon_info
from tierfs.mountpoint import answers, mounts, unmount_lazy

# Every daemon a test starts inherits this variable: the pid of the pytest process
# that started it, so leftovers of a run that was killed can be told apart from the
# mounts of a run still going.
SESSION_ENV = "PYTEST_TIERFS_SESSION"


def run_cli(*args, env=None, timeout=120, check=False, cwd=None,
            preexec_fn=None) -> subprocess.CompletedProcess:
    """Run `tierfs ARGS` as a user would (a separate process; preexec_fn runs in it
    first, as subprocess's)."""
    res = subprocess.run([sys.executable, "-m", "tierfs", *map(str, args)], capture_output=True,
                         text=True, env=env, timeout=timeout, cwd=cwd, preexec_fn=preexec_fn)
    if check and res.returncode != 0:
        raise AssertionError(f"tierfs {' '.join(map(str, args))} failed "
                             f"({res.returncode}): {res.stderr}{res.stdout}")
    return res


# Log lines a test may expect (fault tests); anything else at ERROR/Traceback fails it.
_BAD_LOG = re.compile(r"Traceback|\bERROR\b|\bCRITICAL\b")


class Mount:
    def __init__(self, root: str, cold_url: str, *, args=(), env=None, name="m"):
        self.mountpoint = os.path.join(root, f"{name}-mnt")
        self.cache_dir = os.path.join(root, f"{name}-cache")
        self.cold_url = cold_url
        self.args = list(args)
        self.env = env
        self.pid = None
        self.allowed_log: list[str] = []  # regexes of ERROR lines this test provokes
        os.makedirs(self.mountpoint, exist_ok=True)

    @property
    def pid(self) -> int | None:
        return self._pid

    @pid.setter
    def pid(self, value: int | None) -> None:
        # Its start time too: pids (and thread ids) are reused within seconds while
        # the suite runs, and a signal to a daemon that exited must not hit another.
        self._pid, self._pid_started = value, None if value is None else registry.start_time(value)

    def _still_ours(self) -> bool:
        return self._pid is not None and registry.start_time(self._pid) == self._pid_started

    def path(self, *parts: str) -> str:
        return os.path.join(self.mountpoint, *parts)

    def cli(self, *args, check=False, timeout=120, preexec_fn=None) -> subprocess.CompletedProcess:
        return run_cli(*args, env=self.env, check=check, timeout=timeout, preexec_fn=preexec_fn)

    def start(self, *extra, preexec_fn=None) -> subprocess.CompletedProcess:
        res = self.cli("mount", self.cold_url, self.mountpoint, "--cache-dir", self.cache_dir,
                       "--upload-delay", "0.5", *self.args, *extra, check=True,
                       preexec_fn=preexec_fn)
        self.pid = self.daemon_pid()
        return res

    def daemon_pid(self) -> int:
        return daemon_info(self.mountpoint)["pid"]

    @property
    def mounted(self) -> bool:
        return mounts().get(self.mountpoint) == "fuse.tierfs"

    def umount(self) -> None:
        self.cli("umount", self.mountpoint, check=True)
        self.pid = None

    def kill9(self) -> None:
        """The daemon dies as by the OOM killer. Its main thread is waited for, not
        every thread: one stuck in the kernel may outlive it, which a later mount
        or umount must cope with. Its connection guard then aborts the mount and
        logs that into the cache dir: that is waited for too, so that a test may
        remove the cache dir next."""
        assert self._still_ours(), f"daemon pid {self.pid} exited before it could be killed"
        guard = guard_pid(self.pid)
        os.kill(self.pid, signal.SIGKILL)
        wait_until(lambda: not registry.main_thread_runs(self.pid), 30,
                   f"daemon pid {self.pid} to die")
        if guard is not None:
            wait_until(lambda: _gone(guard), 30, f"guard pid {guard} to finish")
        self.pid = None

    def remount(self, *extra) -> None:
        self.umount()
        self.start(*extra)

    @property
    def log_path(self) -> str:
        return os.path.join(self.cache_dir, "tierfs.log")

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def unexpected_log_lines(self) -> list[str]:
        bad = []
        for line in self.log().splitlines():
            if _BAD_LOG.search(line) and not any(re.search(p, line) for p in self.allowed_log):
                bad.append(line)
        return bad

    def cleanup(self) -> None:
        """Unmount and stop the daemon whatever state the test left them in."""
        if self.mounted:
            res = self.cli("umount", self.mountpoint, timeout=120)
            if res.returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", self.mountpoint], capture_output=True)
        if self._still_ours():  # not a later process that got its pid
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_gone(self.pid)
        self.pid = None


def cli_on_a_stopped_daemon(m: Mount, args: list[str], request: str, timeout: float
                            ) -> subprocess.CompletedProcess:
    """Run `tierfs ARGS`, stop m's daemon (SIGSTOP) once it has taken the control
    request `request` (its status counter says so), and wait `timeout` for the command
    to end. The daemon runs again afterwards, also when the command does not end."""
    import json
    cmd = subprocess.Popen([sys.executable, "-m", "tierfs", *args], env=m.env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = False
    try:
        wait_until(lambda: f"control_requests:{request}" in json.loads(m.cli(
            "status", m.mountpoint, "--json", check=True).stdout)["counters"], 60,
            f"the {request} request to reach the daemon")
        os.kill(m.pid, signal.SIGSTOP)
        stopped = True
        out, err = cmd.communicate(timeout=timeout)
    finally:
        if cmd.poll() is None:
            cmd.kill()
            cmd.communicate()
        if stopped:
            os.kill(m.pid, signal.SIGCONT)
    return subprocess.CompletedProcess(cmd.args, cmd.returncode, out, err)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll `predicate` until it returns something true, and return that; raise
    AssertionError naming `what` if it has not within `timeout` seconds. For
    conditions a background step makes true: the timeout only bounds a hang."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def _gone(pid: int) -> bool:
    """Whether the process has exited: every one of its threads (a zombie leader
    counts as exited, but not while another thread still runs: a thread stuck in
    the kernel keeps the process's files open, /dev/fuse included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return registry.exited(pid)


def guard_pid(daemon_pid: int) -> int | None:
    """The pid of the daemon's connection guard (tierfs/guard.py), if it runs."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == daemon_pid and b"tierfs.guard" in argv:
            return int(entry)
    return None


def kernel_view(pid: int) -> str:
    """State, wait channel and kernel stack of each thread of a process: a thread in
    a FUSE request waits in request_wait_answer."""
    lines = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return f"  (process {pid} is gone)"
    for tid in tids:
        task = f"/proc/{pid}/task/{tid}"
        parts = []
        for name in ("comm", "wchan", "stack"):
            try:
                with open(f"{task}/{name}") as f:
                    parts.append(f.read().strip())
            except OSError:
                parts.append("?")
        try:
            with open(f"{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "?"
        comm, wchan, stack = parts
        lines.append(f"  thread {tid} ({comm}) state {state} wchan {wchan}")
        lines += [f"      {frame}" for frame in stack.splitlines()]
    return "\n".join(lines)


def _wait_gone(pid: int, timeout: float = 30) -> None:
    try:
        wait_until(lambda: _gone(pid), timeout, f"daemon pid {pid} to exit")
    except AssertionError as e:
        raise AssertionError(f"{e}; its threads:\n{kernel_view(pid)}") from None


def tierfs_daemons() -> dict[int, tuple[str | None, int | None]]:
    """pid -> (mount point or None, pytest session pid or None) of every running
    tierfs daemon (`python -m tierfs mount ... --foreground`)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        words = " ".join(argv)
        if " -m tierfs mount " not in f" {words} " or "--foreground" not in argv:
            continue
        at = argv.index("mount")
        positional = [a for a in argv[at + 1:at + 3] if not a.startswith("-")]
        mountpoint = positional[1] if len(positional) == 2 else None
        session = env.get(SESSION_ENV.encode())
        out[int(entry)] = (mountpoint, int(session) if session and session.isdigit() else None)
    return out


def stop_daemon(pid: int, mountpoint: str | None) -> None:
    """Take a leftover mount down: lazily unmounted, its daemon killed."""
    if mountpoint is not None and mounts().get(mountpoint) == "fuse.tierfs":
        unmount_lazy(mountpoint)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    _wait_gone(pid)


def run_alive(path: str) -> bool:
    """Whether the test run that made the directory `path` lies in still runs. A
    run's temp tree holds a .lock naming its pid: pytest writes one into its
    numbered base dir, short_tmpdir into its own. A live run's stale mount may be
    one a test left on purpose (a kill -9 test restarts over it): not ours."""
    parent = os.path.dirname(path)
    while parent not in ("/", "/tmp"):
        try:
            with open(os.path.join(parent, ".lock")) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            parent = os.path.dirname(parent)
            continue
        return not _gone(pid)
    return False


def short_tmpdir(prefix: str) -> str:
    """A directory right below /tmp (pytest's own nest is too deep for some socket
    paths), locked to this run as pytest locks its base dir."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    with open(os.path.join(path, ".lock"), "w") as f:
        f.write(str(os.getpid()))
    return path


def sweep_dead_sessions() -> list[str]:
    """Stop the daemons (and mounts) that a pytest run killed before its cleanup
    left behind; a run still going keeps its own. Returns what was stopped."""
    stopped = []
    for pid, (mountpoint, session) in tierfs_daemons().items():
        if session is not None and session != os.getpid() and _gone(session):
            stop_daemon(pid, mountpoint)
            stopped.append(mountpoint or f"daemon {pid}")
    for path, kind in mounts().items():  # a dead daemon's mount of a dead run's directory
        if kind == "fuse.tierfs" and path.startswith(("/tmp/pytest-of-", "/tmp/tierfs-direct-",
                                                      "/tmp/tierfs-lk-")) \
                and not run_alive(path):
            try:  # statfs always asks the daemon; stat may be answered from the cache
                answers(path)
            except OSError:  # ENOTCONN: nobody serves it any more
                unmount_lazy(path)
                stopped.append(path)
    return stopped


@contextlib.contextmanager
def small_disk(path, size: str):
    """A tmpfs of `size` ("16m") mounted on the directory `path` (made if missing): a
    disk to fill up without filling the machine's. Unmounted at the end, also when
    the test fails."""
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill_disk(path, leave: int = 0) -> None:
    """Write a file at `path` until its disk is full (ENOSPC), then give `leave`
    bytes of it back."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        if leave:
            f.truncate(os.fstat(f.fileno()).st_size - leave)


def write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def drop_page_cache(*paths: str) -> None:
    """Drop the kernel's cached pages of every file at or below `paths`, so the
    next reads reach the daemon. Per file (fadvise), so it needs no write access
    to /proc/sys and works inside containers."""
    for top in paths:
        targets = [top] if os.path.isfile(top) else [
            os.path.join(root, name) for root, _dirs, files in os.walk(top) for name in files]
        for path in targets:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cached_pages(path: str) -> int:
    """How many pages of `path` are in the page cache (mincore(2) on a mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    if size == 0:
        return 0
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def in_child_as(uid: int, gid: int, groups: list[int], fn, cwd: str | None = None):
    """fn()'s JSON-able result, computed in a forked child that has dropped root to
    uid/gid/groups (after entering `cwd` while still root). Anything fn raises
    fails the test."""
    import json
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 0
        try:
            os.close(r)
            if cwd is not None:
                os.chdir(cwd)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            os.write(w, json.dumps({"result": fn()}).encode())
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            os.write(w, json.dumps({"__error__": repr(e)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = json.loads(data)
    assert "__error__" not in out, out["__error__"]
    return out["result"]
