"""POSIX namespace behaviour through the mount: directories, symlinks, hard
links, rename (all flavours), special files, name lengths and errnos."""
from __future__ import annotations

import errno
import os
import socket
import stat

from tests.harness import read_file as read, write_file as write
from tests.fuse.test_posix_common import (RENAME_EXCHANGE, RENAME_NOREPLACE,  # noqa: F401
                                          assert_errno, d, eventually, hot_files,
                                          meta_has_inode, raw_dirents, read_uncached,
                                          renameat2, shared_mnt)


def dotdot(path: str) -> int:
    """d_ino of '..' as the daemon lists it (not the kernel's dcache)."""
    return dict(raw_dirents(path))[b".."]


# ---- directories -------------------------------------------------------------------
def test_directories_basic(d):
    a = os.path.join(d, "a")
    os.mkdir(a, 0o750)
    st = os.stat(a)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o750
    os.makedirs(os.path.join(a, "b", "c"))
    write(os.path.join(a, "b", "c", "f"), b"deep")
    assert read(os.path.join(d, "a", "b", "c", "f")) == b"deep"
    assert sorted(os.listdir(a)) == ["b"]
    assert_errno(errno.EEXIST, os.mkdir, a)
    assert_errno(errno.ENOTEMPTY, os.rmdir, a)
    os.unlink(os.path.join(a, "b", "c", "f"))
    os.rmdir(os.path.join(a, "b", "c"))
    os.rmdir(os.path.join(a, "b"))
    os.rmdir(a)
    assert os.listdir(d) == []
    assert_errno(errno.ENOENT, os.rmdir, a)


def test_dir_nlink_counts_subdirs(d):
    assert os.stat(d).st_nlink == 2
    for i in range(3):
        os.mkdir(os.path.join(d, f"sub{i}"))
    write(os.path.join(d, "file"), b"")
    os.symlink("sub0", os.path.join(d, "link"))
    assert os.stat(d).st_nlink == 5
    os.rmdir(os.path.join(d, "sub2"))
    assert os.stat(d).st_nlink == 4
    other = os.path.join(d, "sub0")
    os.rename(os.path.join(d, "sub1"), os.path.join(other, "moved"))
    assert os.stat(d).st_nlink == 3
    assert os.stat(other).st_nlink == 3
    assert os.stat(os.path.join(other, "moved")).st_nlink == 2


def test_dot_and_dotdot(d):
    sub = os.path.join(d, "sub")
    os.mkdir(sub)
    ents = dict(raw_dirents(sub))
    assert set(ents) == {b".", b".."}
    assert ents[b"."] == os.stat(sub).st_ino
    assert ents[b".."] == os.stat(d).st_ino
    assert os.stat(os.path.join(sub, ".")).st_ino == os.stat(sub).st_ino
    assert os.stat(os.path.join(sub, "..")).st_ino == os.stat(d).st_ino
    assert "." not in os.listdir(sub) and ".." not in os.listdir(sub)
    assert_errno(errno.EEXIST, os.mkdir, os.path.join(sub, "."))
    assert_errno(errno.EEXIST, os.mkdir, os.path.join(sub, ".."))
    assert_errno(errno.EINVAL, os.rmdir, os.path.join(sub, "."))
    assert_errno(errno.ENOTEMPTY, os.rmdir, os.path.join(sub, ".."))
    assert_errno(errno.EISDIR, os.unlink, os.path.join(sub, ".."))
    assert_errno(errno.EBUSY, os.rename, os.path.join(sub, "."), os.path.join(d, "x"))
    write(os.path.join(sub, "f"), b"")
    names = [n for n, _ in raw_dirents(sub)]
    assert sorted(names) == [b".", b"..", b"f"]


# ---- symlinks ----------------------------------------------------------------------
def test_symlinks(d):
    target = os.path.join(d, "target")
    write(target, b"through the link")
    rel, absl = os.path.join(d, "rel"), os.path.join(d, "abs")
    os.symlink("target", rel)
    os.symlink(target, absl)
    for link, text in ((rel, "target"), (absl, target)):
        assert os.readlink(link) == text
        lst = os.lstat(link)
        assert stat.S_ISLNK(lst.st_mode) and lst.st_size == len(os.fsencode(text))
        assert stat.S_ISREG(os.stat(link).st_mode)
        assert read(link) == b"through the link"
    assert os.stat(rel).st_ino == os.stat(target).st_ino
    long_target = "x/" * 2000 + "y"
    os.symlink(long_target, os.path.join(d, "long"))
    assert os.readlink(os.path.join(d, "long")) == long_target
    assert_errno(errno.EINVAL, os.readlink, target)
    assert_errno(errno.EEXIST, os.symlink, "x", rel)


