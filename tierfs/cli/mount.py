"""`tierfs mount` and `tierfs umount`."""
from __future__ import annotations

import faulthandler
import logging
import logging.handlers
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from .. import exit_report, registry, sdnotify
from ..config import MountConfig, format_size
from ..errors import NotInBucket, UserError
from ..mountpoint import answers, mount_device, mounts, release_hung_mount, unmount_lazy
from ..client import daemon_info

READY_ENV = "TIERFS_READY_FD"
log = logging.getLogger("tierfs")


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class DaemonLog:
    """The daemon's log. Records are held in memory until the cache dir is locked
    by this daemon: a refused mount (cache dir in use, mount point already
    mounted) must not write its refusal into the log of the live daemon that
    owns that cache dir. The refusal goes to the caller's terminal instead."""

    def __init__(self, cfg: MountConfig):
        self.cfg = cfg
        self.path = cfg.log_path
        self.attached = False
        root = logging.getLogger()
        root.setLevel(cfg.log_level.upper())
        self._held = logging.handlers.MemoryHandler(capacity=1 << 20,
                                                    flushLevel=logging.CRITICAL + 1)
        root.addHandler(self._held)
        if cfg.foreground and not os.environ.get(READY_ENV):
            sh = logging.StreamHandler(sys.stderr)
            sh.setFormatter(logging.Formatter(LOG_FORMAT))
            sh.setLevel(logging.WARNING)
            root.addHandler(sh)

    def attach(self) -> None:
        """Start writing to CACHE_DIR/tierfs.log, beginning with the held records."""
        if self.attached:
            return
        try:
            fh = logging.handlers.RotatingFileHandler(self.path, maxBytes=16 << 20,
                                                      backupCount=3)
        except OSError:
            return  # the cache dir checks report this with a clear message
        fh.setFormatter(logging.Formatter(LOG_FORMAT))
        self._held.setTarget(fh)
        self._held.flush()
        root = logging.getLogger()
        root.removeHandler(self._held)
        root.addHandler(fh)
        self.attached = True
        # `kill -USR1 PID` appends every thread's stack to the log: what a hung daemon
        # is waiting for, without stopping it.
        self._stacks = open(self.path, "a")
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)
        # A crash in C code (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) leaves every
        # thread's stack in the log, not a daemon gone without a word.
        faulthandler.enable(file=self._stacks, all_threads=True)


def run_daemon(cfg: MountConfig) -> int:
    """Run the filesystem in this process until it is unmounted."""
    import trio

    from .. import malloc
    from ..runtime import Daemon

    malloc.return_large_blocks()
    ready_fd = int(os.environ.pop(READY_ENV, "-1"))
    # Until the log is open, SIGUSR1 writes the stacks to stderr (a daemon stuck
    # before it could lock its cache dir); DaemonLog.attach moves them to the log.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    def report(message: str) -> None:
        nonlocal ready_fd
        if ready_fd >= 0:
            os.write(ready_fd, message.encode() + b"\n")
            os.close(ready_fd)
            ready_fd = -1
        elif message.startswith("ERR "):
            print(f"tierfs: {message[4:]}", file=sys.stderr)
        else:
            print(message[3:], flush=True)
            sdnotify.notify("READY=1")  # under systemd (Type=notify): the mount answers

    cfg.cache_dir = os.path.abspath(cfg.cache_dir)
    if cfg.fault_file:
        cfg.fault_file = os.path.abspath(cfg.fault_file)
    daemon_log = DaemonLog(cfg)
    daemon = Daemon(cfg)  # makes every path absolute...
    os.chdir("/")  # ...so the daemon does not keep the caller's directory busy
    daemon.on_cache_dir_locked = daemon_log.attach
    try:
        daemon.prepare()
        daemon.mount()
        notes = "".join(f"{n}\n" for n in daemon.notes)
        log.info("mounting %s on %s", cfg.cold_url, cfg.mountpoint)
        trio.run(daemon.run, lambda: report(
            f"OK {notes}mounted {daemon.cold.describe()} on {cfg.mountpoint} "
            f"(daemon pid {os.getpid()}, log {daemon_log.path})"))
        log.info("unmounted cleanly")
        return 0
    except UserError as e:
        log.error("%s", e)
        report(f"ERR {e}")
        return 1
    except BaseException as e:
        daemon_log.attach()  # a bug is worth logging wherever it happened
        log.exception("daemon failed")
        report(f"ERR internal error: {type(e).__name__}: {e} (details in {daemon_log.path})")
        return 1
    finally:
        daemon.close()
        if ready_fd >= 0:
            os.close(ready_fd)


