"""An in-process store for tests and experiments."""
from __future__ import annotations

import threading

from tierfs.cold.base import check_range
from tierfs.errors import ObjectNotFound


class MemoryStore:
    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        data = bytes(data)  # copy so later changes by the caller can't leak in
        with self._lock:
            self._objects[key] = data

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        check_range(offset, length)
        with self._lock:
            data = self._objects.get(key)
        if data is None:
            raise ObjectNotFound(f"object '{key}' not found in {self.describe()}")
        end = len(data) if length is None else offset + length
        return data[offset:end]

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def list(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(k for k in self._objects if k.startswith(prefix))

    def size(self, key: str) -> int | None:
        with self._lock:
            data = self._objects.get(key)
        return None if data is None else len(data)

    def check(self) -> None:
        pass

    def describe(self) -> str:
        return "memory://"
