"""Retries of transient object store errors with jittered exponential backoff.

Wraps any ObjectStore. Each call is retried on transient errors (5xx, throttling,
timeouts, resets) until it succeeds or its time budget runs out; then the last
error is raised. Permanent errors pass straight through. Counts requests and errors
for metrics; "not found" and "changed" (a conditional write lost) are counted apart
(s3_not_found:OP, s3_changed:OP), as they are answers.
"""
from __future__ import annotations

import logging
import random
import time

from ..errors import ColdStoreError, ObjectNotFound, PreconditionFailed

log = logging.getLogger(__name__)


class RetryingStore:
    def __init__(self, inner, *, timeout: float = 30.0, base: float = 0.1, cap: float = 5.0,
                 stats=None):
        self.inner = inner
        self.stats = stats
        self.timeout = timeout
        self.base = base
        self.cap = cap
        self._rng = random.Random()

    def _call(self, op: str, *args, timeout: float | None = None, call=None):
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        attempt = 0
        while True:
            try:
                if self.stats:
                    self.stats.inc(f"s3_requests:{op}")
                return (call or getattr(self.inner, op))(*args)
            except (ObjectNotFound, PreconditionFailed) as e:
                # An answer, not an error: every first mount asks for a superblock, a
                # lease and checkpoints that are not there yet; a conditional write
                # finds the object changed.
                if self.stats:
                    kind = "not_found" if isinstance(e, ObjectNotFound) else "changed"
                    self.stats.inc(f"s3_{kind}:{op}")
                raise
            except ColdStoreError as e:
                if self.stats:
                    kind = type(e).__name__ + ("/transient" if e.transient else "")
                    self.stats.inc(f"s3_errors:{op}:{kind}")
                if not e.transient:
                    raise
                attempt += 1
                # "Full jitter": spreads retries of many threads after an outage.
                delay = self._rng.uniform(0, min(self.cap, self.base * 2 ** attempt))
                if time.monotonic() + delay > deadline:
                    raise
                log.debug("%s failed (%s); retry %d in %.2fs", op, e, attempt, delay)
                time.sleep(delay)

    def put(self, key: str, data: bytes, timeout: float | None = None) -> None:
        self._call("put", key, data, timeout=timeout)

    def get(self, key: str, offset: int = 0, length: int | None = None,
            timeout: float | None = None) -> bytes:
        return self._call("get", key, offset, length, timeout=timeout)

    def put_file(self, key: str, f) -> None:
        start = f.tell()

        def from_start(key, f):  # a retry sends the whole object again
            f.seek(start)
            self.inner.put_file(key, f)
        self._call("put", key, f, call=from_start)

    def get_file(self, key: str, f, offset: int = 0) -> int:
        start = f.tell()

        def from_start(key, f, offset):  # a retry writes the whole object again
            f.seek(start)
            f.truncate(start)
            return self.inner.get_file(key, f, offset)
        return self._call("get", key, f, offset, call=from_start)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        return self._call("get_versioned", key)

    def put_if(self, key: str, data: bytes, version: str | None) -> None:
        """Retried like put: a retry after a first try that landed finds the object
        changed (its own write), which the caller tells apart by reading it."""
        self._call("put_if", key, data, version)

    def delete(self, key: str) -> None:
        self._call("delete", key)

    def list(self, prefix: str = "") -> list[str]:
        return self._call("list", prefix)

    def size(self, key: str) -> int | None:
        return self._call("size", key)

    def check(self) -> None:
        """Retried like the rest: a bucket throttling a moment (many nodes mounting at
        once) is no misconfiguration. Stores raise ColdConfigError, never retried, for
        what the user must fix."""
        self._call("check")

    def describe(self) -> str:
        return self.inner.describe()