def spawn_daemon(argv: list[str], cfg: MountConfig) -> int:
    """Start the daemon in the background and wait until it is mounted or failed: at
    most --start-timeout, after which it is stopped (a daemon hung on a silent bucket
    or database would otherwise keep the command waiting for ever)."""
    r, w = os.pipe()
    env = dict(os.environ, **{READY_ENV: str(w)})
    mountpoint = os.path.realpath(cfg.mountpoint)  # as the mount table spells it
    mounted_before = mountpoint in mounts()
    # -P: a ./tierfs folder in the caller's directory must not shadow the package.
    # The daemon's stderr is kept: a daemon that dies before it can log or report
    # (a broken install) says why only there.
    with tempfile.TemporaryFile() as stderr:
        with _StopSignals() as stops:
            proc = subprocess.Popen([sys.executable, "-P", "-m", "tierfs", *argv,
                                     "--foreground"],
                                    pass_fds=(w,), env=env, start_new_session=True,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=stderr)
            try:
                stops.arm()  # one that came while the daemon was spawned acts now
                os.close(w)
                with os.fdopen(r, "rb") as f:
                    message = _read_report(f, cfg.start_timeout)
                stops.disarm()
            except _StopSignal as e:
                # Ctrl-C (or a service manager's SIGTERM, a closed terminal's SIGHUP)
                # abandons the start: a daemon left to finish it in the background
                # would mount after the command said it was stopped.
                left = _stop_daemon(proc, mountpoint, mounted_before)
                how = ("interrupted" if e.signum == signal.SIGINT else
                       f"stopped by {signal.Signals(e.signum).name}")
                print(f"tierfs: {how}: the mount of {mountpoint} was abandoned and its "
                      f"daemon stopped before it finished starting{left}", file=sys.stderr)
                return 128 + e.signum
        if message is None:
            raise UserError(_stop_unstarted(proc, cfg, mountpoint, mounted_before))
        if message.startswith("OK"):
            print(message[3:])
            return 0
        proc.wait()
        stderr.seek(0)
        last = [ln for ln in stderr.read().decode(errors="replace").splitlines() if ln.strip()]
    if message.startswith("ERR "):
        print(f"tierfs: {message[4:]}", file=sys.stderr)
    else:
        why = last[-1].strip() if last else "it printed nothing"
        print(f"tierfs: the daemon exited with status {proc.returncode} before mounting: "
              f"{why}", file=sys.stderr)
    return 1


STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _StopSignal(Exception):
    """Ctrl-C, SIGTERM or SIGHUP while `tierfs mount` waits for its daemon."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _StopSignals:
    """While the daemon starts, Ctrl-C, SIGTERM and SIGHUP raise _StopSignal: their
    defaults would end the command and leave the daemon, a session of its own,
    starting. One that comes before arm() (while the daemon is spawned, its pid not
    known yet) waits for it; one after disarm() (the start is over) is delivered
    again as it would have been, once the handlers are back."""

    def __enter__(self) -> "_StopSignals":
        self.armed, self.pending, self.raised = False, None, False
        self.before = {s: signal.signal(s, self._stop) for s in STOPPING_SIGNALS}
        return self

    def _stop(self, signum, frame) -> None:
        if self.pending is not None:
            return  # a second one must not cut the stop short
        self.pending = signum
        if self.armed:
            self._raise()

    def _raise(self) -> None:
        self.raised = True
        raise _StopSignal(self.pending)

    def arm(self) -> None:
        self.armed = True
        if self.pending is not None:
            self._raise()

    def disarm(self) -> None:
        self.armed = False

    def __exit__(self, *exc) -> None:
        for signum, handler in self.before.items():
            signal.signal(signum, handler)
        if self.pending is not None and not self.raised:
            signal.raise_signal(self.pending)


def _read_report(f, timeout: float) -> str | None:
    """What the daemon reports on its ready pipe (all it writes before it closes the
    pipe, or exits); None if that takes longer than `timeout`."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([f], [], [], left)[0]:
            return None
        chunk = os.read(f.fileno(), 4096)
        if not chunk:
            return data.decode(errors="replace").strip()
        data += chunk


