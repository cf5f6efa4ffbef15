"""Error types shared by every layer.

Domain errors carry their errno where they are raised; the fs adapter maps them
to FUSEError once. UserError is what the command line prints as one line.
"""
import errno as _errno


class TierfsError(Exception):
    """Base of every error tierfs raises on purpose."""

    errno = _errno.EIO


class FsError(TierfsError):
    """A filesystem operation failed with a specific errno (ENOENT, ENOTEMPTY...)."""

    def __init__(self, err: int, message: str = ""):
        super().__init__(message or _errno.errorcode.get(err, str(err)))
        self.errno = err


class ColdUnavailable(FsError):
    """The bucket did not serve a read (it failed, or was silent past --cold-timeout):
    EIO, and nothing known about the object's data, unlike a checksum mismatch."""

    def __init__(self, message: str):
        super().__init__(_errno.EIO, message)


class UserError(TierfsError):
    """Bad input or environment: printed as one line naming the problem and the fix."""


class NotInBucket(UserError):
    """Data this mount accepted is not in the bucket (yet, or ever: fenced).
    The command line exits with EXIT_NOT_IN_BUCKET for it."""


EXIT_NOT_IN_BUCKET = 3


class SessionLost(TierfsError):
    """This mount's session was ended by another node (its heartbeat was too old):
    what it holds open is purged, so it must stop changing the namespace."""


class ColdStoreError(TierfsError):
    """The object store failed. `transient` errors may succeed when retried."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class ObjectNotFound(ColdStoreError):
    """The requested object does not exist in the store."""


class PreconditionFailed(ColdStoreError):
    """A conditional write found the object changed (or there, or gone) since it was read."""


class ConditionalWritesUnsupported(ColdStoreError):
    """The object store refuses conditional writes (If-Match / If-None-Match)."""


class ColdConfigError(ColdStoreError, UserError):
    """The store is misconfigured: missing bucket, bad credentials, bad endpoint."""


class ChecksumMismatch(TierfsError):
    """Data read from a tier does not match its recorded xxh3 checksum."""