def test_dangling_symlink(d):
    link = os.path.join(d, "dangling")
    os.symlink("missing", link)
    assert os.readlink(link) == "missing"
    assert stat.S_ISLNK(os.lstat(link).st_mode)
    assert_errno(errno.ENOENT, os.stat, link)
    assert not os.path.exists(link) and os.path.lexists(link)
    # Creating through a dangling symlink creates its target.
    write(link, b"now it exists")
    assert read(os.path.join(d, "missing")) == b"now it exists"
    os.unlink(link)
    assert os.path.exists(os.path.join(d, "missing"))


def test_symlink_loop(d):
    os.symlink("b", os.path.join(d, "a"))
    os.symlink("a", os.path.join(d, "b"))
    assert_errno(errno.ELOOP, os.stat, os.path.join(d, "a"))
    assert_errno(errno.ELOOP, os.open, os.path.join(d, "a"), os.O_RDONLY)


# ---- hard links --------------------------------------------------------------------
def test_hard_links(d):
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    write(a, b"linked data")
    os.link(a, b)
    sa, sb = os.stat(a), os.stat(b)
    assert sa.st_ino == sb.st_ino
    assert sa.st_nlink == sb.st_nlink == 2
    sub = os.path.join(d, "sub")
    os.mkdir(sub)
    c = os.path.join(sub, "c")
    os.link(b, c)
    assert os.stat(a).st_nlink == 3
    with open(c, "r+b") as f:
        f.write(b"LINKED")
    assert read(a) == b"LINKED data"
    os.unlink(a)
    assert os.stat(b).st_nlink == 2
    os.unlink(c)
    assert os.stat(b).st_nlink == 1
    assert read_uncached(b) == b"LINKED data"
    assert_errno(errno.EEXIST, os.link, b, b)
    assert_errno(errno.EPERM, os.link, sub, os.path.join(d, "dirlink"))
    assert_errno(errno.ENOENT, os.link, a, os.path.join(d, "x"))
    assert sorted(os.listdir(d)) == ["b", "sub"]


# ---- rename --------------------------------------------------------------------------
def test_rename_over_existing_file(shared_mnt, d):
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    write(a, b"AAA")
    write(b, b"BBBBB")
    ino_a, ino_b = os.stat(a).st_ino, os.stat(b).st_ino
    os.rename(a, b)
    assert not os.path.lexists(a)
    assert os.stat(b).st_ino == ino_a and read(b) == b"AAA"
    assert os.listdir(d) == ["b"]
    assert_errno(errno.ENOENT, os.rename, a, b)
    # The replaced file is gone for good once the kernel forgets it.
    eventually(lambda: not meta_has_inode(shared_mnt, ino_b), what="replaced inode purged")
    eventually(lambda: not hot_files(shared_mnt, ino_b), what="hot files removed")


def test_unlink_frees_inode_and_hot_files(shared_mnt, d):
    p = os.path.join(d, "f")
    write(p, b"x" * 100_000)
    os.setxattr(p, "user.k", b"v")
    ino = os.stat(p).st_ino
    assert hot_files(shared_mnt, ino)
    os.unlink(p)
    eventually(lambda: not meta_has_inode(shared_mnt, ino), what="inode purged")
    eventually(lambda: not hot_files(shared_mnt, ino), what="hot files removed")


def test_rename_over_hard_link_of_itself_is_noop(d):
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    write(a, b"x")
    os.link(a, b)
    os.rename(a, b)
    assert sorted(os.listdir(d)) == ["a", "b"]
    assert os.stat(a).st_nlink == 2


def test_rename_dir_over_empty_dir(d):
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    os.mkdir(a)
    os.mkdir(b)
    write(os.path.join(a, "f"), b"in a")
    assert os.stat(d).st_nlink == 4
    os.rename(a, b)
    assert os.listdir(d) == ["b"]
    assert read(os.path.join(b, "f")) == b"in a"
    assert os.stat(d).st_nlink == 3