def _stop_daemon(proc: subprocess.Popen, mountpoint: str, mounted_before: bool) -> str:
    """Kill a daemon that has not said it started, and remove the mount it may have
    made; return a note if it has not exited yet. Killed while it starts, it loses
    nothing: what it had written is in the cache dir, as after a crash, for the next
    mount."""
    proc.kill()
    try:
        proc.wait(timeout=30)
        left = ""
    except subprocess.TimeoutExpired:  # stuck in the kernel: it ends once that returns
        left = f"; it (pid {proc.pid}) has not exited yet and holds the cache dir until it does"
    if not mounted_before and mounts().get(mountpoint) == "fuse.tierfs":
        unmount_lazy(mountpoint)  # it had mounted, and hung before it said so
    return left


def _stop_unstarted(proc: subprocess.Popen, cfg: MountConfig, mountpoint: str,
                    mounted_before: bool) -> str:
    """Stop a daemon that did not start within --start-timeout, and say so."""
    left = _stop_daemon(proc, mountpoint, mounted_before)
    return (f"the daemon did not finish starting within {cfg.start_timeout:g}s "
            f"(--start-timeout) and was stopped{left}: see {os.path.abspath(cfg.log_path)} for "
            f"how far it got "
            f"(a silent bucket or database?); a restore of a very large filesystem may need a "
            f"longer --start-timeout")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _not_a_mount(path: str, table: dict[str, str]) -> str:
    """Why `path` cannot be unmounted, for a path that is no mount point."""
    if not os.path.lexists(path):
        return f"{path} does not exist: give the mount point of a tierfs mount"
    inside = [m for m, t in table.items() if t == "fuse.tierfs"
              and os.path.commonpath([m, path]) == m]
    if inside:
        top = max(inside, key=len)
        return (f"{path} is inside the tierfs mount at {top}, not its mount point: "
                f"tierfs umount {top}")
    return f"{path} is not mounted (no filesystem is mounted on it)"


def _wait_for_exit(pid: int, cache_dir: str, timeout: float) -> None:
    """Wait for the daemon to exit; on a terminal, show its upload backlog
    shrinking (the daemon reports it in its exit report while it uploads)."""
    from .progress import Progress
    deadline = time.monotonic() + timeout
    progress = None
    try:
        while pid_alive(pid):
            if time.monotonic() > deadline:
                # Unmounted, but what it has not uploaded or checkpointed yet is not known
                # to be in the bucket: exit 3, as for every such end.
                log_path = os.path.join(cache_dir, "tierfs.log")
                raise NotInBucket(f"the daemon (pid {pid}) has not exited {timeout:g}s after "
                                  f"the unmount (--timeout): it goes on in the background, and "
                                  f"what it has not uploaded is safe in {cache_dir}; kill -USR1 "
                                  f"{pid} writes what it waits for to {log_path}")
            report = exit_report.read(cache_dir, pid) or {}
            if report.get("stopping"):
                total = report["start_dirty_bytes"]
                if progress is None:
                    progress = Progress("uploading before unmount", total)
                progress.update(total - report["dirty_bytes"], note=(
                    f"gives up in {report['seconds_left']:.0f}s; the rest uploads on the "
                    f"next mount"))
            time.sleep(0.05)
    finally:
        if progress is not None:
            progress.close()


def _follow_links(path: str, table: dict[str, str]) -> str:
    """`path` with its symlinks followed as the table spells mount points (resolved),
    stopping at a mount point of `table` (never stat'ed: its daemon may hang)."""
    for _ in range(40):  # as the kernel, give up on a loop
        # The directories above may be symlinks too; resolving them stats only them.
        path = registry.parent_resolved(path)
        if path in table or not os.path.islink(path):
            break
        path = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
    return path


def _died(note: str, dev: int | None, mp: str) -> NotInBucket:
    """A mount whose daemon was killed or crashed, now removed: nobody can tell what
    reached the bucket (exit 3, as for a daemon that dies while it unmounts)."""
    info = registry.registered(dev, mp) if dev is not None else None
    where = "its cache dir" + (f" {info['cache_dir']}" if info and info.get("cache_dir") else "")
    return NotInBucket(f"{note}; what it had not uploaded or checkpointed may not be in the "
                       f"bucket: it is safe in {where} and goes up when you mount it again")


