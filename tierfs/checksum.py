"""xxh3-64 checksums of extent data (the same function on every tier)."""
import xxhash


def xxh3(data) -> int:
    return xxhash.xxh3_64_intdigest(data)
