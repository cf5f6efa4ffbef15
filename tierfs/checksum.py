"""xxh3-64 checksums of extent data, and the one rule for checking a copy of an
extent against its record (used by the engine, scrub and fsck alike)."""
import xxhash


def xxh3(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def object_matches(data, length: int, checksum: int) -> bool:
    """An object range read from the bucket holds exactly `length` bytes."""
    return len(data) == length and xxh3(data) == checksum


def hot_copy_matches(data, length: int, checksum: int) -> bool:
    """A hot extent file holds the object's bytes, except that a hole at its end
    may be missing from the file (the object stores those zeros). Read at least
    length + 1 bytes so that a file longer than the object is caught."""
    check = HotCopyCheck(length, checksum)
    check.update(data)
    return check.matches()


class HotCopyCheck:
    """The check of hot_copy_matches on a hot extent file fed in pieces (update), so
    that a large one is checked without a buffer of its size."""

    def __init__(self, length: int, checksum: int):
        self.length, self.checksum = length, checksum
        self.seen = 0
        self._hash = xxhash.xxh3_64()

    def update(self, piece) -> None:
        self.seen += len(piece)
        if self.seen <= self.length:
            self._hash.update(piece)

    def matches(self) -> bool:
        if self.seen > self.length:
            return False
        zeros = self.length - self.seen  # a hole at the end, missing from the file
        while zeros:
            pad = min(zeros, len(_ZEROS))
            self._hash.update(_ZEROS[:pad])
            zeros -= pad
        return self._hash.intdigest() == self.checksum


_ZEROS = memoryview(bytes(1 << 20))
