"""`tierfs mount` and `tierfs umount`."""
from __future__ import annotations

import logging
import logging.handlers
import os
import subprocess
import sys
import time

from .. import exit_report
from ..config import MountConfig, format_size
from ..errors import NotInBucket, UserError
from ..mountpoint import mounts, unmount_lazy
from ..client import daemon_info

READY_ENV = "TIERFS_READY_FD"
log = logging.getLogger("tierfs")


def setup_logging(cfg: MountConfig) -> None:
    root = logging.getLogger()
    root.setLevel(cfg.log_level.upper())
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        os.makedirs(cfg.cache_dir, exist_ok=True)
        fh = logging.handlers.RotatingFileHandler(
            os.path.join(cfg.cache_dir, "tierfs.log"), maxBytes=16 << 20, backupCount=3)
        fh.setFormatter(fmt)
        root.addHandler(fh)
    except OSError:
        pass  # reported by the cache dir checks with a clear message
    if cfg.foreground and not os.environ.get(READY_ENV):
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        sh.setLevel(logging.WARNING)
        root.addHandler(sh)


def run_daemon(cfg: MountConfig) -> int:
    """Run the filesystem in this process until it is unmounted."""
    import trio

    from ..runtime import Daemon

    ready_fd = int(os.environ.pop(READY_ENV, "-1"))

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

    setup_logging(cfg)
    daemon = Daemon(cfg)
    try:
        daemon.prepare()
        daemon.mount()
        notes = "".join(f"{n}\n" for n in daemon.notes)
        log.info("mounting %s on %s", cfg.cold_url, cfg.mountpoint)
        trio.run(daemon.run, lambda: report(
            f"OK {notes}mounted {daemon.cold.describe()} on {cfg.mountpoint} "
            f"(daemon pid {os.getpid()}, log {os.path.join(cfg.cache_dir, 'tierfs.log')})"))
        log.info("unmounted cleanly")
        return 0
    except UserError as e:
        log.error("%s", e)
        report(f"ERR {e}")
        return 1
    except BaseException as e:
        log.exception("daemon failed")
        report(f"ERR internal error: {type(e).__name__}: {e} "
               f"(details in {os.path.join(cfg.cache_dir, 'tierfs.log')})")
        return 1
    finally:
        daemon.close()
        if ready_fd >= 0:
            os.close(ready_fd)


def spawn_daemon(argv: list[str]) -> int:
    """Start the daemon in the background and wait until it is mounted or failed."""
    r, w = os.pipe()
    env = dict(os.environ, **{READY_ENV: str(w)})
    proc = subprocess.Popen([sys.executable, "-m", "tierfs", *argv, "--foreground"],
                            pass_fds=(w,), env=env, start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        message = f.read().decode(errors="replace").strip()
    if message.startswith("OK"):
        print(message[3:])
        return 0
    proc.wait()
    if message.startswith("ERR "):
        print(f"tierfs: {message[4:]}", file=sys.stderr)
    else:
        print(f"tierfs: the daemon exited with status {proc.returncode} before mounting; "
              f"see tierfs.log in the cache dir", file=sys.stderr)
    return 1


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


def umount(mountpoint: str, timeout: float = 3600.0) -> int:
    mp = os.path.abspath(mountpoint)
    fstype = mounts().get(mp)
    if fstype is None:
        raise UserError(f"{mp} is not mounted")
    if fstype != "fuse.tierfs":
        raise UserError(f"{mp} is a {fstype} mount, not tierfs")
    try:
        info = daemon_info(mp)
        pid = info["pid"]
    except UserError:
        unmount_lazy(mp)  # the daemon is dead: only the stale mount is left
        print(f"removed the stale mount at {mp} (its daemon had died)")
        return 0
    res = subprocess.run(["fusermount3", "-u", mp], capture_output=True, text=True)
    if res.returncode != 0:
        if "busy" in res.stderr.lower():
            raise UserError(f"{mp} is busy: close the files and shells using it "
                            f"(fuser -vm {mp} lists them) and retry")
        raise UserError(f"unmounting {mp} failed: {res.stderr.strip()}")
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            raise UserError(f"daemon {pid} is still flushing after {timeout:.0f}s; it keeps "
                            f"running in the background (see tierfs.log in its cache dir)")
        time.sleep(0.05)
    report = exit_report.read(info["cache_dir"], pid) or {}
    if report.get("fenced_by"):
        raise NotInBucket(f"unmounted {mp}, but it had been fenced: {report['fenced_by']} took "
                          f"the filesystem over, and what was written here after that "
                          f"({format_size(report['dirty_bytes'])} not uploaded) is not in "
                          f"the bucket")
    if report.get("dirty_bytes"):
        raise NotInBucket(f"unmounted {mp}, but {format_size(report['dirty_bytes'])} in "
                          f"{report['dirty_extents']} extents is not in the bucket yet: it is "
                          f"safe in the cache dir and uploads on the next mount of it")
    print(f"unmounted {mp}")
    return 0
