"""Client side of the control interface: find a mount's daemon and talk to it."""
from __future__ import annotations

import errno
import json
import os
import socket
import sys

from . import registry
from .errors import UserError
from .mount_table import TABLE
from .mountpoint import DEAD_MOUNT

CONTROL_XATTR = "user.tierfs.control"
ANSWER_WAIT_ENV = "TIERFS_ANSWER_WAIT"
DEFAULT_ANSWER_WAIT_S = 10.0


def answer_wait_s(env=os.environ) -> float:
    """Seconds to wait for a daemon's answer before pinging it, and then for the ping:
    TIERFS_ANSWER_WAIT, or the default (with a warning where it is not 0.1-3600)."""
    raw = env.get(ANSWER_WAIT_ENV)
    if raw is None:
        return DEFAULT_ANSWER_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if 0.1 <= value <= 3600:
        return value
    sys.stderr.write(f"tierfs: warning: {ANSWER_WAIT_ENV}={raw!r} ignored: it must be a number "
                     f"of seconds from 0.1 to 3600; waiting {DEFAULT_ANSWER_WAIT_S:g}s\n")
    return DEFAULT_ANSWER_WAIT_S


# A command may take long (prefetch fetches first), but the daemon's event loop answers
# a ping at once while it works: a reply not here after ANSWER_CHECK_S sends one, and a
# daemon that does not answer that within PING_WAIT_S (stopped, stuck) ends the wait.
ANSWER_CHECK_S = PING_WAIT_S = answer_wait_s()


def daemon_info(path: str) -> dict:
    """pid, cache dir and socket of the daemon serving `path` (any path in a mount).
    This asks the mount: commands call check_answers first."""
    try:
        raw = os.getxattr(path, CONTROL_XATTR)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except OSError as e:
        if e.errno in DEAD_MOUNT:
            raise UserError(f"the daemon serving {path} has died: run tierfs umount on its "
                            f"mount point, then mount again") from None
        info = None
        if e.errno == errno.EOPNOTSUPP:  # a mount with --no-xattr, or not tierfs at all
            info = registry.lookup(os.stat(path).st_dev)
        if info is None:
            raise UserError(f"{path} is not inside a tierfs mount") from None
        return info
    return json.loads(raw)


def check_answers(path: str) -> None:
    """Raise NotAnswering if the daemon registered for the mount `path` lies in does
    not answer a ping: commands call it before anything that asks the mount (stat,
    daemon_info), which a stopped or stuck daemon would hold in the kernel for ever."""
    known = registered_daemon(path)
    if known is not None and not answers_ping(known["socket"]):
        raise not_answering(known["socket"], known["pid"])


def registered_daemon(path: str) -> dict | None:
    """The running daemon registered for the mount `path` lies below by its name
    (mount_table.py), found without asking the mount; None where that does not tell
    (a path through a symlink, a daemon that is gone, a mount that is not tierfs)."""
    placed = TABLE.place(path)
    if placed is None:
        return None
    dev = placed[0]
    for point, _root in TABLE.roots_of(dev):
        info = registry.serving(dev, point)
        if info is not None:
            return info
    return None


def answers_ping(socket_path: str, wait_s: float = PING_WAIT_S) -> bool:
    """Whether the daemon listening at `socket_path` answers a ping within `wait_s`
    (a refused or dropped connection counts: it is not stuck, and the answer awaited
    says the rest)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(wait_s)
        try:
            sock.connect(socket_path)
            sock.sendall(b'{"cmd": "ping"}\n')
            sock.recv(1)
        except TimeoutError:
            return False
        except OSError:
            pass
    return True


class NotAnswering(UserError):
    """The daemon took the request and answers neither it nor a ping: the next
    request would wait for it just as long."""


def not_answering_text(socket_path: str, pid: int | None = None) -> str:
    if pid is None:
        return (f"the tierfs daemon at {socket_path} does not answer: if it was stopped, "
                f"kill -CONT its pid; if it is stuck, kill -USR1 writes what it waits for "
                f"to tierfs.log next to that socket")
    return (f"the tierfs daemon (pid {pid}) at {socket_path} does not answer: if it was "
            f"stopped, kill -CONT {pid}; if it is stuck, kill -USR1 {pid} writes what it "
            f"waits for to tierfs.log next to that socket")


def not_answering(socket_path: str, pid: int | None = None) -> NotAnswering:
    return NotAnswering(not_answering_text(socket_path, pid))


def request(path: str, cmd: str, *, daemon: dict | None = None, wait_s: float | None = None,
            **args):
    """Send one command; yield every reply line (progress lines, then the final one).
    `daemon`: daemon_info(path) when the caller has it already; `wait_s`: how long to
    wait for each reply line (TimeoutError past it). Without it, a command may run as
    long as it works: a line not here after ANSWER_CHECK_S pings the daemon, and one
    that answers neither (stopped, stuck) ends the wait with UserError."""
    if daemon is None:
        check_answers(path)
    info = daemon or daemon_info(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # A live daemon reads requests at once: a send that waits this long waits for a
    # stopped one.
    sock.settimeout(wait_s or ANSWER_CHECK_S + PING_WAIT_S)
    try:
        sock.connect(info["socket"])
    except TimeoutError:
        raise not_answering(info["socket"], info.get("pid")) from None
    except OSError as e:
        raise UserError(f"cannot reach the tierfs daemon at {info['socket']}: "
                        f"{e.strerror or e}") from None
    with sock:
        try:
            sock.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon refused the request before its end: its answer says why
        except TimeoutError:
            if wait_s is not None:
                raise
            raise not_answering(info["socket"], info.get("pid")) from None
        sock.settimeout(wait_s or ANSWER_CHECK_S)
        buf = bytearray()
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                if wait_s is not None:
                    raise
                if answers_ping(info["socket"]):
                    continue  # at work on the command
                raise not_answering(info["socket"], info.get("pid")) from None
            except ConnectionResetError:
                return  # the callers find no final answer, and say so
            if not chunk:
                return
            start = len(buf)
            buf += chunk
            end = buf.find(b"\n", start)
            while end >= 0:
                yield json.loads(buf[:end])
                del buf[:end + 1]
                end = buf.find(b"\n")


def call(path: str, cmd: str, *, daemon: dict | None = None, wait_s: float | None = None,
         **args) -> dict:
    """Send one command and return its final reply; errors become UserError."""
    last = None
    try:
        for last in request(path, cmd, daemon=daemon, wait_s=wait_s, **args):
            pass
    except TimeoutError:
        raise UserError(f"the tierfs daemon did not answer {cmd} within {wait_s:g} s") from None
    if last is None:
        raise UserError("the tierfs daemon closed the connection without answering")
    if not last.get("ok"):
        raise UserError(f"{cmd} failed: {last.get('error', 'unknown error')}")
    return last
