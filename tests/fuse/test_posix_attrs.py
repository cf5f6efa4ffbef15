"""POSIX attributes through the mount: chmod/chown/utime, ctime updates,
permission checks as a non-root user, sticky and setgid directories, xattrs."""
from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import time

import pytest

from tests.harness import read_file as read, write_file as write
from tests.fuse.test_posix_common import (as_user, assert_errno, clock_past, d,  # noqa: F401
                                          shared_mnt)

NOBODY = 65534
OTHER = 65533


# ---- chmod / chown / utime ----------------------------------------------------------
def test_chmod_chown(d):
    p = os.path.join(d, "f")
    write(p, b"x")
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (0, 0)
    os.chmod(p, 0o4751)
    assert os.stat(p).st_mode == stat.S_IFREG | 0o4751
    os.chmod(p, 0o600)
    assert os.stat(p).st_mode == stat.S_IFREG | 0o600
    os.chown(p, 1234, 5678)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.chown(p, -1, 42)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1234, 42)
    sub = os.path.join(d, "sub")
    os.mkdir(sub)
    os.chmod(sub, 0o1770)
    os.chown(sub, 7, 8)
    st = os.stat(sub)
    assert st.st_mode == stat.S_IFDIR | 0o1770 and (st.st_uid, st.st_gid) == (7, 8)
    link = os.path.join(d, "link")
    os.symlink("f", link)
    os.lchown(link, 99, 98)
    assert (os.lstat(link).st_uid, os.lstat(link).st_gid) == (99, 98)
    assert os.stat(p).st_uid == 1234


def test_chown_clears_setuid(d):
    p = os.path.join(d, "f")
    write(p, b"x")
    os.chmod(p, 0o6755)
    os.chown(p, 1000, 1000)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o0755


def test_utime_explicit_and_now(d):
    for p in (os.path.join(d, "f"), os.path.join(d, "sub")):
        if p.endswith("f"):
            write(p, b"x")
        else:
            os.mkdir(p)
        os.utime(p, ns=(1_000_000_123, 2_000_000_456))
        st = os.stat(p)
        assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_123, 2_000_000_456)
        before = time.time_ns()
        os.utime(p)  # UTIME_NOW for both
        after = time.time_ns()
        st = os.stat(p)
        # The kernel's clock may run one tick behind time.time_ns(); allow a second.
        for t in (st.st_atime_ns, st.st_mtime_ns):
            assert before - 1_000_000_000 <= t <= after, (p, t, before, after)
        assert st.st_ctime_ns >= st.st_mtime_ns - 1_000_000_000


def test_utime_persists_exact_nanoseconds_via_fd(d):
    p = os.path.join(d, "f")
    write(p, b"x")
    fd = os.open(p, os.O_RDONLY)
    try:
        os.utime(fd, ns=(1_234_567_891_234_567_891, 1_111_111_111_111_111_111))
        st = os.fstat(fd)
    finally:
        os.close(fd)
    assert st.st_atime_ns == 1_234_567_891_234_567_891
    assert st.st_mtime_ns == 1_111_111_111_111_111_111


def test_utimensat_omit_and_now(d):
    import ctypes

    class Timespec(ctypes.Structure):
        _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]
    UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2
    libc = ctypes.CDLL(None, use_errno=True)

    def utimensat(path, atime, mtime):
        ts = (Timespec * 2)(Timespec(*atime), Timespec(*mtime))
        if libc.utimensat(-100, os.fsencode(path), ts, 0) != 0:
            raise OSError(ctypes.get_errno(), "utimensat", path)

    f = os.path.join(d, "f")
    write(f, b"")
    for p in (f, d):
        os.utime(p, ns=(5 * 10**9, 7 * 10**9))
        utimensat(p, (0, UTIME_OMIT), (9, 11))
        st = os.stat(p)
        assert (st.st_atime_ns, st.st_mtime_ns) == (5 * 10**9, 9 * 10**9 + 11)
        utimensat(p, (3, 4), (0, UTIME_OMIT))
        st = os.stat(p)
        assert (st.st_atime_ns, st.st_mtime_ns) == (3 * 10**9 + 4, 9 * 10**9 + 11)
        before = time.time_ns() - 1_000_000_000  # the kernel's clock may lag a tick
        utimensat(p, (0, UTIME_OMIT), (0, UTIME_NOW))
        st = os.stat(p)
        assert st.st_atime_ns == 3 * 10**9 + 4 and st.st_mtime_ns > before
        utimensat(p, (0, UTIME_NOW), (0, UTIME_OMIT))
        st2 = os.stat(p)
        assert st2.st_atime_ns > before and st2.st_mtime_ns == st.st_mtime_ns


