"""Per-file tiering actions behind the control commands: prefetch, release, pin."""
from __future__ import annotations

from dataclasses import replace

import trio

from ..config import format_size
from ..errors import ColdUnavailable, FsError, TierfsError
from ..meta.schema import DIRTY, HOT, PINNED


async def prefetch(engine, ino: int, parallel: int = 8, for_write: bool = True,
                   wanted=None) -> None:
    """Bring every extent of a file hot (callers count bytes with hot_bytes()).
    for_write=False lets the cache policy decline (hints under no-replace): an extent
    the policy would not keep now is not fetched at all. No
    neighbours are read around it, except the extents of `wanted` files (inode ->
    bool: asked for in the same request or hint list) packed next to it."""
    exts = engine.meta.all_extents(ino)
    size = engine.meta.get_inode(ino).size
    limiter = trio.CapacityLimiter(max(1, parallel))

    async def one(idx: int) -> None:
        async with limiter:
            length = min(engine.E, max(0, size - idx * engine.E))
            if not for_write and engine.space is not None and not engine.space.keeps_fetch(length):
                return  # the policy would drop the bytes: a GET for nothing
            await engine.fetch(ino, idx, for_write=for_write, around=False, wanted=wanted)

    try:
        async with trio.open_nursery() as nursery:
            for idx, ext in sorted(exts.items()):
                if not ext.hot:
                    nursery.start_soon(one, idx)
    except ExceptionGroup as group:
        raise first_error(group) from None


def _bytes_of(engine, ino: int, indices) -> int:
    """Bytes of a file that these extents hold (the last one cut at the file's size)."""
    size, E = engine.meta.get_inode(ino).size, engine.E
    return sum(min(E, max(0, size - i * E)) for i in indices)


def hot_bytes(engine, ino: int) -> int:
    """Bytes of a file whose extents are in the hot tier now."""
    return _bytes_of(engine, ino, engine.index.extents_of(ino))


def cold_bytes(engine, ino: int) -> int:
    """Bytes of a file's extents that are not in the hot tier now (holes not counted)."""
    return _bytes_of(engine, ino, [i for i, ext in engine.meta.all_extents(ino).items()
                                   if not ext.hot])


async def prefetch_many(engine, inos: list[int], parallel: int = 8, pin: bool = False) -> dict:
    """Prefetch many files as one request, `parallel` files at a time. A file's
    fetches also bring along the cold extents of the request's files not done yet
    that are packed next to them (Engine._wanted_neighbours: one ranged GET for a
    run of a pack), so a directory of small packed files costs a GET per run, not
    one per file. Per inode: bytes fetched (hot now, not when the request came:
    also those fetched along with a neighbour), already hot, and not hot at the end
    (a file larger than the hot tier evicts its own first extents), or the error.
    With `pin`, each file is pinned as soon as its fetch ends, if it is whole on
    the hot tier then (pin_whole)."""
    pending = set(inos)
    out: dict = {}
    start = {}
    for ino in pending:
        try:
            start[ino] = hot_bytes(engine, ino)
        except TierfsError as e:
            out[ino] = e
    pending.difference_update(out)
    files = trio.CapacityLimiter(max(1, parallel))

    async def one(ino: int) -> None:
        async with files:
            try:
                await prefetch(engine, ino, parallel, wanted=pending.__contains__)
                res = {"fetched": max(0, hot_bytes(engine, ino) - start[ino]),
                       "already_hot": start[ino], "not_hot": cold_bytes(engine, ino)}
                if pin:  # now, before other files' fetches may evict its extents
                    res["pinned"] = pin_whole(engine, ino)
                out[ino] = res
            except TierfsError as e:
                out[ino] = e
            finally:
                pending.discard(ino)

    async with trio.open_nursery() as nursery:
        for ino in dict.fromkeys(inos):
            if ino in start:
                nursery.start_soon(one, ino)
    return out


def first_error(group: ExceptionGroup) -> BaseException:
    """The first error of a group of filesystem errors (the caller reports one, as a
    plain FsError); the group itself if anything else is in it."""
    leaves = []

    def walk(g):
        for e in g.exceptions:
            if isinstance(e, BaseExceptionGroup):
                walk(e)
            else:
                leaves.append(e)

    walk(group)
    if all(isinstance(e, TierfsError) for e in leaves):
        return leaves[0]
    return group


