"""An in-process store for tests and experiments."""
from __future__ import annotations

import threading

from tierfs.cold.base import check_range, content_version
from tierfs.errors import ObjectNotFound, PreconditionFailed


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

    def put_file(self, key: str, f) -> None:
        self.put(key, f.read())  # this store holds every object in memory anyway

    def get_file(self, key: str, f, offset: int = 0) -> int:
        data = self.get(key, offset)
        f.write(data)
        return len(data)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        data = self.get(key)
        return data, content_version(data)

    def put_if(self, key: str, data: bytes, version: str | None) -> None:
        data = bytes(data)
        with self._lock:
            cur = self._objects.get(key)
            if (None if cur is None else content_version(cur)) != version:
                raise PreconditionFailed(f"object '{key}' in {self.describe()} changed")
            self._objects[key] = data

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
