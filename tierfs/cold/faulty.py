"""A wrapper that injects failures, latency and corruption for tests."""
from __future__ import annotations

import random
import threading
import time

from tierfs.errors import ColdConfigError, ColdStoreError


class FaultyStore:
    """Wraps any ObjectStore; tune the public attributes while it runs."""

    def __init__(self, inner, *, seed: int = 0) -> None:
        self.inner = inner
        self.fail_rate = 0.0  # probability that a call raises a transient error
        self.outage = False  # every call fails while True (a bucket refusing connections)
        self.denied = False  # every call fails, never retried (credentials expired)
        self.hang = False  # every call blocks while True (accepts, never answers), at most
        self.hang_limit_s = 600.0  # this long: a thread must end some day
        # Hang only these calls ("put", "get", "put_if": the writer lease's conditional
        # write, apart from "put" so that data uploads can hang while the lease is
        # renewed, as on a bucket whose large PUTs stall); empty: all.
        self.hang_ops: set[str] = set()
        self.latency_s = 0.0  # sleep before each call
        self.corrupt_keys: set[str] = set()  # get() on these flips one byte
        self.refuse_deletes: tuple[str, ...] = ()  # delete() of keys with these prefixes fails
        self.refuse_gets: tuple[str, ...] = ()  # get() of these fails (an archived object)
        # put() of these fails as a client timeout does, and lands when land_late() says
        # (the server finished it after the client gave up)
        self.puts_land_late: tuple[str, ...] = ()
        self._late: list[tuple[str, bytes]] = []
        self.calls: dict[str, int] = {}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # Random and the counters are shared by threads

    def _enter(self, op: str) -> None:
        with self._lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            fail = self.fail_rate > 0 and self._rng.random() < self.fail_rate
        if self.latency_s:
            time.sleep(self.latency_s)
        deadline = time.monotonic() + self.hang_limit_s
        while (self._hanging() and (not self.hang_ops or op in self.hang_ops)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        if self.outage:
            raise ColdStoreError("injected outage", transient=True)
        if self.denied:
            raise ColdConfigError("injected access denied: check AWS credentials")
        if fail:
            raise ColdStoreError(f"injected failure in {op}", transient=True)

    def _hanging(self) -> bool:
        return self.hang

    def put(self, key: str, data: bytes) -> None:
        self._enter("put")
        if key.startswith(self.puts_land_late):
            with self._lock:
                self._late.append((key, bytes(data)))
            raise ColdStoreError(f"put {key} failed: read timeout", transient=True)
        self.inner.put(key, data)

    def land_late(self) -> list[str]:
        """The PUTs held back by puts_land_late land now; their keys."""
        with self._lock:
            late, self._late = self._late, []
        for key, data in late:
            self.inner.put(key, data)
        return [key for key, _data in late]

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        self._enter("get")
        if key.startswith(self.refuse_gets):  # as S3 answers for an object in Glacier
            raise ColdStoreError(f"get {key} failed: InvalidObjectState (HTTP 403)")
        data = self.inner.get(key, offset, length)
        if key in self.corrupt_keys and data:
            with self._lock:
                i = self._rng.randrange(len(data))
            flipped = bytearray(data)
            flipped[i] ^= 0xFF
            data = bytes(flipped)
        return data

    def put_file(self, key: str, f) -> None:
        if key.startswith(self.puts_land_late):
            self.put(key, f.read())
            return
        self._enter("put")
        self.inner.put_file(key, f)

    def get_file(self, key: str, f, offset: int = 0) -> int:
        if key in self.corrupt_keys or key.startswith(self.refuse_gets):
            data = self.get(key, offset)  # with get's faults
            f.write(data)
            return len(data)
        self._enter("get")
        return self.inner.get_file(key, f, offset)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        self._enter("get")
        return self.inner.get_versioned(key)

    def put_if(self, key: str, data: bytes, version: str | None) -> None:
        self._enter("put_if")
        self.inner.put_if(key, data, version)

    def delete(self, key: str) -> None:
        self._enter("delete")
        if key.startswith(self.refuse_deletes):  # as a bucket whose policy denies deletes
            raise ColdStoreError(f"access denied: deleting {key} is not allowed")
        self.inner.delete(key)

    def list(self, prefix: str = "") -> list[str]:
        self._enter("list")
        return self.inner.list(prefix)

    def size(self, key: str) -> int | None:
        self._enter("size")
        return self.inner.size(key)

    def check(self) -> None:
        self._enter("check")
        self.inner.check()

    def describe(self) -> str:
        return f"faulty+{self.inner.describe()}"


class ControlledFaults(FaultyStore):
    """A FaultyStore steered from another process through a JSON file, e.g.
    {"outage": true, "denied": true, "hang": true, "hang_ops": ["put"], "fail_rate": 0.2,
     "latency_s": 0.01, "corrupt_keys": ["data/..."], "refuse_deletes": ["meta/"],
     "refuse_gets": ["data/..."]}.
    The file is re-read when it changes (also while a call hangs, so clearing
    "hang" releases it); tests of a mounted daemon use it."""

    def __init__(self, inner, control_path: str, *, seed: int = 0) -> None:
        super().__init__(inner, seed=seed)
        self.control_path = control_path
        self._mtime = None

    def _hanging(self) -> bool:
        self._reload()
        return self.hang

    def _enter(self, op: str) -> None:
        self._reload()
        super()._enter(op)

    def _reload(self) -> None:
        import json
        import os
        try:
            mtime = os.stat(self.control_path).st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if mtime != self._mtime:
            conf = {}
            if mtime is not None:
                try:
                    with open(self.control_path) as f:
                        conf = json.loads(f.read())  # empty: truncated, not yet written
                except (OSError, ValueError):
                    # Caught mid-write: read it again at the next call. Its mtime is not
                    # kept, as the rest of the write may not change it (coarse clock).
                    return
            self._mtime = mtime
            self.outage = bool(conf.get("outage", False))
            self.denied = bool(conf.get("denied", False))
            self.hang = bool(conf.get("hang", False))
            self.hang_ops = set(conf.get("hang_ops", ()))
            self.fail_rate = float(conf.get("fail_rate", 0.0))
            self.latency_s = float(conf.get("latency_s", 0.0))
            self.corrupt_keys = set(conf.get("corrupt_keys", ()))
            self.refuse_deletes = tuple(conf.get("refuse_deletes", ()))
            self.refuse_gets = tuple(conf.get("refuse_gets", ()))
