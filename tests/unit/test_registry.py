"""The daemon registry used by --no-xattr mounts: entries are trusted only while
their mount point has the registered device number and their daemon lives."""
import json
import os
import subprocess

from tierfs import registry


def test_lookup_trusts_only_live_matching_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "run_dirs", lambda: [str(tmp_path / "run")])
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    dev = os.stat(mountpoint).st_dev
    info = {"pid": os.getpid(), "socket": "/x.sock", "mountpoint": str(mountpoint)}
    path = registry.register(dev, info)
    found = registry.lookup(dev)
    assert found is not None and {k: found[k] for k in info} == info
    assert registry.lookup(dev + 1) is None  # another mount: no entry

    dead = subprocess.Popen(["true"])
    dead.wait()
    registry.register(dev, dict(info, pid=dead.pid))
    assert registry.lookup(dev) is None  # its daemon is gone

    registry.register(dev, dict(info, mountpoint=str(tmp_path / "gone")))
    assert registry.lookup(dev) is None  # its mount point is gone

    registry.unregister(path)
    registry.unregister(path)  # twice is fine
    assert registry.lookup(dev) is None


def test_an_entry_names_one_process_not_whatever_later_gets_its_pid(tmp_path, monkeypatch):
    """Entries record when their daemon started: a killed daemon's entry is not taken
    for a later process that got its pid (serving: not it; dead_daemon: it died)."""
    monkeypatch.setattr(registry, "run_dirs", lambda: [str(tmp_path / "run")])
    mountpoint = str(tmp_path / "mnt")
    dev = os.makedev(0, 4242)
    info = {"pid": os.getpid(), "socket": "/x.sock", "mountpoint": mountpoint}
    registry.register(dev, info)
    assert registry.serving(dev, mountpoint)["pid"] == os.getpid()
    assert registry.dead_daemon(dev, mountpoint) is None
    assert registry.serving(dev, mountpoint + "-other") is None  # another mount point

    entry, = (str(p) for p in (tmp_path / "run").glob("dev-*.json"))
    with open(entry) as f:
        recorded = json.load(f)
    with open(entry, "w") as f:  # as if this pid had been a daemon that started earlier
        json.dump(dict(recorded, started=recorded["started"] - 1), f)
    assert registry.serving(dev, mountpoint) is None
    assert registry.dead_daemon(dev, mountpoint) == os.getpid()


def test_a_daemon_removes_only_its_own_entry(tmp_path, monkeypatch):
    """A mount's device number goes to the next mount as soon as the mount ends, while
    its daemon may still upload for a while: that daemon's unregister must leave the
    entry of the new mount (a live process here) in place."""
    monkeypatch.setattr(registry, "run_dirs", lambda: [str(tmp_path / "run")])
    mountpoint = str(tmp_path / "mnt")
    dev = os.makedev(0, 4343)
    old = registry.register(dev, {"pid": os.getpid(), "socket": "/a.sock",
                                  "mountpoint": mountpoint})
    newer = subprocess.Popen(["sleep", "30"])
    try:
        new = registry.register(dev, {"pid": newer.pid, "socket": "/b.sock",
                                      "mountpoint": mountpoint})
        assert new == old  # one entry per device number
        registry.unregister(old)  # the first daemon, exiting late
        assert registry.serving(dev, mountpoint)["pid"] == newer.pid
        registry.unregister(new, newer.pid)  # its own daemon removes it
        assert registry.serving(dev, mountpoint) is None
        assert not os.path.exists(new)
    finally:
        newer.kill()
        newer.wait()
