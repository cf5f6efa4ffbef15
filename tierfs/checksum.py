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
    if len(data) > length:
        return False
    if len(data) < length:
        data = bytes(data) + bytes(length - len(data))
    return xxh3(data) == checksum