def test_rename_errors(d):
    f, g = os.path.join(d, "f"), os.path.join(d, "g")
    full, empty = os.path.join(d, "full"), os.path.join(d, "empty")
    write(f, b"f")
    write(g, b"g")
    os.mkdir(full)
    os.mkdir(empty)
    write(os.path.join(full, "x"), b"")
    assert_errno(errno.ENOTEMPTY, os.rename, empty, full)
    assert_errno(errno.ENOTDIR, os.rename, empty, f)
    assert_errno(errno.EISDIR, os.rename, f, empty)
    assert_errno(errno.EISDIR, os.rename, f, full)
    assert_errno(errno.EINVAL, os.rename, full, os.path.join(full, "inside"))
    os.makedirs(os.path.join(full, "a", "b"))
    assert_errno(errno.EINVAL, os.rename, full, os.path.join(full, "a", "b", "c"))
    assert_errno(errno.ENOENT, os.rename, os.path.join(d, "nope"), os.path.join(d, "x"))
    assert_errno(errno.ENOENT, os.rename, f, os.path.join(d, "nodir", "x"))
    assert_errno(errno.ENOTDIR, os.rename, f, os.path.join(g, "x"))
    # Nothing moved.
    assert sorted(os.listdir(d)) == ["empty", "f", "full", "g"]
    assert read(f) == b"f" and read(g) == b"g"
    assert os.stat(d).st_nlink == 4


def test_rename_file_across_directories(d):
    src, dst = os.path.join(d, "src"), os.path.join(d, "dst")
    os.mkdir(src)
    os.mkdir(dst)
    write(os.path.join(src, "f"), b"moving")
    ino = os.stat(os.path.join(src, "f")).st_ino
    os.rename(os.path.join(src, "f"), os.path.join(dst, "g"))
    assert os.listdir(src) == [] and os.listdir(dst) == ["g"]
    assert os.stat(os.path.join(dst, "g")).st_ino == ino
    assert read(os.path.join(dst, "g")) == b"moving"
    assert os.stat(src).st_nlink == 2 and os.stat(dst).st_nlink == 2


def test_rename_dir_across_directories(d):
    src, dst = os.path.join(d, "src"), os.path.join(d, "dst")
    os.mkdir(src)
    os.mkdir(dst)
    moving = os.path.join(src, "m")
    os.mkdir(moving)
    os.mkdir(os.path.join(moving, "child"))
    write(os.path.join(moving, "child", "f"), b"payload")
    assert dotdot(moving) == os.stat(src).st_ino
    assert (os.stat(src).st_nlink, os.stat(dst).st_nlink) == (3, 2)
    os.rename(moving, os.path.join(dst, "n"))
    moved = os.path.join(dst, "n")
    assert (os.stat(src).st_nlink, os.stat(dst).st_nlink) == (2, 3)
    assert os.stat(moved).st_nlink == 3
    assert dotdot(moved) == os.stat(dst).st_ino
    assert os.stat(os.path.join(moved, "..")).st_ino == os.stat(dst).st_ino
    assert dotdot(os.path.join(moved, "child")) == os.stat(moved).st_ino
    assert read(os.path.join(moved, "child", "f")) == b"payload"
    # Moving it up to the test dir: '..' follows again.
    os.rename(moved, os.path.join(d, "top"))
    assert dotdot(os.path.join(d, "top")) == os.stat(d).st_ino
    assert os.stat(d).st_nlink == 5


def test_rename_noreplace(d):
    a, b, c = (os.path.join(d, n) for n in "abc")
    write(a, b"a")
    write(b, b"b")
    assert_errno(errno.EEXIST, renameat2, a, b, RENAME_NOREPLACE)
    assert read(a) == b"a" and read(b) == b"b"
    renameat2(a, c, RENAME_NOREPLACE)
    assert sorted(os.listdir(d)) == ["b", "c"]
    assert read(c) == b"a"


def test_rename_exchange_files(d):
    a, b = os.path.join(d, "a"), os.path.join(d, "b")
    write(a, b"content of a")
    write(b, b"content of b, longer")
    ia, ib = os.stat(a).st_ino, os.stat(b).st_ino
    renameat2(a, b, RENAME_EXCHANGE)
    assert read(a) == b"content of b, longer" and read(b) == b"content of a"
    assert os.stat(a).st_ino == ib and os.stat(b).st_ino == ia
    assert sorted(os.listdir(d)) == ["a", "b"]
    assert_errno(errno.ENOENT, renameat2, a, os.path.join(d, "missing"), RENAME_EXCHANGE)
    assert_errno(errno.EINVAL, renameat2, a, b, RENAME_EXCHANGE | RENAME_NOREPLACE)


