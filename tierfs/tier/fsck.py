"""Offline consistency check of a cache dir and its bucket (`tierfs fsck`).

Checks metadata against itself (dentries, cookies, link counts, parents),
against the hot tier (extent files present, no strays) and against the bucket
(referenced objects exist, no orphan objects). With repair=True it fixes what
it safely can and says what it did; data that is gone is reported, never
invented.
"""
from __future__ import annotations

import stat
from dataclasses import dataclass, replace

from ..checksum import object_matches
from ..errors import ColdStoreError, ObjectNotFound
from ..meta import scan
from ..meta import schema as s
from ..meta.schema import DIRTY, HOT, ROOT_INO, Ref, object_name


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
        self.inodes = {n.ino: n for n in scan.inodes(self.meta)}
        self.check_namespace()
        self.check_extents()
        self.check_packs()
        return self.findings

    # ---- namespace ---------------------------------------------------------------
    def check_namespace(self) -> None:
        meta, inodes = self.meta, self.inodes
        links: dict[int, int] = {}
        subdirs: dict[int, int] = {}
        dentry_cookies = set()
        for parent, name, child, cookie in scan.dentries(meta):
            if child not in inodes or parent not in inodes:
                self.found(f"entry {name!r} in directory {parent} points to missing inode {child}",
                           "removed the entry")
                if self.repair:
                    meta.delete_raw([s.dentry_key(parent, name), s.cookie_key(parent, cookie)])
                continue
            dentry_cookies.add((parent, cookie))
            links[child] = links.get(child, 0) + 1
            if stat.S_ISDIR(inodes[child].mode):
                subdirs[parent] = subdirs.get(parent, 0) + 1
                if inodes[child].parent != parent:
                    self.found(f"directory {child} names {inodes[child].parent} as parent, "
                               f"but lives in {parent}", "fixed its parent")
                    if self.repair:
                        inodes[child].parent = parent
                        meta.put_inode(inodes[child])
        for parent, cookie, name in scan.cookies(meta):
            if (parent, cookie) not in dentry_cookies:
                self.found(f"readdir cookie {cookie} of directory {parent} has no entry",
                           "removed the cookie")
                if self.repair:
                    meta.delete_raw([s.cookie_key(parent, cookie)])
        orphans = set(meta.orphans())
        for ino, node in inodes.items():
            if stat.S_ISDIR(node.mode):
                want = 2 + subdirs.get(ino, 0)
            else:
                want = links.get(ino, 0)
            if ino != ROOT_INO and links.get(ino, 0) == 0:
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
                        self.to_lost_found(ino)
                continue
            if node.nlink != want:
                self.found(f"inode {ino} has link count {node.nlink}, expected {want}",
                           f"set it to {want}")
                if self.repair:
                    node.nlink = want
                    meta.put_inode(node)

    def to_lost_found(self, ino: int) -> None:
        try:
            lf = self.meta.lookup(ROOT_INO, b"lost+found")
        except Exception:
            lf = self.meta.create_node(ROOT_INO, b"lost+found", stat.S_IFDIR | 0o700, 0, 0).ino
        node = self.inodes[ino]
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
        for ino, idx, ext in scan.extents(meta):
            self.progress(weight)
            weight = self.verify_bytes(ext)
            key = (ino, idx)
            has_file = idx in hot.get(ino, ())
            hot.get(ino, set()).discard(idx)
            node = self.inodes.get(ino)
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
        packs = {obj_id: pack for obj_id, pack in scan.packs(meta)}
        users: dict[int, dict[int, Ref]] = {}
        for ino, idx, ext in scan.extents(meta):
            if ext.obj_id:
                users.setdefault(ext.obj_id, {})[ext.obj_off] = Ref(ext.obj_off, ext.obj_len,
                                                                    ino, idx)
        recorded: dict[int, dict[int, Ref]] = {}
        for obj_id, ref in scan.refs(meta):
            recorded.setdefault(obj_id, {})[ref.offset] = ref
        # An object of one extent lies at offset 0: one used at another offset, or by
        # several extents, is a pack, whether its records say so or not.
        shared = {obj_id for obj_id, used in users.items() if len(used) > 1 or 0 not in used}
        for obj_id in sorted(packs.keys() | recorded.keys() | shared):
            want, have = users.get(obj_id, {}), recorded.get(obj_id, {})
            if obj_id not in packs and want:
                # Without its record, dropping one file's piece would send the whole
                # object to gc.
                self.found(f"pack {obj_id} has lost its record ({len(want)} extents use it)",
                           "recorded it again")
                if self.repair:
                    meta.set_pack_refs(obj_id, list(want.values()),
                                       total=self.pack_size(obj_id, want.values()))
                continue
            if obj_id not in packs:
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
                meta.set_pack_refs(obj_id, list(want.values()) if obj_id in packs else [])
        if self.repair:
            meta.sync()

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
