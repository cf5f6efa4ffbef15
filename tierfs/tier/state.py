"""This node's right to change the filesystem, shared by the lease (which sets
it), the engine and adapter (which refuse changes), the uploader and gc (which
stop) and the control interface (which reports it)."""
from __future__ import annotations

import errno
import logging

from ..errors import FsError

log = logging.getLogger(__name__)


class NodeState:
    def __init__(self):
        self.fenced_by: str | None = None  # who took the filesystem over, once fenced

    @property
    def fenced(self) -> bool:
        return self.fenced_by is not None

    def fence(self, holder: str) -> None:
        if self.fenced_by is None:
            self.fenced_by = holder
            log.error("the filesystem was taken over by %s: this mount is read-only from "
                      "now on and uploads nothing; unmount it", holder)

    def check_writable(self) -> None:
        """Changes after a takeover would never reach the bucket: refuse them."""
        if self.fenced_by is not None:
            raise FsError(errno.EROFS, f"fenced: taken over by {self.fenced_by}")

    def check_durable(self) -> None:
        """fsync cannot promise anything on a fenced mount."""
        if self.fenced_by is not None:
            raise FsError(errno.EIO, f"fenced: taken over by {self.fenced_by}")
