"""A dropped hot copy leaves its place at once (a rename) and is emptied by the
trash's own thread: the place can take a new copy meanwhile, and what a stopped
store left in the trash is emptied by the next one.

On a real directory: the store's files are the thing under test."""
from __future__ import annotations

import os
import threading

from tierfs.hot import trash as trash_module
from tierfs.hot.store import HotStore


def put(store: HotStore, ino: int, data: bytes) -> None:
    store.install_temp(store.write_temp(ino, 0, data), ino, 0)


def read(store: HotStore, ino: int) -> bytes:
    with open(store.path(ino, 0), "rb") as f:
        return f.read()


def held_trash(store: HotStore) -> threading.Event:
    """Hold the trash's thread before it empties anything; set() the event to let go."""
    go = threading.Event()
    empty = store.trash._empty

    def gated(path: str) -> None:
        assert go.wait(60), "the test never let the trash go on"
        empty(path)
    store.trash._empty = gated
    return go


def test_a_dropped_copy_leaves_its_place_at_once_and_is_emptied_later(tmp_path):
    store = HotStore(str(tmp_path / "hot"))
    go = held_trash(store)
    put(store, 1, b"a" * 70_000)
    store.remove(1, 0)
    assert not os.path.exists(store.path(1, 0))
    [name] = os.listdir(store.trash.path)
    assert os.path.getsize(os.path.join(store.trash.path, name)) == 70_000
    assert store.trash.waiting == 1 and store.trash.pending_bytes >= 70_000
    assert not store.trash.settle(timeout=0)
    put(store, 1, b"b" * 100)  # a new copy in the same place while the old one waits
    go.set()
    assert store.trash.settle(timeout=60)
    assert os.listdir(store.trash.path) == []
    assert (store.trash.waiting, store.trash.pending_bytes) == (0, 0)
    assert read(store, 1) == b"b" * 100  # the new copy was left alone
    for name in os.listdir(store.spare_dir):  # spares hold no bytes
        assert os.path.getsize(os.path.join(store.spare_dir, name)) == 0


def test_what_a_stopped_store_left_in_the_trash_is_emptied_by_the_next(tmp_path):
    trash = tmp_path / "hot.trash"
    trash.mkdir()
    for i in range(3):  # as a daemon that stopped before its thread emptied them
        (trash / f"1234-abcd-{i}").write_bytes(bytes([i]) * 9000)
    store = HotStore(str(tmp_path / "hot"))
    assert store.trash.settle(timeout=60)
    assert os.listdir(store.trash.path) == []
    assert (store.trash.waiting, store.trash.pending_bytes) == (0, 0)
    for name in os.listdir(store.spare_dir):
        assert os.path.getsize(os.path.join(store.spare_dir, name)) == 0
    put(store, 7, b"c" * 10)
    assert read(store, 7) == b"c" * 10


def test_the_copy_of_a_gone_inode_stays_in_place_until_the_thread_takes_it(tmp_path):
    """remove_later does nothing on the caller's thread: the file leaves its place
    when the trash gets to it (spare or unlinked), its cached descriptor closed then."""
    store = HotStore(str(tmp_path / "hot"))
    go = held_trash(store)
    put(store, 1, b"a" * 5000)
    store.pread(1, 0, 0, 10)  # a cached descriptor
    store.remove_later(1, 0, 5000)
    assert store.trash.waiting == 1 and store.trash.pending_bytes == 5000
    assert read(store, 1) == b"a" * 5000
    go.set()
    assert store.trash.settle(timeout=60)
    assert not os.path.exists(store.path(1, 0))
    assert (store.trash.waiting, store.trash.pending_bytes) == (0, 0)
    assert store._fds == {}


def test_a_file_the_trash_cannot_empty_is_unlinked(tmp_path):
    """Emptying failed (not a lease refusal: an error): the file is unlinked instead,
    never left holding its blocks."""
    store = HotStore(str(tmp_path / "hot"))

    def failing(path: str) -> None:
        raise PermissionError(13, "refused", path)
    store.trash._empty = failing
    put(store, 1, b"a" * 5000)
    store.remove(1, 0)
    assert store.trash.settle(timeout=60)
    assert os.listdir(store.trash.path) == []


def test_at_most_max_fds_descriptors_wait_in_the_trash(tmp_path, monkeypatch):
    """A backlog of dropped copies must not hold their cached descriptors until the
    daemon runs out: past MAX_FDS the caller closes its own."""
    monkeypatch.setattr(trash_module, "MAX_FDS", 4)
    store = HotStore(str(tmp_path / "hot"))
    go = held_trash(store)
    for ino in range(1, 11):
        put(store, ino, b"a" * 100)
        store.pread(ino, 0, 0, 1)  # a cached descriptor
    # Which of those descriptors are still open (a number closed here may be taken
    # by another thread of this process for another file: compare the files).
    cached = {fd: os.fstat(fd) for fd in (store._fds[(ino, 0)] for ino in range(1, 11))}

    def still_open() -> int:
        def same(fd, st):
            try:
                now = os.fstat(fd)
            except OSError:
                return False
            return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
        return sum(same(fd, st) for fd, st in cached.items())

    assert still_open() == 10
    for ino in range(1, 11):
        store.remove(ino, 0)
    assert store.trash._fds == 4
    assert still_open() == 4
    go.set()
    assert store.trash.settle(timeout=60)
    assert store.trash._fds == 0
    assert still_open() == 0


def test_a_copy_the_trash_cannot_take_is_unlinked_in_place(tmp_path):
    """The rename into the trash fails (here across filesystems, EXDEV; on a full disk
    the trash's directory may need a block): the copy is unlinked where it is, so its
    place is free and nothing at it can be mistaken for the extent's bytes."""
    src = tmp_path / "extent"
    src.write_bytes(b"old bytes")
    with open(src, "rb") as f:
        fd = os.dup(f.fileno())
    elsewhere = trash_module.Trash(os.path.join("/dev/shm", f"tierfs-trash-{os.getpid()}"),
                                   os.unlink)
    try:
        elsewhere.take(str(src), fd)
        assert not src.exists()
        assert elsewhere.waiting == 0
        try:
            os.fstat(fd)
        except OSError:
            pass  # closed, as take() promises
        else:
            raise AssertionError("take() left the descriptor open")
    finally:
        elsewhere.close()
        os.rmdir(elsewhere.path)