def _ctime_after(p: str, change, new_path: str | None = None) -> None:
    before = os.lstat(p).st_ctime_ns
    clock_past(before)
    change()
    after = os.lstat(new_path or p).st_ctime_ns
    assert after > before, (change, before, after)


def test_ctime_updates(d):
    p = os.path.join(d, "f")
    write(p, b"data")
    _ctime_after(p, lambda: os.chmod(p, 0o640))
    _ctime_after(p, lambda: os.chown(p, 10, 10))
    _ctime_after(p, lambda: os.link(p, os.path.join(d, "hard")))
    _ctime_after(p, lambda: os.unlink(os.path.join(d, "hard")))
    _ctime_after(p, lambda: os.rename(p, os.path.join(d, "g")), os.path.join(d, "g"))
    p = os.path.join(d, "g")
    sub = os.path.join(d, "sub")
    os.mkdir(sub)
    _ctime_after(p, lambda: os.rename(p, os.path.join(sub, "h")), os.path.join(sub, "h"))
    p = os.path.join(sub, "h")
    _ctime_after(p, lambda: os.truncate(p, 2))
    _ctime_after(p, lambda: write(p, b"rewritten"))

    def append():
        with open(p, "ab") as f:
            f.write(b"more")
    _ctime_after(p, append)
    _ctime_after(p, lambda: os.setxattr(p, "user.k", b"v"))
    _ctime_after(p, lambda: os.utime(p, ns=(1, 1)))
    # A directory's ctime and mtime follow changes of its entries.
    before = os.stat(d)
    clock_past(max(before.st_ctime_ns, before.st_mtime_ns))
    write(os.path.join(d, "new"), b"")
    after = os.stat(d)
    assert after.st_mtime_ns > before.st_mtime_ns and after.st_ctime_ns > before.st_ctime_ns


def test_write_updates_mtime(d):
    p = os.path.join(d, "f")
    write(p, b"data")
    os.utime(p, ns=(10**18, 10**18))
    before = time.time_ns()
    fd = os.open(p, os.O_WRONLY)
    try:
        os.pwrite(fd, b"x", 2)
    finally:
        os.close(fd)
    after = time.time_ns()
    # The write's time, not just any other: the kernel's clock may lag a tick.
    assert before - 1_000_000_000 <= os.stat(p).st_mtime_ns <= after


