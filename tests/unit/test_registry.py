"""The daemon registry used by --no-xattr mounts: entries are trusted only while
their mount point has the registered device number and their daemon lives."""
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
    assert registry.lookup(dev) == info
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
