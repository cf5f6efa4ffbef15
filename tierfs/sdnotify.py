"""systemd's readiness protocol (sd_notify) in a few lines, without python-systemd.

`deploy/tierfs@.service` is `Type=notify`: systemd counts the unit as started only when
the daemon sends "READY=1", i.e. once the mount answers, and "STOPPING=1" says it is
shutting down. The protocol is one datagram to the AF_UNIX socket named by $NOTIFY_SOCKET
(a path, or "@name" for an abstract socket). That is all tierfs needs, so it carries no
dependency on libsystemd or the python-systemd bindings.

A notification is best effort: outside systemd (no $NOTIFY_SOCKET) nothing is sent, and a
socket that cannot be reached is never a reason to fail a mount, so `notify` returns False
instead of raising.
"""
from __future__ import annotations

import os
import socket

SEND_TIMEOUT = 1.0  # seconds; a receiver that does not read must not stall the daemon


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1", "STOPPING=1", "STATUS=...") to systemd.

    Returns True when the datagram was sent; False when $NOTIFY_SOCKET is unset or empty,
    names an address family other than AF_UNIX, or the send failed. Never raises.
    """
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    elif not addr.startswith("/"):
        return False  # unset, or e.g. "vsock:..." (not used for a local daemon)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(SEND_TIMEOUT)
            sock.connect(addr)
            sock.sendall(state.encode())
        return True
    except (OSError, ValueError):  # missing/refusing socket, path too long, bad encoding
        return False
