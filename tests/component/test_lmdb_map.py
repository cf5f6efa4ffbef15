"""The LMDB engine's map: it grows when full, and it cannot while a worker thread
reads (the map must not move under the thread), so it makes room before one starts."""
from __future__ import annotations

import threading

from tierfs.meta.lmdb_kv import LmdbKV

KiB = 1024
VALUE = b"v" * (8 * KiB)  # an overflow value: pages the map holds, easy to count


def used_bytes(kv: LmdbKV) -> int:
    return (kv.env.info()["last_pgno"] + 1) * kv.env.stat()["psize"]


def put(kv: LmdbKV, key: bytes) -> None:
    def body():
        with kv.write() as txn:
            txn.put(key, VALUE)
    kv.run(body)


def test_writes_while_a_worker_thread_reads_get_no_enospc(tmp_path):
    """A checkpoint copy or a compaction scan reads in a worker thread while files
    are written: writes far smaller than the database must not fail with ENOSPC
    because the map could not grow under the reader."""
    kv = LmdbKV(str(tmp_path / "meta"), map_size=1 << 20, max_map_size=1 << 30)
    try:
        i = 0
        while used_bytes(kv) < kv.map_size * 3 // 4:  # most of the map in use
            put(kv, b"a%06d" % i)
            i += 1
        before = used_bytes(kv)
        reading, done = threading.Event(), threading.Event()

        def reader():
            with kv.read() as txn:  # a snapshot held, as env.copy() holds one
                txn.get(b"a000000")
                reading.set()
                done.wait()

        with kv.reading_in_thread():
            thread = threading.Thread(target=reader)
            thread.start()
            try:
                assert reading.wait(30)
                # Values half the size of the database when the reader started.
                for j in range(before // 2 // len(VALUE)):
                    put(kv, b"b%06d" % j)
            finally:
                done.set()
                thread.join()
    finally:
        kv.close()