def _unmount(mp: str) -> None:
    """Ask the kernel to let go of `mp`. An interrupt lets fusermount3 finish (it is
    quick), so the mount is either still there or gone, never half done."""
    proc = subprocess.Popen(["fusermount3", "-u", mp], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate()
    except KeyboardInterrupt:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    if proc.returncode != 0:
        if "busy" in err.lower():
            raise UserError(f"{mp} is busy: close the files and shells using it "
                            f"(fuser -vm {mp} lists them) and retry")
        raise UserError(f"unmounting {mp} failed: {err.strip()}")


def umount(mountpoint: str, timeout: float = 3600.0) -> int:
    table = mounts()
    mp = _follow_links(os.path.abspath(mountpoint), table)
    fstype = table.get(mp)
    if fstype is None:
        raise UserError(_not_a_mount(mp, table))
    if fstype != "fuse.tierfs":
        raise UserError(f"{mp} is a {fstype} mount, not tierfs")
    try:
        alive = answers(mp)
    except OSError:
        alive = True  # an error answer: daemon_info below tells a dead daemon's mount
    dev = mount_device(mp)
    if not alive:  # its daemon died with the connection held open, or it hangs
        raise _died(release_hung_mount(mp), dev, mp)
    # The registry first: asking the mount may wait for a shared namespace's database.
    info = registry.serving(dev, mp) if dev is not None else None
    try:
        info = info or daemon_info(mp)
        pid = info["pid"]
    except UserError:
        unmount_lazy(mp)  # the daemon is dead: only the stale mount is left
        raise _died(f"removed the stale mount at {mp} (its daemon had died)", dev, mp) from None
    try:
        _unmount(mp)
        _wait_for_exit(pid, info["cache_dir"], timeout)
    except KeyboardInterrupt:
        # Ctrl-C may come while fusermount3 still runs, after the kernel let go or
        # before: the mount table tells which.
        if mounts().get(mp) == "fuse.tierfs":
            print(f"tierfs: interrupted: {mp} is still mounted: run tierfs umount {mp} "
                  f"again", file=sys.stderr)
            return 130
        # The kernel has let go; the daemon finishes its uploads and its final
        # checkpoint whether or not anybody waits for it.
        log_path = os.path.join(info["cache_dir"], "tierfs.log")
        print(f"tierfs: interrupted: {mp} is unmounted, and its daemon (pid {pid}) goes "
              f"on in the background; what it has not uploaded is safe in "
              f"{info['cache_dir']}; kill -USR1 {pid} writes what it waits for to "
              f"{log_path}", file=sys.stderr)
        return 130
    report = exit_report.read(info["cache_dir"], pid)
    if report is None or report.get("stopping"):  # no final word: killed or crashed
        log_path = os.path.join(info["cache_dir"], "tierfs.log")
        raise NotInBucket(f"unmounted {mp}, but its daemon (pid {pid}) ended before it "
                          f"finished unmounting (killed or crashed: see {log_path}): what "
                          f"it had not uploaded or checkpointed is safe in the cache dir; "
                          f"mount it again to finish")
    if report.get("fenced_by"):
        raise NotInBucket(f"unmounted {mp}, but it had been fenced: {report['fenced_by']} took "
                          f"the filesystem over, and what was written here after that "
                          f"({format_size(report['dirty_bytes'])} not uploaded) is not in "
                          f"the bucket")
    if report.get("lost_extents"):
        waiting = report["dirty_bytes"] - report["lost_bytes"]
        raise NotInBucket(f"unmounted {mp}, but {format_size(report['lost_bytes'])} in "
                          f"{report['lost_extents']} extents is lost: their hot files were "
                          f"deleted from the cache dir before they were uploaded (reads of "
                          f"them give EIO; tierfs fsck --repair drops them)" + (
                              f"; {format_size(waiting)} more is not in the bucket yet and "
                              f"uploads on the next mount" if waiting else ""))
    if report.get("dirty_bytes"):
        raise NotInBucket(f"unmounted {mp}, but {format_size(report['dirty_bytes'])} in "
                          f"{report['dirty_extents']} extents is not in the bucket yet: it is "
                          f"safe in the cache dir and uploads on the next mount of it")
    if report.get("checkpointed") is False:
        raise NotInBucket(f"unmounted {mp}, but its final metadata checkpoint did not reach "
                          f"the bucket: the cache dir holds the last changes; mount it again "
                          f"on this node (its lease stays held and lapses in a minute, after "
                          f"which another node starts without them, as after a crash)")
    print(f"unmounted {mp}")
    return 0