def release(engine, ino: int) -> dict:
    """Drop the hot copies of a file's clean extents; data stays in the bucket."""
    exts = engine.meta.all_extents(ino)
    out = {"released": 0, "dirty_kept": 0, "pinned_kept": 0}
    batch = {}
    for idx, ext in exts.items():
        if not ext.hot:
            continue
        if ext.dirty or not ext.obj_id or (ino, idx) in engine.index.dirty:
            # Still dirty here: uploaded, its clean record not durable yet (or written).
            out["dirty_kept"] += 1
            continue
        if ext.pinned:
            out["pinned_kept"] += 1
            continue
        batch[(ino, idx)] = replace(ext, flags=ext.flags & ~HOT)
        out["released"] += engine.index.sizes.get((ino, idx), 0)
        engine.forget_hot(ino, idx)
    if batch:
        engine.meta.update(None, batch)
    return out


def pin_whole(engine, ino: int) -> int:
    """Pin a file whose every extent is hot; extents changed. One that is not whole
    on the hot tier (larger than the room left beside pinned and dirty data) is not
    pinned: its pinned hot part would hold the room every write needs, and its cold
    part could never come in."""
    exts = engine.meta.all_extents(ino)
    if not all(ext.hot for ext in exts.values()):
        size = engine.meta.get_inode(ino).size
        raise TierfsError(f"not pinned: only {format_size(hot_bytes(engine, ino))} of its "
                          f"{format_size(size)} fit in the hot tier beside what it holds "
                          f"pinned or dirty; raise --cache-size or pin less")
    return set_pinned(engine, ino, True)


def set_pinned(engine, ino: int, pinned: bool) -> int:
    """Set or clear the pin bit on every extent of a file; returns extents changed."""
    exts = engine.meta.all_extents(ino)
    batch = {}
    for idx, ext in exts.items():
        flags = ext.flags | PINNED if pinned else ext.flags & ~PINNED
        if flags != ext.flags:
            batch[(ino, idx)] = replace(ext, flags=flags)
            engine.index.set_pinned((ino, idx), pinned)
    if batch:
        engine.meta.update(None, batch)
    return len(batch)


async def scrub(engine, ino: int) -> dict:
    """Re-read and verify every clean extent of a file, hot copy and object.
    A damaged hot copy is replaced from the bucket (hot_lost where the object is
    damaged too); a damaged object is reported (and re-uploaded from a good hot copy)."""
    out = {"hot_ok": 0, "hot_repaired": 0, "hot_lost": 0, "cold_ok": 0, "cold_bad": 0,
           "dirty_skipped": 0}
    for idx, ext in sorted(engine.meta.all_extents(ino).items()):
        if ext.dirty or not ext.obj_id:
            out["dirty_skipped"] += 1
            continue
        hot_good = False
        if ext.hot:
            engine.index.uncheck((ino, idx))  # check it again now
            hot_good = await engine.verify_hot_copy(ino, idx)
            out["hot_ok"] += hot_good
        try:
            if not await engine.verify_cold(ino, idx, ext):
                out["dirty_skipped"] += 1  # changed while it was read
                continue
            out["cold_ok"] += 1
            if ext.hot and not hot_good:
                await engine.fetch(ino, idx, for_write=True)
                out["hot_repaired"] += 1  # only now: the bucket's copy was good
        except ColdUnavailable:
            raise  # the object could not be checked: no damage found, none to report
        except FsError:
            out["cold_bad"] += 1
            out["hot_lost"] += ext.hot and not hot_good  # no good copy anywhere
            if hot_good:  # upload the good hot copy again
                _n, exts = engine.meta.get_extents(ino, idx, idx)
                cur = exts.get(idx)
                if cur is not None and cur.hot:
                    engine.meta.update(None, {(ino, idx): replace(cur, flags=cur.flags | DIRTY)})
                    engine.index.written((ino, idx), engine.index.sizes.get((ino, idx), 0))
    return out
