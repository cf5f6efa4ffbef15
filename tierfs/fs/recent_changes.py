"""What the change feed told lately, numbered, for lookups that raced it.

A lookup on a shared namespace reads an inode from the database in a worker
thread. If another node changes that inode (or the name) and the notification
arrives before the kernel holds the answer, the invalidation finds nothing to
drop, and the kernel would cache the older answer for --attr-timeout. So a
lookup notes `seq` before its read, registers the inode, then asks `since()`:
if the feed named it meanwhile, the answer goes to the kernel uncached.
"""
from __future__ import annotations

import collections
import threading

KEEP = 4096  # notifications remembered; a lookup older than that counts as raced


class RecentChanges:
    def __init__(self, keep: int = KEEP):
        self.seq = 0  # the number of the last notification noted
        self._recent: collections.deque = collections.deque(maxlen=keep)
        self._lock = threading.Lock()  # note() runs on the feed's thread

    def note(self, inodes, entries, everything: bool) -> None:
        """One notification: inode numbers, (directory, name) entries, or everything."""
        with self._lock:
            self.seq += 1
            self._recent.append((self.seq, frozenset(inodes), frozenset(entries), everything))

    def since(self, seq: int, ino: int, entry: tuple[int, bytes] | None = None) -> bool:
        """Whether a notification after `seq` named `ino` or `entry` (or everything)."""
        if self.seq == seq:
            return False
        with self._lock:
            if not self._recent or self._recent[0][0] > seq + 1:
                return True  # forgotten already: assume it did
            for n, inos, entries, everything in reversed(self._recent):
                if n <= seq:
                    return False
                if everything or ino in inos or entry in entries:
                    return True
            return False
