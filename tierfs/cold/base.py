"""The interface every cold object store implements.

All methods are synchronous and may block; callers run them in worker threads.
Keys are relative to the store's own prefix ("data/000000000000002a").
Transient failures raise ColdStoreError(transient=True) so callers can retry;
anything else raises ColdStoreError(transient=False) or a subclass.
"""
from __future__ import annotations

import uuid
from typing import Protocol, runtime_checkable

import xxhash

# put_file and get_file move objects in pieces of this size.
FILE_PIECE = 1 << 20
# Keys written and removed by check() to prove the store is writable start with this.
PROBE_KEY = ".tierfs-probe"


def probe_key() -> str:
    """A probe key of one check's own: nodes mounting one location at once check it
    at once, and one's probe must not be deleted by another's check."""
    return f"{PROBE_KEY}.{uuid.uuid4().hex}"


@runtime_checkable
class ObjectStore(Protocol):
    def put(self, key: str, data: bytes) -> None:
        """Store data atomically: readers see the old object or the whole new one."""

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read [offset, offset+length) (to the end if length is None).

        Raises ObjectNotFound if the key is missing; reading past the end
        returns whatever bytes exist, possibly b''.
        """

    def put_file(self, key: str, f) -> None:
        """Store the rest of the seekable binary file object `f` (from its position to
        its end) as put does, read in pieces: an object as large as the metadata is
        never held in memory whole."""

    def get_file(self, key: str, f, offset: int = 0) -> int:
        """Write the object's bytes from `offset` to its end into the binary file
        object `f` (at its position), in pieces; how many. Raises ObjectNotFound if
        the key is missing."""

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The whole object and its version: an opaque tag that changes whenever the
        object does. Raises ObjectNotFound if the key is missing."""

    def put_if(self, key: str, data: bytes, version: str | None) -> None:
        """Store data only if the object is still at `version` (None: only if the key
        does not exist), as one step no other writer can come between; raise
        PreconditionFailed otherwise (ConditionalWritesUnsupported where the store
        cannot)."""

    def delete(self, key: str) -> None:
        """Remove the key; a missing key is not an error."""

    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with prefix, sorted."""

    def size(self, key: str) -> int | None:
        """Object size in bytes, or None if missing."""

    def check(self) -> None:
        """Verify the store is reachable and writable; raise ColdConfigError if not."""

    def describe(self) -> str:
        """A human-readable URL for messages, never containing credentials."""


def content_version(data: bytes) -> str:
    """The version tag of stores that keep no version of their own: a hash of the
    content (the objects written conditionally, leases, differ in every write)."""
    return xxhash.xxh3_128_hexdigest(data)


def check_range(offset: int, length: int | None) -> None:
    """Reject nonsense ranges the same way in every store."""
    if offset < 0 or (length is not None and length < 0):
        raise ValueError(f"bad range offset={offset} length={length}")
