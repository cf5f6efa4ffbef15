"""Offline consistency check of a cache dir and its bucket (`tierfs fsck`).

Checks metadata against itself (dentries, cookies, link counts, parents),
against the hot tier (extent files present, no strays) and against the bucket
(referenced objects exist, no orphan objects). With repair=True it fixes what
it safely can and says what it did; data that is gone is reported, never
invented. It walks the metadata in key order and holds no copy of the namespace:
a large one does not fit in memory (docs/architecture.md, fsck).
"""
from __future__ import annotations

import heapq
import stat
from dataclasses import dataclass, replace
from itertools import groupby, islice
from operator import itemgetter

from ..checksum import object_matches
from ..errors import ColdStoreError, ObjectNotFound
from ..meta import scan
from ..meta import schema as s
from ..meta.schema import DIRTY, HOT, ROOT_INO, Ref, object_name
from .sortrun import SortedRecords


@dataclass
class Finding:
    problem: str
    fix: str = ""     # what repair did (empty: nothing, or not repairing)


class Fsck:
    """on_progress(done_bytes, total_bytes), with verify_data: called as the data
    check goes, in bytes read from the hot tier and the bucket (it reads them all)."""

    def __init__(self, meta, hot, cold, extent_size: int, *, repair: bool, verify_data: bool,
                 on_progress=None):
        self.meta, self.hot, self.cold, self.E = meta, hot, cold, extent_size
        self.repair = repair
        self.verify_data = verify_data
        self.on_progress = on_progress if verify_data else None
        self.findings: list[Finding] = []
        self.verify_total = self.verify_done = 0
        # A shared namespace (hot is None): extents name their data's place only, and
        # the sessions of mounted nodes may still publish objects they uploaded.
        self.live: set[int] = {x.sid for x in meta.sessions()} if hot is None else set()

    def found(self, problem: str, fix: str = "") -> None:
        self.findings.append(Finding(problem, fix if self.repair else ""))

    def run(self) -> list[Finding]:
        self.check_namespace()
        self.check_extents()
        self.check_packs()
        return self.findings

    def with_inodes(self, records, inos_of):
        """Each record with a table of the inodes it names (None: missing). A large
        namespace does not fit in memory: they are read for 1,000 records at a time,
        one round trip each to a database server."""
        records = iter(records)
        while batch := list(islice(records, 1000)):
            nodes = scan.inodes_by_number(self.meta, {i for r in batch for i in inos_of(r)})
            for record in batch:
                yield record, nodes

    # ---- namespace ---------------------------------------------------------------
    # Walked in key order, holding no table of the namespace: the names of each inode
    # (and the subdirectories of each directory) are counted by sorting one record per
    # entry on disk, and read back in inode order next to the inodes.
    def check_namespace(self) -> None:
        counts = SortedRecords(2)  # (child, 0) per entry, (parent, 1) per subdirectory
        try:
            bad = self.check_dentries(counts)
            self.check_cookies(bad)
            self.check_inodes(counts)
        finally:
            counts.close()

    def check_dentries(self, counts: SortedRecords) -> set[tuple[int, bytes]]:
        """Returns the (parent, name) of the entries found pointing nowhere."""
        meta = self.meta
        bad = set()
        entries = self.with_inodes(scan.dentries(meta), itemgetter(0, 2))
        for (parent, name, child, cookie), nodes in entries:
            node = nodes[child]
            if node is None or nodes[parent] is None:
                self.found(f"entry {name!r} in directory {parent} points to missing inode {child}",
                           "removed the entry")
                bad.add((parent, name))
                if self.repair:
                    meta.delete_raw([s.dentry_key(parent, name), s.cookie_key(parent, cookie)])
                continue
            counts.add(child, 0)
            if stat.S_ISDIR(node.mode):
                counts.add(parent, 1)
                if node.parent != parent:
                    self.found(f"directory {child} names {node.parent} as parent, "
                               f"but lives in {parent}", "fixed its parent")
                    if self.repair:
                        node.parent = parent
                        meta.put_inode(node)
        return bad

    def check_cookies(self, bad: set[tuple[int, bytes]]) -> None:
        """Cookies and entries are both in directory order: one directory's cookies are
        held at a time."""
        meta = self.meta
        dirs = ((parent, {c for _p, name, _child, c in names if (parent, name) not in bad})
                for parent, names in groupby(scan.dentries(meta), key=itemgetter(0)))
        parent, have = -1, set()
        for p, cookie, _name in scan.cookies(meta):
            while parent < p:
                parent, have = next(dirs, (float("inf"), set()))
            if parent != p or cookie not in have:
                self.found(f"readdir cookie {cookie} of directory {p} has no entry",
                           "removed the cookie")
                if self.repair:
                    meta.delete_raw([s.cookie_key(p, cookie)])

    def check_inodes(self, counts: SortedRecords) -> None:
        meta = self.meta
        orphans = set(meta.orphans())
        tallies = iter(counts)
        tally = next(tallies, None)
        for node in scan.inodes(meta):
            ino = node.ino
            links = subdirs = 0
            while tally is not None and tally[0] <= ino:
                if tally[0] == ino:
                    if tally[1]:
                        subdirs += 1
                    else:
                        links += 1
                tally = next(tallies, None)
            want = 2 + subdirs if stat.S_ISDIR(node.mode) else links
            if ino != ROOT_INO and links == 0:
                if ino in orphans:
                    self.found(f"inode {ino} was unlinked while open and not purged",
                               "purged it")
                    if self.repair:
                        meta.purge_orphan(ino)
                        for idx in self.hot_files().pop(ino, ()):
                            self.hot.remove(ino, idx)
                else:
                    self.found(f"inode {ino} is not reachable from the root",
                               "linked it into /lost+found")
                    if self.repair:
                        self.to_lost_found(node)
                continue
            if node.nlink != want:
                self.found(f"inode {ino} has link count {node.nlink}, expected {want}",
                           f"set it to {want}")
                if self.repair:
                    node.nlink = want
                    meta.put_inode(node)

    def to_lost_found(self, node) -> None:
        ino = node.ino
        try:
            lf = self.meta.lookup(ROOT_INO, b"lost+found")
        except Exception:
            lf = self.meta.create_node(ROOT_INO, b"lost+found", stat.S_IFDIR | 0o700, 0, 0).ino
        if stat.S_ISDIR(node.mode):
            node.nlink = 0  # link() refuses directories; re-create the entry by hand
            self.meta.put_inode(node)
        self.meta.relink(ino, lf, f"inode-{ino}".encode())

    # ---- extents, hot files, objects -------------------------------------------------
    def hot_files(self) -> dict[int, set[int]]:
        if not hasattr(self, "_hot"):
            self._hot: dict[int, set[int]] = {}
            for ino, idx, _size, _mtime in (self.hot.scan() if self.hot else ()):
                self._hot.setdefault(ino, set()).add(idx)
        return self._hot

    @staticmethod
    def verify_bytes(ext) -> int:
        """What the data check reads for an extent: its hot copy and its object."""
        if ext.dirty or not ext.obj_id:
            return 0
        return (ext.length if ext.hot else 0) + ext.obj_len

    def progress(self, nbytes: int) -> None:
        if self.on_progress is not None and nbytes:
            self.verify_done += nbytes
            self.on_progress(self.verify_done, self.verify_total)

    def check_extents(self) -> None:
        meta, E = self.meta, self.E
        hot = {k: set(v) for k, v in self.hot_files().items()}
        objects = set(self.cold.list("data/"))
        pending = {obj for obj, _epoch in meta.gc_pending()} | set(meta.upload_intents())
        referenced = set()
        fixes = {}
        gc = []
        if self.on_progress is not None:  # a metadata pass, cheap next to reading the data
            self.verify_total = sum(self.verify_bytes(x) for _i, _x, x in scan.extents(meta))
        weight = 0  # of the previous extent: counted once its checks are done
        for (ino, idx, ext), nodes in self.with_inodes(scan.extents(meta), itemgetter(0, 0)):
            self.progress(weight)
            weight = self.verify_bytes(ext)
            key = (ino, idx)
            has_file = idx in hot.get(ino, ())
            hot.get(ino, set()).discard(idx)
            node = nodes[ino]
            if ext.obj_id:
                referenced.add(ext.obj_id)
            if node is None or idx * E >= node.size:
                what = "a missing inode" if node is None else "data beyond the end of the file"
                self.found(f"extent {idx} of inode {ino} belongs to {what}", "removed it")
                fixes[key] = None
                if ext.obj_id:
                    gc.append(ext.ref)
                if has_file and self.repair:
                    self.hot.remove(ino, idx)
                continue
            if self.hot is None and ext.dirty:  # data only on the node of a session
                if ext.holder not in self.live:
                    self.found(f"inode {ino} extent {idx}: its data was only on session "
                               f"{ext.holder}, which ended before uploading it: lost",
                               "removed the extent (reads as zeros)")
                    fixes[key] = None
                continue
            if ext.hot and not has_file:
                if ext.dirty:
                    self.found(f"inode {ino} extent {idx}: dirty hot file is missing, "
                               f"its last changes are lost", "dropped the lost changes")
                    fixes[key] = replace(ext, flags=ext.flags & ~(HOT | DIRTY)) if ext.obj_id else None
                else:
                    self.found(f"inode {ino} extent {idx}: hot file is missing "
                               f"(the bucket still has it)", "marked it cold")
                    fixes[key] = replace(ext, flags=ext.flags & ~HOT)
                continue
            if not ext.hot and has_file:
                self.found(f"inode {ino} extent {idx}: stray hot file", "removed it")
                if self.repair:
                    self.hot.remove(ino, idx)
            if not ext.dirty and ext.obj_id and object_name(ext.obj_id) not in objects:
                if ext.hot:
                    self.found(f"inode {ino} extent {idx}: object {ext.obj_id} is missing from "
                               f"the bucket", "will upload the hot copy again")
                    fixes[key] = replace(ext, flags=ext.flags | DIRTY)
                else:
                    self.found(f"inode {ino} extent {idx}: object {ext.obj_id} is missing from "
                               f"the bucket and there is no hot copy: data lost",
                               "removed the extent (reads as zeros)")
                    fixes[key] = None
                    gc.append(ext.ref)
                continue
            if not ext.hot and not ext.obj_id:
                self.found(f"inode {ino} extent {idx}: no copy anywhere", "removed it")
                fixes[key] = None
                continue
            if self.verify_data and not ext.dirty:
                self.verify(ino, idx, ext, fixes)
        self.progress(weight)
        for ino, idxs in hot.items():
            for idx in idxs:
                self.found(f"stray hot file for inode {ino} extent {idx}", "removed it")
                if self.repair:
                    self.hot.remove(ino, idx)
        packs = {obj_id for obj_id, _pack in scan.packs(meta)}  # check_packs() sees to them
        highest = 0
        for key in sorted(objects):
            try:
                obj_id = int(key[len("data/"):], 16)
            except ValueError:
                continue
            highest = max(highest, obj_id)
            if self.live:
                continue  # mounted nodes may not have published their newest uploads yet
            if obj_id not in referenced and obj_id not in pending and obj_id not in packs:
                self.found(f"object {key} is not referenced by any file", "queued it for gc")
                gc.append(obj_id)
        # A power cut takes the metadata back to its last sync, the object id counter
        # too, while the bucket keeps what was uploaded since: the counter would hand
        # those ids out again, and gc (queued above) delete the new data under them.
        counter = meta.peek_counter(b"obj")
        if highest >= counter:
            self.found(f"the object id counter ({counter}) is behind the objects in the "
                       f"bucket (up to {highest})", f"moved it to {highest + 1}")
        if self.repair and highest >= counter:
            meta.raise_counter(b"obj", highest + 1)
        if self.repair and (fixes or gc or highest >= counter):
            meta.update(None, fixes, gc)
            meta.sync()

    def check_packs(self) -> None:
        """Every extent in a pack has its reference recorded and every recorded
        reference has its extent: a missing one would let gc delete a pack still in
        use, a stale one would keep a dead pack forever."""
        meta = self.meta
        # Objects in id order, one at a time: its pack record, its recorded references
        # and the extents using it (sorted by object on disk), never all of them at once.
        users = SortedRecords(5)  # (object, offset, ino, index, length)
        try:
            for ino, idx, ext in scan.extents(meta):
                if ext.obj_id:
                    users.add(ext.obj_id, ext.obj_off, ino, idx, ext.obj_len)
            self.check_objects(users)
        finally:
            users.close()
        if self.repair:
            meta.sync()

    def check_objects(self, users: SortedRecords) -> None:
        meta = self.meta
        packs = ((obj_id, 0, True) for obj_id, _pack in scan.packs(meta))
        recorded = ((obj_id, 1, {ref.offset: ref for _o, ref in refs})
                    for obj_id, refs in groupby(scan.refs(meta), key=itemgetter(0)))
        # The last extent in key order wins an offset used twice, as a table would have it.
        using = ((obj_id, 2, {off: Ref(off, length, ino, idx)
                              for _o, off, ino, idx, length in group})
                 for obj_id, group in groupby(users, key=itemgetter(0)))
        for obj_id, parts in groupby(heapq.merge(packs, recorded, using, key=itemgetter(0, 1)),
                                     key=itemgetter(0)):
            got = {kind: value for _o, kind, value in parts}
            is_pack, want, have = 0 in got, got.get(2, {}), got.get(1, {})
            # An object of one extent lies at offset 0: one used at another offset, or by
            # several extents, is a pack, whether its records say so or not.
            shared = bool(want) and (len(want) > 1 or 0 not in want)
            if not (is_pack or have or shared):
                continue
            if not is_pack and want:
                # Without its record, dropping one file's piece would send the whole
                # object to gc.
                self.found(f"pack {obj_id} has lost its record ({len(want)} extents use it)",
                           "recorded it again")
                if self.repair:
                    meta.set_pack_refs(obj_id, list(want.values()),
                                       total=self.pack_size(obj_id, want.values()))
                continue
            if not is_pack:
                self.found(f"references into object {obj_id}, which is not a pack",
                           "removed them")
            elif want == have:
                continue
            elif not want:
                self.found(f"pack {obj_id} is referenced by no file", "queued it for gc")
            else:
                missing = sum(1 for off, ref in want.items() if have.get(off) != ref)
                stale = sum(1 for off, ref in have.items() if want.get(off) != ref)
                self.found(f"pack {obj_id}: {missing} file reference(s) not recorded, "
                           f"{stale} recorded for no file", "recorded the right ones")
            if self.repair:
                meta.set_pack_refs(obj_id, list(want.values()) if is_pack else [])

    def pack_size(self, obj_id: int, refs) -> int:
        """A pack's size: its object's, or (gone from the bucket) the end of its last piece."""
        return self.cold.size(object_name(obj_id)) or max(r.offset + r.length for r in refs)

    def verify(self, ino: int, idx: int, ext, fixes) -> None:
        hot_ok = None
        if ext.hot:
            hot_ok = self.hot.copy_matches(ino, idx, ext.length, ext.checksum)
            if not hot_ok:
                self.found(f"inode {ino} extent {idx}: hot copy fails its checksum",
                           "dropped the hot copy")
                fixes[(ino, idx)] = replace(ext, flags=ext.flags & ~HOT)
                if self.repair:
                    self.hot.remove(ino, idx)
        try:
            data = self.cold.get(object_name(ext.obj_id), ext.obj_off, ext.obj_len)
            cold_ok = object_matches(data, ext.obj_len, ext.checksum)
        except ObjectNotFound:
            cold_ok = False
        except ColdStoreError as e:
            if e.transient:
                raise  # the bucket is away: nothing more can be checked now
            # Refused for this object (archived, its key denied): nothing is known
            # about its data, the rest of the check goes on.
            self.found(f"inode {ino} extent {idx}: object {object_name(ext.obj_id)} cannot "
                       f"be read ({e}): its data was not checked")
            return
        if not cold_ok:
            if hot_ok:
                self.found(f"inode {ino} extent {idx}: object {ext.obj_id} fails its checksum",
                           "will upload the good hot copy again")
                fixes[(ino, idx)] = replace(ext, flags=ext.flags | DIRTY)
            else:
                self.found(f"inode {ino} extent {idx}: object {ext.obj_id} fails its checksum "
                           f"and there is no good copy: data lost")
