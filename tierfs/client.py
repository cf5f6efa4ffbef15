"""Client side of the control interface: find a mount's daemon and talk to it."""
from __future__ import annotations

import errno
import json
import os
import socket

from . import registry
from .errors import UserError
from .mountpoint import DEAD_MOUNT

CONTROL_XATTR = "user.tierfs.control"


def daemon_info(path: str) -> dict:
    """pid, cache dir and socket of the daemon serving `path` (any path in a mount)."""
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


def request(path: str, cmd: str, *, daemon: dict | None = None, wait_s: float | None = None,
            **args):
    """Send one command; yield every reply line (progress lines, then the final one).
    `daemon`: daemon_info(path) when the caller has it already; `wait_s`: how long to
    wait for each reply line (None: as long as the command runs)."""
    info = daemon or daemon_info(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(wait_s)
    try:
        sock.connect(info["socket"])
    except OSError as e:
        raise UserError(f"cannot reach the tierfs daemon at {info['socket']}: "
                        f"{e.strerror or e}") from None
    with sock, sock.makefile("rb") as f:
        try:
            sock.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon refused the request before its end: its answer says why
        try:
            for line in f:
                yield json.loads(line)
        except ConnectionResetError:
            pass  # the callers find no final answer, and say so


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