def test_rename_exchange_file_and_dir_across_directories(d):
    x, y = os.path.join(d, "x"), os.path.join(d, "y")
    os.mkdir(x)
    os.mkdir(y)
    f = os.path.join(x, "f")
    sub = os.path.join(y, "sub")
    write(f, b"a file")
    os.mkdir(sub)
    write(os.path.join(sub, "inner"), b"inner")
    assert (os.stat(x).st_nlink, os.stat(y).st_nlink) == (2, 3)
    renameat2(f, sub, RENAME_EXCHANGE)
    assert stat.S_ISDIR(os.stat(f).st_mode) and stat.S_ISREG(os.stat(sub).st_mode)
    assert read(sub) == b"a file"
    assert read(os.path.join(f, "inner")) == b"inner"
    assert (os.stat(x).st_nlink, os.stat(y).st_nlink) == (3, 2)
    assert dotdot(f) == os.stat(x).st_ino
    assert sorted(n for n, _ in raw_dirents(x)) == [b".", b"..", b"f"]
    assert sorted(n for n, _ in raw_dirents(y)) == [b".", b"..", b"sub"]
    # A directory cannot be exchanged into its own subtree.
    os.mkdir(os.path.join(f, "deeper"))
    assert_errno(errno.EINVAL, renameat2, f, os.path.join(f, "deeper"), RENAME_EXCHANGE)


# ---- special files -------------------------------------------------------------------
def test_fifo(d):
    p = os.path.join(d, "fifo")
    os.mkfifo(p, 0o640)
    st = os.lstat(p)
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
    r = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    w = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(w, b"through the pipe")
        assert os.read(r, 100) == b"through the pipe"
    finally:
        os.close(w)
        os.close(r)
    assert_errno(errno.EEXIST, os.mkfifo, p)
    os.unlink(p)
    assert os.listdir(d) == []


def test_unix_socket(d):
    p = os.path.join(d, "sock")
    # sun_path holds 108 bytes: bind and connect by a relative name from d.
    cwd = os.getcwd()
    os.chdir(d)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind("sock")
        server.listen(1)
        assert stat.S_ISSOCK(os.lstat(p).st_mode)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with client:
            client.connect("sock")
            conn, _ = server.accept()
            with conn:
                client.sendall(b"ping")
                assert conn.recv(10) == b"ping"
        second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with second:
            assert_errno(errno.EADDRINUSE, second.bind, "sock")
    finally:
        server.close()
        os.chdir(cwd)
    os.unlink(p)
    assert os.listdir(d) == []


def test_mknod_char_device_keeps_rdev(d):
    p = os.path.join(d, "null")
    os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    st = os.lstat(p)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    # The mount is nodev: the node exists but cannot be used as a device.
    assert_errno(errno.EACCES, os.open, p, os.O_RDONLY)


def test_names_are_arbitrary_bytes(d):
    root = os.fsencode(d)
    odd = [b"\xff\x01", b"caf\xc3\xa9", b"new\nline", b" ", b"...", b"-x", b"a\tb"]
    for name in odd:
        with open(os.path.join(root, name), "wb") as f:
            f.write(name)
    assert sorted(os.listdir(root)) == sorted(odd)
    for name in odd:
        with open(os.path.join(root, name), "rb") as f:
            assert f.read() == name


def test_mknod_regular_file(d):
    p = os.path.join(d, "n")
    os.mknod(p, stat.S_IFREG | 0o600)
    st = os.stat(p)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 0


# ---- names and errnos --------------------------------------------------------------
def test_name_length_limits(d):
    ok, bad = "n" * 255, "n" * 256
    write(os.path.join(d, ok), b"ok")
    os.mkdir(os.path.join(d, "d" * 255))
    os.symlink("t", os.path.join(d, "s" * 255))
    assert sorted(len(n) for n in os.listdir(d)) == [255, 255, 255]
    assert read(os.path.join(d, ok)) == b"ok"
    p = os.path.join(d, bad)
    assert_errno(errno.ENAMETOOLONG, os.open, p, os.O_CREAT | os.O_WRONLY, 0o644)
    assert_errno(errno.ENAMETOOLONG, os.mkdir, p)
    assert_errno(errno.ENAMETOOLONG, os.rename, os.path.join(d, ok), p)
    assert_errno(errno.ENAMETOOLONG, os.symlink, "t", p)
    assert_errno(errno.ENAMETOOLONG, os.link, os.path.join(d, ok), p)
    assert_errno(errno.ENAMETOOLONG, os.mknod, p)
    assert_errno(errno.ENAMETOOLONG, os.stat, p)
    assert_errno(errno.ENAMETOOLONG, os.lstat, p)
    assert_errno(errno.ENAMETOOLONG, os.unlink, p)
    assert sorted(len(n) for n in os.listdir(d)) == [255, 255, 255]
    os.rename(os.path.join(d, ok), os.path.join(d, "r" * 255))
    assert read(os.path.join(d, "r" * 255)) == b"ok"