# ---- permissions -------------------------------------------------------------------
def test_permissions_as_non_root(d):
    os.chmod(d, 0o755)
    f = os.path.join(d, "rootfile")
    write(f, b"root's")
    os.chmod(f, 0o644)
    secret = os.path.join(d, "secret")
    write(secret, b"no")
    os.chmod(secret, 0o600)
    closed = os.path.join(d, "closed")
    os.mkdir(closed, 0o700)
    write(os.path.join(closed, "inner"), b"")
    mine = os.path.join(d, "mine")
    os.mkdir(mine)
    os.chown(mine, NOBODY, NOBODY)
    res = as_user(NOBODY, NOBODY, d, {
        "read": lambda: read("rootfile").decode(),
        "write": lambda: os.open("rootfile", os.O_WRONLY),
        "truncate": lambda: os.truncate("rootfile", 0),
        "read_secret": lambda: os.open("secret", os.O_RDONLY),
        "chmod": lambda: os.chmod("rootfile", 0o666),
        "chown": lambda: os.chown("mine", 0, 0),
        "utime": lambda: os.utime("rootfile", ns=(1, 1)),
        "utime_now": lambda: os.utime("rootfile"),
        "create": lambda: os.open("new", os.O_CREAT | os.O_WRONLY, 0o644),
        "mkdir": lambda: os.mkdir("newdir"),
        "unlink": lambda: os.unlink("rootfile"),
        "rename": lambda: os.rename("rootfile", "mine/stolen"),
        "list_closed": lambda: os.listdir("closed"),
        "stat_in_closed": lambda: os.stat("closed/inner"),
        "create_in_own": lambda: os.close(os.open("mine/f", os.O_CREAT | os.O_WRONLY, 0o600)),
        "chmod_own": lambda: os.chmod("mine/f", 0o640),
        "setxattr_root": lambda: os.setxattr("rootfile", "user.x", b"1"),
        "own_uid": lambda: os.stat("mine/f").st_uid,
        "own_gid": lambda: os.stat("mine/f").st_gid,
    })
    assert res == {
        "read": "root's", "write": errno.EACCES, "truncate": errno.EACCES,
        "read_secret": errno.EACCES, "chmod": errno.EPERM, "chown": errno.EPERM,
        "utime": errno.EPERM, "utime_now": errno.EACCES, "create": errno.EACCES,
        "mkdir": errno.EACCES, "unlink": errno.EACCES, "rename": errno.EACCES,
        "list_closed": errno.EACCES, "stat_in_closed": errno.EACCES,
        "create_in_own": 0, "chmod_own": 0, "setxattr_root": errno.EACCES,
        "own_uid": NOBODY, "own_gid": NOBODY,
    }
    assert read(f) == b"root's" and stat.S_IMODE(os.stat(f).st_mode) == 0o644
    assert sorted(os.listdir(d)) == ["closed", "mine", "rootfile", "secret"]
    assert stat.S_IMODE(os.stat(os.path.join(mine, "f")).st_mode) == 0o640


def test_sticky_directory(d):
    os.chmod(d, 0o755)
    sticky, open_dir = os.path.join(d, "sticky"), os.path.join(d, "open")
    os.mkdir(sticky)
    os.mkdir(open_dir)
    os.chmod(sticky, 0o1777)
    os.chmod(open_dir, 0o777)
    write(os.path.join(sticky, "rootfile"), b"")
    os.chmod(os.path.join(sticky, "rootfile"), 0o666)

    def make(name):
        def create():
            fd = os.open(name, os.O_CREAT | os.O_WRONLY, 0o666)
            os.fchmod(fd, 0o666)  # whatever the umask
            os.close(fd)
        return create
    assert as_user(NOBODY, NOBODY, d, {
        "a": make("sticky/a"), "a2": make("sticky/a2"), "o": make("open/o")}) == \
        {"a": 0, "a2": 0, "o": 0}
    res = as_user(OTHER, OTHER, d, {
        "b": make("sticky/b"),
        "unlink_a": lambda: os.unlink("sticky/a"),
        "rename_a": lambda: os.rename("sticky/a", "sticky/c"),
        "rename_over_a": lambda: os.rename("sticky/b", "sticky/a"),
        "unlink_root": lambda: os.unlink("sticky/rootfile"),
        "write_a": lambda: os.close(os.open("sticky/a", os.O_WRONLY)),
        "unlink_own": lambda: os.unlink("sticky/b"),
        "unlink_in_open_dir": lambda: os.unlink("open/o"),
    })
    assert res == {"b": 0, "unlink_a": errno.EPERM, "rename_a": errno.EPERM,
                   "rename_over_a": errno.EPERM, "unlink_root": errno.EPERM,
                   "write_a": 0, "unlink_own": 0, "unlink_in_open_dir": 0}
    assert as_user(NOBODY, NOBODY, d, {"unlink_a": lambda: os.unlink("sticky/a")}) == \
        {"unlink_a": 0}
    assert sorted(os.listdir(sticky)) == ["a2", "rootfile"]
    assert os.listdir(open_dir) == []
    os.unlink(os.path.join(sticky, "a2"))  # root may delete anything
    assert os.listdir(sticky) == ["rootfile"]


