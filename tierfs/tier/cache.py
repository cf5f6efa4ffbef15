"""In-memory index of the hot tier: which extents are hot, their sizes, LRU order
of the evictable ones, and the dirty set with write generations, queued for the
uploader least recently written first, so that its rounds look at what is due and
never walk the whole backlog.

Pure bookkeeping, no I/O: the engine keeps it in step with the metadata.
"""
from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass

Key = tuple[int, int]  # (ino, extent index)


# Write generations come from one counter for the whole index and are never
# reused: an extent removed (truncate) and written again gets a new generation,
# so an upload that read the old content can never mark the new content clean.
_generations = itertools.count(1)


@dataclass(slots=True)
class DirtyInfo:
    gen: int          # set anew on every write; an upload only cleans the gen it read
    last_write: float  # monotonic seconds
    found: bool = False  # dirty when the daemon started: its writer is gone, upload now


class HotIndex:
    def __init__(self):
        self.sizes: dict[Key, int] = {}
        # Extent indices of each inode: the index itself while it has one (most files
        # are small: a set per inode cost 216 bytes each), a set from the second on.
        self._by_ino: dict[int, int | set[int]] = {}
        # Evictable extents (clean, unpinned), least recently used first.
        self.lru: collections.OrderedDict[Key, None] = collections.OrderedDict()
        self.dirty: dict[Key, DirtyInfo] = {}
        # Dirty extents no upload has taken, least recently written first, but those
        # to upload at once (found at start, or of a rushed inode) at the front: the
        # uploader reads from the front and stops at the first one not due yet.
        self.queued: collections.OrderedDict[Key, None] = collections.OrderedDict()
        self.rush: set[int] = set()  # inodes whose dirty extents upload without delay
        self._dirty_per_ino: dict[int, int] = {}  # dirty extents of each inode that has any
        self.last_write = 0.0  # monotonic time of the latest write
        self.pinned: set[Key] = set()
        # Clean copies found on the disk at mount (or handed back by scrub) that no read
        # has checked against their record yet. Every other copy was written or fetched
        # (and verified) by this daemon. Only these are kept, not the checked ones: after
        # the first epoch the set is empty, where a set of the checked ones held an
        # entry and a key of its own per hot extent.
        self.unchecked: set[Key] = set()
        # Extents direct writers hold (tier/direct_write.py): how many writers each.
        # They are dirty, never uploaded, and counted as whole extents.
        self.held: dict[Key, int] = {}
        self.total = 0
        self.dirty_bytes = 0

    def add(self, key: Key, size: int, *, dirty: bool, checked: bool, pinned: bool = False,
            last_write: float | None = None) -> None:
        """An extent file exists (mount, fetch). A dirty one found at mount gets
        `last_write` (monotonic) from its file's age, so it uploads on time. `checked`:
        its bytes are known to be the record's (fetched and verified, or written here);
        a clean copy found at mount is not, until a read checks it."""
        held = self.held.get(key)
        self.remove(key)
        if held:
            self.held[key] = held
        self.sizes[key] = size
        ino, idx = key
        have = self._by_ino.get(ino)
        if have is None:
            self._by_ino[ino] = idx
        elif isinstance(have, set):
            have.add(idx)
        elif have != idx:
            self._by_ino[ino] = {have, idx}
        self.total += size
        if pinned:
            self.pinned.add(key)
        if not (checked or dirty):
            self.unchecked.add(key)
        if dirty:
            when = time.monotonic() if last_write is None else last_write
            self._make_dirty(key, DirtyInfo(next(_generations), when,
                                            found=last_write is not None))
        elif not pinned:
            self.lru[key] = None

    def remove(self, key: Key) -> None:
        size = self.sizes.pop(key, None)
        if size is None:
            return
        self.total -= size
        ino, idx = key
        have = self._by_ino.get(ino)
        if isinstance(have, set):
            have.discard(idx)
            if len(have) == 1:
                self._by_ino[ino] = next(iter(have))
        elif have == idx:
            del self._by_ino[ino]
        self.lru.pop(key, None)
        self.pinned.discard(key)
        self.unchecked.discard(key)
        self.held.pop(key, None)
        if key in self.dirty:
            self._drop_dirty(key, size)

    def _make_dirty(self, key: Key, info: DirtyInfo) -> None:
        self.dirty[key] = info
        self.dirty_bytes += self.sizes[key]
        self._dirty_per_ino[key[0]] = self._dirty_per_ino.get(key[0], 0) + 1
        self._queue(key)

    def _drop_dirty(self, key: Key, size: int) -> None:
        del self.dirty[key]
        self.queued.pop(key, None)
        self.dirty_bytes -= size
        ino = key[0]
        left = self._dirty_per_ino[ino] - 1
        if left:
            self._dirty_per_ino[ino] = left
        else:
            del self._dirty_per_ino[ino]
            self.rush.discard(ino)  # all of it uploaded: later writes wait as usual

    def _queue(self, key: Key) -> None:
        """(Re)place a dirty extent in the upload queue: at the front if it is to go
        at once, else at the back (the most recently written)."""
        self.queued[key] = None
        self.queued.move_to_end(key, last=not (self.dirty[key].found or key[0] in self.rush))

    def grow(self, key: Key, size: int) -> None:
        """An extent file grew to `size` bytes (writes)."""
        old = self.sizes.get(key, 0)
        if size > old:
            self.sizes[key] = size
            self.total += size - old
            if key in self.dirty:
                self.dirty_bytes += size - old

    def set_size(self, key: Key, size: int) -> None:
        old = self.sizes.get(key)
        if old is None:
            return
        self.sizes[key] = size
        self.total += size - old
        if key in self.dirty:
            self.dirty_bytes += size - old

    def uncheck(self, key: Key) -> None:
        """Have a clean copy checked against its record again on its next read."""
        if key in self.sizes and key not in self.dirty:
            self.unchecked.add(key)

    def written(self, key: Key, end: int) -> None:
        """Record a write into the extent file up to byte `end`."""
        if key not in self.sizes:
            self.add(key, end, dirty=True, checked=True, pinned=False)
        else:
            self.grow(key, end)
            if key not in self.dirty:
                self.lru.pop(key, None)
                self._make_dirty(key, DirtyInfo(0, 0.0))
        self.unchecked.discard(key)  # what is in the file now is ours
        info = self.dirty[key]
        info.gen = next(_generations)
        info.last_write = self.last_write = time.monotonic()
        info.found = False
        if key in self.queued:  # one an upload has taken goes back when that ends
            self._queue(key)

    def cleaned(self, key: Key, gen: int) -> bool:
        """An upload of generation `gen` finished; clean unless written since."""
        info = self.dirty.get(key)
        if info is None or info.gen != gen:
            return False
        self._drop_dirty(key, self.sizes.get(key, 0))
        if key not in self.pinned:
            self.lru[key] = None
        return True

    def take(self, key: Key) -> None:
        """An upload takes a dirty extent: out of the queue until give_back()."""
        self.queued.pop(key, None)

    def give_back(self, key: Key) -> None:
        """An upload of `key` ended: queue it again if it is still dirty (written
        meanwhile, or the upload failed), at the back: at worst it waits for those
        ahead of it to come due, which takes no longer than their delay."""
        if key in self.dirty and key not in self.queued:
            self._queue(key)

    def rush_inode(self, ino: int) -> None:
        """Upload the dirty extents of `ino` without waiting for their delay (sync,
        or a file other nodes wait for), and those written later too, until none is
        left dirty."""
        if not self._dirty_per_ino.get(ino):
            return
        self.rush.add(ino)
        for idx in sorted(self.extents_of(ino), reverse=True):  # ends in file order
            if (ino, idx) in self.queued:
                self.queued.move_to_end((ino, idx), last=False)

    def has_dirty(self, ino: int) -> bool:
        return bool(self._dirty_per_ino.get(ino))

    def dirty_bytes_of(self, inos) -> int:
        """Bytes not uploaded yet of `inos` (all inodes if None): a walk over the
        extents of those of them that have dirty ones (`sync --wait` asks twice a
        second), not over every dirty extent."""
        if inos is None:
            return self.dirty_bytes
        per_ino = self._dirty_per_ino
        dirty_inos = ([ino for ino in per_ino if ino in inos] if len(inos) > len(per_ino)
                      else [ino for ino in inos if ino in per_ino])
        return sum(self.sizes[(ino, i)] for ino in dirty_inos for i in self.extents_of(ino)
                   if (ino, i) in self.dirty)

    def touch(self, key: Key) -> None:
        if key in self.lru:
            self.lru.move_to_end(key)

    def set_pinned(self, key: Key, pinned: bool) -> None:
        if key not in self.sizes:
            return
        if pinned:
            self.pinned.add(key)
            self.lru.pop(key, None)
        else:
            self.pinned.discard(key)
            if key not in self.dirty:
                self.lru[key] = None

    def held_indices(self, ino: int) -> list[int]:
        return sorted(i for i in self.extents_of(ino) if (ino, i) in self.held)

    def indices(self, ino: int) -> list[int]:
        return sorted(self.extents_of(ino))

    def extents_of(self, ino: int):
        """The indices of the hot extents of `ino`, in no order."""
        have = self._by_ino.get(ino, ())
        return (have,) if isinstance(have, int) else have
