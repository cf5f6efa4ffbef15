"""The daemon's copy of the kernel's default_permissions rules for direct reads
(tierfs.fs.direct.may / resolve), on a small in-memory namespace."""
from __future__ import annotations

import errno
import stat

import pytest

from tierfs.errors import FsError
from tierfs.fs.direct import (MAY_EXEC, MAY_READ, MAY_WRITE, MAX_LINKS, Creds, UseMount, may,
                              resolve)
from tierfs.meta.schema import ROOT_INO, Inode

# Callers whose capabilities the rules are told (the daemon never is: see below).
ALL_CAPS = 1 << 1 | 1 << 2  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
ROOT = Creds.of(0, 0, caps=ALL_CAPS)
ALICE = Creds.of(1000, 1000, caps=0)
BOB = Creds.of(1001, 1001, caps=0)
BOB_IN_STAFF = Creds.of(1001, 1001, [50], caps=0)
MOUNT = "/mnt/t"


class FakeMeta:
    """lookup / get_inode / readlink as the metadata store answers them."""

    def __init__(self):
        self.inodes = {ROOT_INO: Inode(ROOT_INO, stat.S_IFDIR | 0o755, 0, 0, parent=ROOT_INO)}
        self.entries: dict[tuple[int, bytes], int] = {}
        self.targets: dict[int, bytes] = {}

    def add(self, path: str, mode: int, uid: int = 0, gid: int = 0, target: str = "") -> int:
        *dirs, name = path.split("/")
        parent = ROOT_INO
        for d in dirs:
            parent = self.entries[(parent, d.encode())]
        ino = len(self.inodes) + 1
        self.inodes[ino] = Inode(ino, mode, uid, gid, parent=parent)
        self.entries[(parent, name.encode())] = ino
        if target:
            self.targets[ino] = target.encode()
        return ino

    def dir(self, path, perm=0o755, uid=0, gid=0):
        return self.add(path, stat.S_IFDIR | perm, uid, gid)

    def file(self, path, perm=0o644, uid=0, gid=0):
        return self.add(path, stat.S_IFREG | perm, uid, gid)

    def link(self, path, target, uid=0):
        return self.add(path, stat.S_IFLNK | 0o777, uid, 0, target)

    def get_inode(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise FsError(errno.ENOENT) from None

    def lookup(self, parent: int, name: bytes) -> int:
        try:
            return self.entries[(parent, name)]
        except KeyError:
            raise FsError(errno.ENOENT) from None

    def readlink(self, ino: int) -> bytes:
        return self.targets[ino]


def err(meta, rel, creds, **kw) -> int:
    with pytest.raises(FsError) as e:
        resolve(meta, rel, creds, [MOUNT], **kw)
    return e.value.errno


# ---- may(): generic_permission ------------------------------------------------------------

def test_owner_group_and_other_bits():
    mode = stat.S_IFREG | 0o640
    assert may(mode, 1000, 50, ALICE, MAY_READ | MAY_WRITE)
    assert may(mode, 1000, 50, BOB_IN_STAFF, MAY_READ)        # a supplementary group
    assert not may(mode, 1000, 50, BOB_IN_STAFF, MAY_WRITE)
    assert not may(mode, 1000, 50, BOB, MAY_READ)              # other: nothing
    assert may(mode, 1000, 1001, BOB, MAY_READ)                # primary group


def test_owner_bits_win_even_when_others_may_more():
    assert not may(stat.S_IFREG | 0o044, 1000, 1000, ALICE, MAY_READ)
    assert may(stat.S_IFREG | 0o044, 1000, 1000, BOB, MAY_READ)


def test_root_overrides_except_executing_a_file_without_x_bits():
    assert may(stat.S_IFREG | 0o000, 1000, 1000, ROOT, MAY_READ | MAY_WRITE)
    assert not may(stat.S_IFREG | 0o644, 1000, 1000, ROOT, MAY_EXEC)
    assert may(stat.S_IFREG | 0o100, 1000, 1000, ROOT, MAY_EXEC)
    # Directories: CAP_DAC_OVERRIDE searches them whatever their bits say.
    assert may(stat.S_IFDIR | 0o000, 1000, 1000, ROOT, MAY_EXEC | MAY_WRITE)


def test_capabilities_not_uid_decide():
    no_caps_root = Creds.of(0, 0, caps=0)
    assert not may(stat.S_IFREG | 0o600, 1000, 1000, no_caps_root, MAY_READ)
    reader = Creds.of(1001, 1001, caps=1 << 2)  # CAP_DAC_READ_SEARCH only
    assert may(stat.S_IFREG | 0o000, 1000, 1000, reader, MAY_READ)
    assert not may(stat.S_IFREG | 0o000, 1000, 1000, reader, MAY_WRITE)
    assert may(stat.S_IFDIR | 0o000, 1000, 1000, reader, MAY_EXEC | MAY_READ)
    assert not may(stat.S_IFDIR | 0o000, 1000, 1000, reader, MAY_EXEC | MAY_WRITE)


def test_where_the_bits_refuse_a_peer_the_kernel_decides():
    """The daemon knows a peer's uid and groups, not its capabilities (/proc shows
    full ones inside a rootless container, and the connector's, not the holder's):
    where the bits refuse, a capability might allow, so the kernel decides. Where
    they allow, or nothing could override them, the daemon answers."""
    peer, peer_root = Creds.of(1001, 1001), Creds.of(0, 0)
    assert may(stat.S_IFREG | 0o644, 1000, 1000, peer, MAY_READ)
    assert may(stat.S_IFREG | 0o600, 0, 0, peer_root, MAY_READ)
    for who in (peer, peer_root):
        with pytest.raises(UseMount):
            may(stat.S_IFREG | 0o600, 1000, 1000, who, MAY_READ)
        with pytest.raises(UseMount):
            may(stat.S_IFDIR | 0o700, 1000, 1000, who, MAY_EXEC)
        assert not may(stat.S_IFREG | 0o644, 1000, 1000, who, MAY_EXEC)
    ns = FakeMeta()
    ns.dir("private", 0o700, 1000, 1000)
    ns.file("private/f", 0o644, 1000, 1000)
    ns.file("secret", 0o600, 1000, 1000)
    with pytest.raises(UseMount):
        resolve(ns, "private/f", peer_root, [MOUNT])
    with pytest.raises(UseMount):
        resolve(ns, "secret", peer, [MOUNT])


# ---- resolve(): the walk -------------------------------------------------------------------

@pytest.fixture
def ns():
    m = FakeMeta()
    m.dir("pub")
    m.file("pub/f", 0o644, 1000, 1000)
    m.file("pub/secret", 0o600, 1000, 1000)
    m.file("pub/staff", 0o640, 1000, 50)
    m.dir("private", 0o700, 1000, 1000)
    m.file("private/f", 0o644, 1000, 1000)
    m.dir("noread", 0o311, 1000, 1000)   # searchable, not listable/readable
    m.file("noread/f", 0o644, 1000, 1000)
    m.add("pub/fifo", stat.S_IFIFO | 0o644)
    return m


def test_readable_file_resolves(ns):
    assert resolve(ns, "pub/f", BOB, [MOUNT]).ino == ns.entries[(2, b"f")]
    assert resolve(ns, "./pub//f", BOB, [MOUNT]).mode & 0o777 == 0o644
    assert resolve(ns, "noread/f", BOB, [MOUNT])   # x without r on the directory is enough


def test_read_permission_on_the_file(ns):
    assert err(ns, "pub/secret", BOB) == errno.EACCES
    assert resolve(ns, "pub/secret", ALICE, [MOUNT])
    assert resolve(ns, "pub/secret", ROOT, [MOUNT])
    assert err(ns, "pub/staff", BOB) == errno.EACCES
    assert resolve(ns, "pub/staff", BOB_IN_STAFF, [MOUNT])


def test_search_permission_is_checked_before_the_lookup(ns):
    assert err(ns, "private/f", BOB) == errno.EACCES
    assert err(ns, "private/missing", BOB) == errno.EACCES  # not ENOENT: the kernel says EACCES
    assert resolve(ns, "private/f", ALICE, [MOUNT])
    ns.inodes[ROOT_INO].mode = stat.S_IFDIR | 0o700         # the mount root itself counts
    assert err(ns, "pub/f", BOB) == errno.EACCES
    assert resolve(ns, "pub/f", ROOT, [MOUNT])


def test_errors_as_the_kernel_gives_them(ns):
    assert err(ns, "pub/missing", BOB) == errno.ENOENT
    assert err(ns, "pub/f/x", BOB) == errno.ENOTDIR
    assert err(ns, "pub/f/", BOB) == errno.ENOTDIR
    assert err(ns, "pub", BOB) == errno.EISDIR
    assert err(ns, "pub/", BOB) == errno.EISDIR
    assert err(ns, ".", BOB) == errno.EISDIR
    assert err(ns, "noread", BOB) == errno.EACCES  # opening a directory needs r first
    assert err(ns, "pub/" + "x" * 256, BOB) == errno.ENAMETOOLONG


def test_special_files_go_to_the_mount(ns):
    with pytest.raises(UseMount):
        resolve(ns, "pub/fifo", BOB, [MOUNT])


def test_symlinks_inside_the_mount_are_followed(ns):
    ns.link("pub/rel", "f")
    ns.link("pub/up", "../private/f")
    ns.link("abs", MOUNT + "/pub/f")
    ns.link("pub/dirlink", "../pub")
    assert resolve(ns, "pub/rel", BOB, [MOUNT]).ino == ns.entries[(2, b"f")]
    assert resolve(ns, "abs", BOB, [MOUNT]).ino == ns.entries[(2, b"f")]
    assert resolve(ns, "pub/dirlink/dirlink/f", BOB, [MOUNT]).ino == ns.entries[(2, b"f")]
    assert err(ns, "pub/up", BOB) == errno.EACCES    # the target's directories are checked
    assert resolve(ns, "pub/up", ALICE, [MOUNT])
    assert err(ns, "pub/rel/", BOB) == errno.ENOTDIR


def test_paths_leading_out_of_the_mount_go_to_the_mount(ns):
    ns.link("pub/out", "/etc/passwd")
    ns.link("pub/out2", "../../x")
    ns.link("pub/sibling", MOUNT + "x/f")  # a name that only starts like the mount point
    for rel in ("pub/out", "pub/out2", "..", "pub/../../x", "pub/sibling"):
        with pytest.raises(UseMount):
            resolve(ns, rel, BOB, [MOUNT])


def test_symlink_loops_stop_at_forty(ns):
    ns.link("loop", "loop")
    assert err(ns, "loop", BOB) == errno.ELOOP
    for i in range(MAX_LINKS):
        ns.link(f"l{i}", f"l{i + 1}" if i + 1 < MAX_LINKS else "pub/f")
    assert resolve(ns, "l0", BOB, [MOUNT])          # exactly 40 links
    ns.link("l-extra", "l0")
    assert err(ns, "l-extra", BOB) == errno.ELOOP   # 41


def test_protected_symlinks_in_sticky_world_writable_directories(ns):
    ns.dir("tmp", 0o1777)
    ns.link("tmp/alice-link", "../pub/f", uid=1000)
    assert resolve(ns, "tmp/alice-link", ALICE, [MOUNT])   # the follower owns the link
    assert resolve(ns, "tmp/alice-link", BOB, [MOUNT])     # the sysctl is off
    assert err(ns, "tmp/alice-link", BOB, protected_symlinks=True) == errno.EACCES
    ns.link("tmp/root-link", "../pub/f", uid=0)            # the directory's owner's link
    assert resolve(ns, "tmp/root-link", BOB, [MOUNT], protected_symlinks=True)


# ---- a batch's walks shared (resolve(..., dirs=)) ------------------------------------------

def _outcome(meta, rel, creds, dirs=None):
    """What resolve() answers: ("ino", n) or the error it raises."""
    try:
        return ("ino", resolve(meta, rel, creds, [MOUNT], dirs=dirs).ino)
    except FsError as e:
        return ("errno", e.errno)
    except UseMount:
        return ("mount",)


def _random_namespace(rng) -> tuple[FakeMeta, list[str]]:
    """Directories of mixed modes and owners, files, and symlinks to files, to
    directories (relative, absolute, upwards), to nothing and into loops."""
    m = FakeMeta()
    dirs, names = [""], []
    for k in range(60):
        parent = rng.choice(dirs)
        path = f"{parent}/n{k}" if parent else f"n{k}"
        kind = rng.random()
        owner = rng.choice([0, 1000, 1001])
        if kind < 0.3:
            m.dir(path, rng.choice([0o755, 0o700, 0o711, 0o750, 0o311, 0o1777]), owner,
                  rng.choice([0, 50, 1000]))
            dirs.append(path)
        elif kind < 0.75:
            m.file(path, rng.choice([0o644, 0o600, 0o640, 0o000]), owner,
                   rng.choice([0, 50, 1000]))
        else:
            target = rng.choice([rng.choice(dirs + names or ["x"]), "../" * rng.randint(0, 2)
                                 + rng.choice(names or ["x"]), MOUNT + "/" + rng.choice(dirs),
                                 "missing", path.rsplit("/", 1)[-1]])
            m.link(path, target.rstrip("/") or ".", uid=owner)
            dirs.append(path)  # walked through as a directory by the paths below
        names.append(path)
    return m, dirs + names


@pytest.mark.parametrize("seed", range(20))
def test_a_batch_sharing_directory_walks_resolves_as_one_path_at_a_time(seed):
    """The daemon resolves a request's paths with one walk per directory
    (_open_paths); every answer must be the one a walk of the whole path gives,
    errors, symlinks and their count (ELOOP) included."""
    import random
    rng = random.Random(seed)
    meta, known = _random_namespace(rng)
    extras = ["", ".", "..", "missing", "x" * 256]
    paths = []
    for _ in range(400):
        base = rng.choice(known)
        tail = rng.choice(known + extras).rsplit("/", 1)[-1]
        rel = rng.choice([base, f"{base}/{tail}", f"{base}/./{tail}", f"{base}//{tail}",
                          f"{base}/{tail}/", f"{base}/../{tail}", f"./{base}"])
        paths.append(rel)
    for creds in (ROOT, ALICE, BOB, BOB_IN_STAFF, Creds.of(0, 0)):
        dirs: dict = {}
        for rel in paths:
            assert _outcome(meta, rel, creds, dirs) == _outcome(meta, rel, creds), rel
        assert dirs  # the walks were shared


def test_symlinks_of_a_shared_directory_walk_count_towards_forty(ns):
    """A path's links are counted over the whole walk: those followed to reach its
    directory (remembered once for the batch) and those of its last name."""
    for i in range(MAX_LINKS):  # d0 -> d1 -> ... -> d39 -> pub: 40 links to a directory
        ns.link(f"d{i}", f"d{i + 1}" if i + 1 < MAX_LINKS else "pub")
    ns.link("pub/to-f", "f")
    dirs: dict = {}
    for rel, want in (("d0/f", ("ino", ns.entries[(2, b"f")])),  # 40
                      ("d0/to-f", ("errno", errno.ELOOP)),      # 41
                      ("d1/to-f", ("ino", ns.entries[(2, b"f")]))):  # 39 + 1
        assert _outcome(ns, rel, BOB, dirs) == want == _outcome(ns, rel, BOB), rel