def test_setgid_directory_inheritance(d):
    g = os.path.join(d, "g")
    os.mkdir(g)
    os.chown(g, 0, 4242)
    os.chmod(g, 0o2775)
    write(os.path.join(g, "f"), b"")
    os.mkdir(os.path.join(g, "sub"))
    os.mkfifo(os.path.join(g, "fifo"))
    os.symlink("f", os.path.join(g, "link"))
    assert os.stat(os.path.join(g, "f")).st_gid == 4242
    assert not os.stat(os.path.join(g, "f")).st_mode & stat.S_ISGID
    assert os.lstat(os.path.join(g, "fifo")).st_gid == 4242
    assert os.lstat(os.path.join(g, "link")).st_gid == 4242
    sub = os.stat(os.path.join(g, "sub"))
    assert sub.st_gid == 4242 and sub.st_mode & stat.S_ISGID
    os.mkdir(os.path.join(g, "sub", "deeper"))
    deeper = os.stat(os.path.join(g, "sub", "deeper"))
    assert deeper.st_gid == 4242 and deeper.st_mode & stat.S_ISGID
    # Another user creating there also gets the directory's group.
    os.chmod(g, 0o2777)
    res = as_user(NOBODY, NOBODY, g, {
        "create": lambda: os.close(os.open("nobody", os.O_CREAT | os.O_WRONLY, 0o644)),
        "gid": lambda: os.stat("nobody").st_gid})
    assert res == {"create": 0, "gid": 4242}
    # Without the setgid bit: the creator's group.
    plain = os.path.join(d, "plain")
    os.mkdir(plain)
    os.chown(plain, 0, 4242)
    write(os.path.join(plain, "f"), b"")
    assert os.stat(os.path.join(plain, "f")).st_gid == 0
    os.mkdir(os.path.join(plain, "sub"))
    assert not os.stat(os.path.join(plain, "sub")).st_mode & stat.S_ISGID


def test_o_trunc_updates_times_even_when_empty(d):
    # POSIX: open(O_TRUNC) of an existing file marks mtime and ctime for update.
    for name, content in (("empty", b""), ("full", b"data")):
        p = os.path.join(d, name)
        write(p, content)
        os.utime(p, ns=(10**9, 10**9))
        before = os.stat(p)
        clock_past(before.st_ctime_ns)
        os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
        after = os.stat(p)
        assert after.st_size == 0
        assert after.st_mtime_ns > 10**9, name
        assert after.st_ctime_ns > before.st_ctime_ns, name


def test_truncate_by_non_owner_clears_setuid(d):
    def ftrunc():
        fd = os.open("f", os.O_WRONLY)
        try:
            os.ftruncate(fd, 1)
        finally:
            os.close(fd)
    ops = {"truncate": lambda: os.truncate("f", 2), "ftruncate": ftrunc,
           "o_trunc": lambda: os.close(os.open("f", os.O_WRONLY | os.O_TRUNC))}
    p = os.path.join(d, "f")
    for name, op in ops.items():
        write(p, b"hello")
        os.chmod(p, 0o6777)
        assert as_user(NOBODY, NOBODY, d, {name: op}) == {name: 0}
        st = os.stat(p)
        assert st.st_size < 5, name
        assert stat.S_IMODE(st.st_mode) == 0o777, (name, oct(st.st_mode))


def test_write_by_non_owner_clears_setuid(d):
    p = os.path.join(d, "f")
    write(p, b"hello")
    os.chmod(p, 0o6777)
    res = as_user(NOBODY, NOBODY, d, {
        "write": lambda: (lambda fd: (os.write(fd, b"x"), os.close(fd)))(os.open("f", os.O_WRONLY))
        and None})
    assert res == {"write": 0}
    assert not os.stat(p).st_mode & stat.S_ISUID