def test_errnos(d):
    f = os.path.join(d, "file")
    write(f, b"x")
    sub = os.path.join(d, "sub")
    os.mkdir(sub)
    assert_errno(errno.ENOENT, os.stat, os.path.join(d, "missing"))
    assert_errno(errno.ENOENT, os.open, os.path.join(d, "missing"), os.O_RDONLY)
    assert_errno(errno.ENOENT, os.open, os.path.join(d, "no", "such"), os.O_CREAT | os.O_WRONLY)
    assert_errno(errno.ENOENT, os.unlink, os.path.join(d, "missing"))
    assert_errno(errno.ENOTDIR, os.stat, os.path.join(f, "x"))
    assert_errno(errno.ENOTDIR, os.open, os.path.join(f, "x"), os.O_CREAT | os.O_WRONLY)
    assert_errno(errno.ENOTDIR, os.mkdir, os.path.join(f, "x"))
    assert_errno(errno.ENOTDIR, os.listdir, f)
    assert_errno(errno.ENOTDIR, os.rmdir, f)
    assert_errno(errno.EISDIR, os.open, sub, os.O_WRONLY)
    assert_errno(errno.EISDIR, os.open, sub, os.O_RDWR)
    assert_errno(errno.EISDIR, os.unlink, sub)
    assert_errno(errno.EISDIR, os.truncate, sub, 0)
    assert_errno(errno.EEXIST, os.mkdir, sub)
    assert_errno(errno.EEXIST, os.mkdir, f)
    write(os.path.join(sub, "x"), b"")
    assert_errno(errno.ENOTEMPTY, os.rmdir, sub)
    # Everything is on one filesystem: cross-directory moves and links work.
    os.rename(os.path.join(sub, "x"), os.path.join(d, "x"))
    os.link(f, os.path.join(sub, "f"))
    assert read(os.path.join(sub, "f")) == b"x"


# ---- concurrent namespace changes --------------------------------------------------
def _churn(root: str, seed: int, n_ops: int) -> None:
    """Random namespace operations on a small tree (most fail, which is fine)."""
    import random
    rng = random.Random(seed)

    def rpath():
        return os.path.join(root, *(rng.choice("abcd") for _ in range(rng.randrange(1, 4))))
    for _ in range(n_ops):
        op, a, b = rng.randrange(9), rpath(), rpath()
        try:
            if op == 0:
                os.mkdir(a)
            elif op == 1:
                with open(a, "xb") as f:
                    f.write(b"x")
            elif op == 2:
                os.rename(a, b)
            elif op == 3:
                os.unlink(a)
            elif op == 4:
                os.rmdir(a)
            elif op == 5:
                os.link(a, b)
            elif op == 6:
                renameat2(a, b, RENAME_EXCHANGE)
            elif op == 7:
                os.symlink("t", a)
            else:
                list(os.scandir(os.path.dirname(a)))
        except OSError:
            pass


def _check_tree(root: str) -> list[str]:
    """Link counts and '..' must match the tree that is actually there."""
    problems, names_of, nlink = [], {}, {}
    for dirpath, dirnames, filenames in os.walk(root):
        st = os.stat(dirpath)
        if st.st_nlink != 2 + len(dirnames):
            problems.append(f"{dirpath}: st_nlink {st.st_nlink}, {len(dirnames)} subdirs")
        if dirpath != root and dotdot(dirpath) != os.stat(os.path.dirname(dirpath)).st_ino:
            problems.append(f"{dirpath}: '..' is not its parent")
        for name in filenames:
            lst = os.lstat(os.path.join(dirpath, name))
            names_of[lst.st_ino] = names_of.get(lst.st_ino, 0) + 1
            nlink[lst.st_ino] = lst.st_nlink
    problems += [f"inode {i}: st_nlink {nlink[i]}, {n} names" for i, n in names_of.items()
                 if nlink[i] != n]
    return problems


def test_concurrent_namespace_changes_keep_counts(mnt):
    pids = []
    for seed in range(4):
        pid = os.fork()
        if pid == 0:
            try:
                _churn(mnt.mountpoint, seed, 1500)
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        assert os.waitpid(pid, 0)[1] == 0
    entries = sum(len(dirs) + len(files) for _p, dirs, files in os.walk(mnt.mountpoint))
    assert entries > 10  # the churn built something
    assert _check_tree(mnt.mountpoint) == []
    mnt.remount()
    assert _check_tree(mnt.mountpoint) == []
