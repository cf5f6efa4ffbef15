"""Sorting more records than memory should hold: fixed-size tuples of integers, kept
sorted in runs in one temporary file and merged back in order (offline tools)."""
from __future__ import annotations

import heapq
import os
import struct
import tempfile
from typing import Iterator


class SortedRecords:
    """add() tuples of `width` unsigned 64-bit integers, then iterate them in order.
    Memory holds one run of `run` records, and a small block of each run while merging."""

    BLOCK = 256  # records read at a time from each run

    def __init__(self, width: int, run: int = 32768):
        # Big-endian bytes sort as their tuples do: the runs sort bytes, not tuples.
        self.fmt = struct.Struct(f">{width}Q")
        self.run = run
        self.buf: list[bytes] = []
        self.runs: list[tuple[int, int]] = []  # (start, end) in the file
        self.file = tempfile.TemporaryFile(prefix="tierfs-sort-")

    def add(self, *values: int) -> None:
        self.buf.append(self.fmt.pack(*values))
        if len(self.buf) >= self.run:
            self._spill()

    def _spill(self) -> None:
        self.buf.sort()
        start = self.file.seek(0, os.SEEK_END)
        for i in range(0, len(self.buf), self.BLOCK):
            self.file.write(b"".join(self.buf[i:i + self.BLOCK]))
        self.runs.append((start, self.file.tell()))
        self.buf = []

    def _read(self, start: int, end: int) -> Iterator[bytes]:
        size, fd = self.fmt.size, self.file.fileno()
        while start < end:
            block = os.pread(fd, min(size * self.BLOCK, end - start), start)
            start += len(block)
            for i in range(0, len(block), size):
                yield block[i:i + size]

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        if self.buf:
            self._spill()
        self.file.flush()
        for rec in heapq.merge(*(self._read(a, b) for a, b in self.runs)):
            yield self.fmt.unpack(rec)

    def close(self) -> None:
        self.file.close()