# ---- xattrs --------------------------------------------------------------------------
def test_user_xattrs(d):
    p = os.path.join(d, "f")
    write(p, b"")
    assert os.listxattr(p) == []
    assert_errno(errno.ENODATA, os.getxattr, p, "user.missing")
    os.setxattr(p, "user.one", b"1")
    os.setxattr(p, "user.two", b"\x00binary\xff")
    os.setxattr(p, "user.empty", b"")
    big = bytes(range(256)) * 200  # 51200 bytes
    os.setxattr(p, "user.big", big)
    assert os.getxattr(p, "user.one") == b"1"
    assert os.getxattr(p, "user.two") == b"\x00binary\xff"
    assert os.getxattr(p, "user.empty") == b""
    assert os.getxattr(p, "user.big") == big
    assert sorted(os.listxattr(p)) == ["user.big", "user.empty", "user.one", "user.two"]
    assert_errno(errno.EEXIST, os.setxattr, p, "user.one", b"x", os.XATTR_CREATE)
    assert_errno(errno.ENODATA, os.setxattr, p, "user.none", b"x", os.XATTR_REPLACE)
    assert "user.none" not in os.listxattr(p)
    os.setxattr(p, "user.one", b"replaced", os.XATTR_REPLACE)
    os.setxattr(p, "user.three", b"3", os.XATTR_CREATE)
    assert os.getxattr(p, "user.one") == b"replaced"
    assert os.getxattr(p, "user.three") == b"3"
    os.setxattr(p, "user.one", b"plain overwrite")
    assert os.getxattr(p, "user.one") == b"plain overwrite"
    os.removexattr(p, "user.one")
    assert_errno(errno.ENODATA, os.getxattr, p, "user.one")
    assert_errno(errno.ENODATA, os.removexattr, p, "user.one")
    assert sorted(os.listxattr(p)) == ["user.big", "user.empty", "user.three", "user.two"]
    # Directories carry xattrs too; names are per inode.
    os.setxattr(d, "user.dir", b"on the dir")
    assert os.listxattr(d) == ["user.dir"]
    assert "user.dir" not in os.listxattr(p)
    # Hard links share them.
    os.link(p, os.path.join(d, "g"))
    assert os.getxattr(os.path.join(d, "g"), "user.three") == b"3"
    # The kernel refuses user.* on symlinks.
    os.symlink("f", os.path.join(d, "l"))
    assert_errno(errno.EPERM, os.setxattr, os.path.join(d, "l"), "user.x", b"1",
                 follow_symlinks=False)


def test_acl_and_security_label_xattrs_are_not_supported(d):
    """Neither is enforced (access follows the mode bits), so they cannot be set and
    are not there: EOPNOTSUPP, which tools take as "no ACLs, no labels here"."""
    p = os.path.join(d, "f")
    write(p, b"")
    for name in ("system.posix_acl_access", "system.posix_acl_default", "security.selinux"):
        assert_errno(errno.EOPNOTSUPP, os.getxattr, p, name)
    for name in ("system.posix_acl_access", "security.selinux"):
        assert_errno(errno.EOPNOTSUPP, os.setxattr, p, name, b"\x02\x00\x00\x00")
        assert_errno(errno.EOPNOTSUPP, os.removexattr, p, name)
    assert_errno(errno.ENODATA, os.getxattr, p, "security.capability")
    os.setxattr(p, "user.kept", b"1")
    assert os.listxattr(p) == ["user.kept"]


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_ls_l_asks_for_acls_and_labels_once_not_per_entry(d):
    for i in range(20):
        write(os.path.join(d, f"f{i}"), b"")
    res = subprocess.run(["strace", "-f", "-e", "trace=getxattr,lgetxattr", "ls", "-l", d],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("\n") == 21  # "total" and 20 entries
    calls = [line for line in res.stderr.splitlines() if "getxattr(" in line]
    assert calls and len(calls) <= 4, "\n".join(calls)


def test_xattr_gone_with_file(d):
    p = os.path.join(d, "f")
    write(p, b"")
    os.setxattr(p, "user.k", b"v")
    os.unlink(p)
    write(p, b"")
    assert os.listxattr(p) == []
    assert_errno(errno.ENODATA, os.getxattr, p, "user.k")
