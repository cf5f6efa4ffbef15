"""Training-node integration through a real mount: Prometheus metrics, mount
options from a TOML file and the environment, the hint API and sampler, and
the mount(8) helper."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

import tierfs
from tests.fuse.test_tiering import make_cold, pattern, status
from tests.harness import read_file, write_file
from tests.moto_server import free_port

MiB = 1 << 20


def scrape(port: int) -> dict[str, float]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    text = opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_metrics_are_scraped(mount_factory):
    port = free_port()
    m = mount_factory(args=("--metrics-port", str(port), "--extent-size", "1M"))
    data = pattern(3 * MiB, 1)
    write_file(m.path("f"), data)
    make_cold(m, m.path("f"))
    assert read_file(m.path("f")) == data
    assert read_file(m.path("f")) == data  # page cache
    metrics = scrape(port)
    assert metrics['tierfs_read_bytes_total{tier="cold"}'] > 0
    assert metrics["tierfs_cold_fetches_total"] >= 3
    assert metrics["tierfs_uploads_total"] >= 3
    assert metrics["tierfs_dirty_bytes"] == 0
    assert metrics["tierfs_hot_bytes"] == 3 * MiB
    assert metrics['tierfs_checksum_failures_total{tier="cold"}'] == 0
    assert metrics['tierfs_s3_requests_total{op="put"}'] >= 3
    assert metrics['tierfs_fuse_op_seconds_count{op="read"}'] >= 1
    assert metrics['tierfs_fuse_op_seconds_bucket{le="+Inf",op="write"}'] >= 1
    assert metrics["tierfs_cold_fetch_seconds_count"] >= 3
    assert 0 <= metrics["tierfs_hit_ratio"] <= 1
    assert not any("secret" in k.lower() or "testing" in k for k in metrics)


def test_metrics_port_in_use(mount_factory, tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        m = mount_factory(start=False)
        res = m.cli("mount", m.cold_url, m.mountpoint, "--cache-dir", m.cache_dir,
                    "--metrics-port", str(s.getsockname()[1]))
    assert res.returncode == 1 and "choose another --metrics-port" in res.stderr
    m.allowed_log.append("cannot serve metrics")


def test_mount_from_config_file_and_env(mount_factory, tmp_path):
    m = mount_factory(start=False)
    conf = tmp_path / "tierfs.toml"
    conf.write_text(f'cold_url = "{m.cold_url}"\nmountpoint = "{m.mountpoint}"\n'
                    f'cache-dir = "{m.cache_dir}"\ncache_size = "48M"\nupload_delay = 0.3\n'
                    f'extent_size = "2M"\n')
    env = dict(os.environ, TIERFS_CACHE_SIZE="40M")
    res = subprocess.run([sys.executable, "-m", "tierfs", "mount", "--config", str(conf),
                          "--extent-size", "1M"], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    m.pid = m.daemon_pid()
    st = status(m)
    assert st["cache_limit"] == 40 * MiB       # environment beats the file
    assert st["extent_size"] == MiB            # the flag beats the file
    write_file(m.path("x"), b"hello")
    assert read_file(m.path("x")) == b"hello"


def test_hint_prefetches_in_order(mount_factory):
    m = mount_factory(args=("--extent-size", "1M"))
    os.makedirs(m.path("ds"))
    names = [m.path("ds", f"s{i:03d}") for i in range(40)]
    for i, name in enumerate(names):
        write_file(name, pattern(200_000, i))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", "-r", m.path("ds"), check=True)
    assert status(m)["hot_bytes"] == 0
    queued = tierfs.hint(names[:25])
    assert queued == 25
    deadline = time.monotonic() + 20
    while status(m)["hot_extents"] < 25 and time.monotonic() < deadline:
        time.sleep(0.05)
    hot = {e: status(m, n)["file"]["hot"] > 0 for e, n in enumerate(names)}
    assert all(hot[i] for i in range(25)) and not any(hot[i] for i in range(25, 40))
    assert status(m)["counters"]["hinted_files"] == 25
    with pytest.raises(ValueError, match="not inside the tierfs mount"):
        tierfs.hint([names[0], "/etc/hostname"])


def test_hinting_sampler_sends_each_epoch(mount_factory):
    m = mount_factory(args=("--extent-size", "1M"))
    names = [m.path(f"s{i:02d}") for i in range(12)]
    for i, name in enumerate(names):
        write_file(name, pattern(100_000, i))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", *names, check=True)

    class Reversed:  # any sampler: iterable with a length
        def __iter__(self):
            return iter(range(11, -1, -1))

        def __len__(self):
            return 12

    sampler = tierfs.HintingSampler(Reversed(), names)
    assert len(sampler) == 12
    assert list(sampler) == list(range(11, -1, -1))
    deadline = time.monotonic() + 20
    while status(m).get("counters", {}).get("hinted_files", 0) < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status(m)["hot_extents"] == 12


def test_mount_helper_translates_fstab_options(mount_factory):
    m = mount_factory(start=False)
    res = subprocess.run(
        [sys.executable, "-m", "tierfs.cli.mount_helper", m.cold_url, m.mountpoint, "-o",
         f"rw,_netdev,nofail,cache_dir={m.cache_dir},cache-size=32M,no_writeback_cache,"
         "upload_delay=0.2,x-systemd.automount"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    m.pid = m.daemon_pid()
    assert status(m)["cache_limit"] == 32 * MiB
    write_file(m.path("f"), b"via fstab")
    assert read_file(m.path("f")) == b"via fstab"
    res = subprocess.run([sys.executable, "-m", "tierfs.cli.mount_helper", m.cold_url,
                          "/tmp", "-o", "cache_dir=/x,bogus=1"], capture_output=True, text=True)
    assert res.returncode != 0 and "unknown option 'bogus'" in res.stderr


def test_mount_t_fuse_tierfs(mount_factory):
    """The real mount(8) path, when the helper can be placed where mount looks."""
    helper = "/sbin/mount.fuse.tierfs"
    if os.path.exists(helper) or not os.access("/sbin", os.W_OK):
        pytest.skip("/sbin/mount.fuse.tierfs exists already or /sbin is not writable")
    script = f"#!/bin/sh\nexec {sys.executable} -m tierfs.cli.mount_helper \"$@\"\n"
    with open(helper, "w") as f:
        f.write(script)
    os.chmod(helper, 0o755)
    try:
        m = mount_factory(start=False)
        res = subprocess.run(["mount", "-t", "fuse.tierfs", "-o",
                              f"cache_dir={m.cache_dir}", m.cold_url, m.mountpoint],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        m.pid = m.daemon_pid()
        write_file(m.path("f"), b"mount -t")
        assert read_file(m.path("f")) == b"mount -t"
    finally:
        os.unlink(helper)


def test_example_trains_over_the_mount(mount_factory):
    pytest.importorskip("torch")
    m = mount_factory()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, os.path.join(root, "examples", "train_tiny.py"),
                          m.path("tiny-ds"), "--epochs", "3"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    lines = [l for l in res.stdout.splitlines() if l.startswith("epoch")]
    assert len(lines) == 3
    assert float(lines[-1].rsplit(" ", 1)[1]) > 0.8  # a separable task: it learns
    assert len(os.listdir(m.path("tiny-ds"))) == 256
