"""mount_table.MountTable: where a path lies by name, read from a mountinfo file."""
from __future__ import annotations

import os
import random
import signal

from tierfs.mount_table import MountTable

# id parent major:minor root mount-point options - type source super-options
MOUNTINFO = """\
21 1 254:0 / / rw - ext4 /dev/vda rw
30 21 0:40 / /mnt/tierfs rw - fuse.tierfs tierfs rw
31 30 0:41 / /mnt/tierfs/scratch rw - tmpfs tmpfs rw
32 21 0:42 /data /mnt/bound rw - fuse.tierfs tierfs rw
40 21 0:40 / /srv/over rw - fuse.tierfs tierfs rw
41 40 0:43 / /srv/over rw - tmpfs tmpfs rw
50 21 0:44 / /mnt/with\\040space rw - fuse.tierfs tierfs rw
"""


def table(tmp_path) -> MountTable:
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTINFO)
    return MountTable(str(path))


def test_a_path_lies_on_the_longest_mount_point_above_it(tmp_path):
    t = table(tmp_path)
    dev = os.makedev(0, 40)
    assert t.place("/mnt/tierfs/ds/a.bin") == (dev, "ds/a.bin")
    assert t.place("/mnt/tierfs") == (dev, ".")
    assert t.place("/mnt/tierfs/./ds//a.bin") == (dev, "ds/a.bin")
    assert t.place("/mnt/tierfs/scratch/x") == (os.makedev(0, 41), "x")  # mounted inside
    assert t.place("/mnt/tierfsx/y") == (os.makedev(254, 0), "mnt/tierfsx/y")


def test_the_top_of_stacked_mounts_is_the_one_no_other_stands_on(tmp_path):
    assert table(tmp_path).place("/srv/over/f") == (os.makedev(0, 43), "f")


def test_stacked_mounts_whose_top_is_unclear_are_left_to_a_stat(tmp_path):
    """Two mounts at one point, neither standing on the other: only the kernel's walk
    tells which one a path reaches, never the filesystem mounted above them."""
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTINFO + "60 21 0:45 / /srv/twin rw - tmpfs a rw\n"
                                "61 21 0:46 / /srv/twin rw - tmpfs b rw\n")
    t = MountTable(str(path))
    assert t.place("/srv/twin/f") is None
    assert t.place("/srv/twin") is None
    assert t.place("/srv/twinned/f") == (os.makedev(254, 0), "srv/twinned/f")


def test_among_hundreds_of_mounts_a_path_lies_on_the_longest_point_above_it(tmp_path):
    """A container host's table: 400 mounts nested up to six deep, 3,000 paths at and
    below them and beside them, each placed as the longest mount point it lies below."""
    rng = random.Random(7)
    devs = {"/": os.makedev(8, 0)}
    points = ["/"]
    lines = ["1 0 8:0 / / rw - ext4 /dev/sda rw"]
    for k in range(400):
        parent = rng.choice(points)
        if parent.count("/") >= 6:
            parent = "/"
        point = parent.rstrip("/") + "/" + rng.choice(["m", "mnt", "m1", "data"]) + str(k % 37)
        if point in points:
            continue
        points.append(point)
        devs[point] = os.makedev(0, k + 50)
        lines.append(f"{k + 2} 1 0:{k + 50} / {point} rw - tmpfs t{k} rw")
    (tmp_path / "mountinfo").write_text("\n".join(lines) + "\n")
    t = MountTable(str(tmp_path / "mountinfo"))
    for _ in range(3000):
        base = rng.choice(points)
        path = base.rstrip("/") + rng.choice(["", "/f", "/d/e", "x/f", "/m1", "/data3/f"])
        path = "/" + path.lstrip("/")
        below = [p for p in points
                 if p == "/" or path == p or path.startswith(p + "/")]
        nearest = max(below, key=len)
        inner = path[len(nearest):].lstrip("/") or "."
        assert t.place(path) == (devs[nearest], inner), path


def test_a_bind_mount_of_a_directory_names_paths_from_the_filesystem_root(tmp_path):
    assert table(tmp_path).place("/mnt/bound/x/y") == (os.makedev(0, 42), "data/x/y")


def test_escaped_mount_points_are_read_as_the_kernel_means_them(tmp_path):
    assert table(tmp_path).place("/mnt/with space/f") == (os.makedev(0, 44), "f")


def test_only_a_stat_can_place_a_path_with_dot_dot(tmp_path):
    t = table(tmp_path)
    assert t.place("/mnt/tierfs/a/../b") is None
    assert t.place("..") is None


def test_a_relative_path_is_placed_from_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir("/")
    assert table(tmp_path).place("mnt/tierfs/f") == (os.makedev(0, 40), "f")


def test_an_unreadable_table_places_nothing(tmp_path):
    assert MountTable(str(tmp_path / "absent")).place("/mnt/tierfs/f") is None


def test_a_forked_child_reads_its_own_table_even_if_the_parent_held_the_lock(tmp_path):
    t = table(tmp_path)
    assert t.place("/mnt/tierfs/f") is not None  # opened in the parent
    with t._lock:  # as another thread of the parent might hold it when the fork comes
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)  # a child stuck on the lock dies, and the test fails
            ok = t.place("/mnt/tierfs/f") == (os.makedev(0, 40), "f")
            os._exit(0 if ok else 1)
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_mounts_of_a_filesystem_and_of_a_type(tmp_path):
    t = table(tmp_path)
    assert t.roots_of(os.makedev(0, 40)) == [("/mnt/tierfs", "/"), ("/srv/over", "/")]
    assert t.points_of_type("fuse.tierfs") == (
        "/mnt/tierfs", "/mnt/bound", "/srv/over", "/mnt/with space")
    assert t.points_of_type("tmpfs") == ("/mnt/tierfs/scratch", "/srv/over")


def test_the_generation_changes_with_every_mount_and_unmount(tmp_path):
    """What a process learnt about a device number holds only while the generation
    stays: the kernel gives an unmounted filesystem's number to the next one."""
    import subprocess
    t = MountTable()  # this process's real table
    point = tmp_path / "point"
    point.mkdir()
    before = t.generation()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(point)], check=True)
    try:
        mounted = t.generation()
        assert None not in (before, mounted) and mounted != before
    finally:
        subprocess.run(["umount", str(point)], check=True)
    assert t.generation() not in (None, mounted)
    assert MountTable(str(tmp_path / "missing")).generation() is None
