"""Training-node integration through a real mount: Prometheus metrics, mount
options from a TOML file and the environment, the hint API and sampler, and
the mount(8) helper."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import urllib.request

import pytest

import tierfs
import tierfs.hints
from tierfs.tier.hinted import HEAD, MAX_DEPTH
from tests.fuse.test_tiering import make_cold, pattern, status
from tests.harness import drop_page_cache, read_file, wait_until, write_file
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
    os.mkdir(m.path("d"))
    small = [pattern(64 << 10, 10 + i) for i in range(8)]  # packed into one object
    for i, d in enumerate(small):
        write_file(m.path("d", f"s{i}"), d)
    make_cold(m, m.path("f"))
    m.cli("release", "-r", m.path("d"), check=True)
    drop_page_cache(m.mountpoint)
    assert read_file(m.path("f")) == data
    assert read_file(m.path("f")) == data  # page cache
    assert read_file(m.path("d", "s3")) == small[3]  # its neighbours come along

    def scraped_once_hot():  # a reader gets fetched bytes before their install ends
        metrics = scrape(port)
        return metrics if metrics["tierfs_hot_bytes"] == 3 * MiB + 8 * (64 << 10) else None
    metrics = wait_until(scraped_once_hot, 30, "every fetched extent to be installed")
    assert metrics['tierfs_read_bytes_total{tier="cold"}'] > 0
    assert metrics["tierfs_cold_fetches_total"] >= 3
    assert metrics["tierfs_uploads_total"] >= 3
    assert metrics["tierfs_dirty_bytes"] == 0
    assert metrics['tierfs_checksum_failures_total{tier="cold"}'] == 0
    assert metrics['tierfs_s3_requests_total{op="put"}'] >= 3
    assert metrics['tierfs_control_requests_total{cmd="release_many"}'] == 2  # f's and d's
    assert metrics['tierfs_fuse_op_seconds_count{op="read"}'] >= 1
    assert metrics['tierfs_fuse_op_seconds_bucket{le="+Inf",op="write"}'] >= 1
    assert metrics["tierfs_cold_fetch_seconds_count"] >= 3
    # The seven neighbours of s3 were installed as one run.
    for phase in ("wait", "write", "install"):
        assert metrics[f'tierfs_fetched_install_seconds_count{{phase="{phase}"}}'] == 1
        assert metrics[f'tierfs_fetched_install_seconds_sum{{phase="{phase}"}}'] > 0
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


HINT_WINDOW = MAX_DEPTH  # the most prefetches of hinted files in flight


def file_is_hot(path: str) -> bool:
    state = json.loads(os.getxattr(path, "user.tierfs.state"))
    return state["hot"] == state["size"] > 0


def test_hint_prefetches_in_order(mount_factory, tmp_path, monkeypatch):
    """Past the first HEAD files of a new list (the loader's first batch, all
    fetched at once), hinted files are taken from a FIFO queue in the hinted order,
    HINT_WINDOW at a time: a file's prefetch starts only after every file hinted
    before it has started, and only once at most HINT_WINDOW - 1 of those are
    unfinished. So whenever a file past the head is hot, at most HINT_WINDOW - 1
    files hinted before it are still cold. (Within the window, and within the
    head, fetches race: the order in which files become hot is not promised, and
    not checked.)"""
    faults = tmp_path / "faults.json"
    # Unpacked: a fetch then brings exactly its own file (packed neighbours come along
    # with a hinted fetch, out of order by design: the next test).
    m = mount_factory(args=("--extent-size", "1M", "--fault-file", str(faults),
                            "--pack-below", "0"))
    os.makedirs(m.path("ds"))
    n_files, n_hinted = 164, 160  # the head, then many windows; 4 files never hinted
    names = [m.path("ds", f"s{i:03d}") for i in range(n_files)]
    for i, name in enumerate(names):
        write_file(name, pattern(20_000, i))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", "-r", m.path("ds"), check=True)
    assert status(m)["hot_bytes"] == 0
    # Neither name nor inode order: the daemon can only get this order from the hint.
    order = random.Random(7).sample(range(n_files), n_hinted)
    hinted = [names[i] for i in order]
    unhinted = sorted(set(names) - set(hinted))
    # A slow bucket (every call 0.1 s) stretches the prefetch over several windows,
    # so that the polls below see it half done; the pass/fail check does not
    # depend on that timing, only on what each poll sees.
    faults.write_text(json.dumps({"latency_s": 0.1}))
    # Sent as a long list is: in several requests, which the daemon queues as one list.
    monkeypatch.setattr(tierfs.hints, "PATHS_PER_REQUEST", 40)
    requests = []
    real_call = tierfs.hints.call

    def counted(*args, **kw):
        requests.append((len(kw["paths"]), kw["replace"]))
        return real_call(*args, **kw)

    monkeypatch.setattr(tierfs.hints, "call", counted)
    assert tierfs.hint(hinted, replace=True) == n_hinted
    assert requests == [(40, True), (40, False), (40, False), (40, False)]
    snapshots = []

    def poll() -> bool:
        # Read from the last hinted to the first: hot is never undone here, so a
        # file found hot was hot before every earlier file was looked at, and the
        # poll is as good as an atomic snapshot for the check below.
        hot = [file_is_hot(p) for p in reversed(hinted)][::-1]
        snapshots.append(hot)
        return all(hot)

    wait_until(poll, 120, f"all {n_hinted} hinted files to be hot")
    faults.write_text(json.dumps({}))
    for k, hot in enumerate(snapshots):
        if any(hot[HEAD:]):
            last = max(i for i, h in enumerate(hot) if h)
            cold_before = [i for i in range(last) if not hot[i]]
            assert len(cold_before) < HINT_WINDOW, (
                f"poll {k}: hinted file #{last} is hot while {len(cold_before)} files "
                f"hinted before it are still cold (#{cold_before[:8]}...): not fetched in "
                f"the hinted order, {HINT_WINDOW} at a time")
    # The check above has teeth only on a poll that saw a file past the head hot and
    # at least a window's worth cold; the slow bucket gives several seconds of those.
    telling = [h for h in snapshots if any(h[HEAD:]) and h.count(False) >= HINT_WINDOW]
    assert telling, (f"no poll saw the prefetch half done ({len(snapshots)} polls): "
                     "the order was not observed")
    assert not any(file_is_hot(p) for p in unhinted), "a file that was not hinted got fetched"
    assert status(m)["counters"]["hinted_files"] == n_hinted
    with pytest.raises(ValueError, match="not inside the tierfs mount"):
        tierfs.hint([names[0], "/etc/hostname"])


def test_hinted_packed_files_come_a_range_of_the_pack_at_a_time(mount_factory, tmp_path):
    """Hints over packed small files in a random order cost a few ranged GETs, not one
    per file, and files not hinted stay cold. The first HEAD files of the list (a
    loader's first batch) are fetched at once, one GET each."""
    faults = tmp_path / "faults.json"
    m = mount_factory(args=("--extent-size", "1M", "--fault-file", str(faults)))
    os.makedirs(m.path("ds"))
    names = [m.path("ds", f"s{i:03d}") for i in range(200)]
    for i, name in enumerate(names):
        write_file(name, pattern(20_000, i))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", "-r", m.path("ds"), check=True)
    assert status(m)["packs"] == 1  # 4 MB of small files: one pack
    unhinted = set(names[::10])
    hinted = [n for n in names if n not in unhinted]
    random.Random(3).shuffle(hinted)
    gets_before = status(m)["counters"].get("cold_reads", 0)
    assert tierfs.hint(hinted) == len(hinted)
    wait_until(lambda: all(file_is_hot(p) for p in hinted), 60, "every hinted file to be hot")
    gets = status(m)["counters"]["cold_reads"] - gets_before
    assert HEAD <= gets <= HEAD + 8, (f"{gets} GETs for {len(hinted)} hinted files in one "
                                      f"pack, the first {HEAD} of them fetched alone")
    assert not any(file_is_hot(p) for p in unhinted), "a file that was not hinted got fetched"
    for name in names:
        assert read_file(name) == pattern(20_000, names.index(name)), name


def write_cold(m, names: list[str], size: int) -> None:
    """Write file i of `names` with pattern(size, i), upload them all, drop the hot
    copies and the page cache: their data is only in the bucket."""
    for i, name in enumerate(names):
        write_file(name, pattern(size, i))
    m.cli("sync", m.mountpoint, "--wait", check=True)
    m.cli("release", *names, check=True)
    drop_page_cache(*names)


def test_a_loader_that_catches_up_deepens_hinted_prefetch(mount_factory, tmp_path):
    """A read that finds a hinted file still cold (the loader caught up with the
    prefetch) raises the number of hinted prefetches in flight."""
    faults = tmp_path / "faults.json"
    m = mount_factory(args=("--extent-size", "1M", "--fault-file", str(faults),
                            "--pack-below", "0"))
    names = [m.path(f"s{i:02d}") for i in range(40)]
    write_cold(m, names, 20_000)
    faults.write_text(json.dumps({"latency_s": 0.3}))  # 40 files take seconds to prefetch
    assert tierfs.hint(names) == len(names)
    assert "hint_depth_raised" not in status(m)["counters"]
    # The loader at the end of the order: its file is still queued, so it reads from
    # the bucket itself, and prefetch learns it is behind.
    assert read_file(names[-1]) == pattern(20_000, 39)
    assert status(m)["counters"]["hint_depth_raised"] >= 1
    wait_until(lambda: all(file_is_hot(p) for p in names), 60, "every hinted file to be hot")
    faults.write_text(json.dumps({}))


@pytest.mark.allow_log_errors
def test_hints_during_a_bucket_outage_fail_quietly(mount_factory, tmp_path):
    """A hinted prefetch that the bucket fails is counted and dropped: the mount stays
    up, and the files read once the bucket is back."""
    faults = tmp_path / "faults.json"
    m = mount_factory(args=("--extent-size", "1M", "--fault-file", str(faults),
                            "--cold-timeout", "1"))
    m.allowed_log += ["cold read of .*"]
    names = [m.path(f"s{i}") for i in range(3)]
    write_cold(m, names, 50_000)
    faults.write_text(json.dumps({"outage": True}))
    assert tierfs.hint(names) == 3
    wait_until(lambda: status(m)["counters"].get("hinted_failed", 0) >= 1, 30,
               "a hinted prefetch to fail")
    assert m.mounted and os.path.getsize(names[0]) == 50_000
    assert "background task" not in m.log(), "the hint queue crashed and was restarted"
    faults.write_text(json.dumps({}))
    for i, name in enumerate(names):
        assert read_file(name) == pattern(50_000, i)


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

    def hinted_files() -> int:
        return status(m).get("counters", {}).get("hinted_files", 0)

    sampler = tierfs.HintingSampler(Reversed(), names)
    assert len(sampler) == 12
    for epoch in (1, 2):
        assert list(sampler) == list(range(11, -1, -1))
        # Every epoch's order reaches the daemon: each hinted file counts once per
        # hint (the second epoch's files are hot already and count all the same).
        wait_until(lambda: hinted_files() >= 12 * epoch, 30,
                   f"the hints of epoch {epoch} to be worked through")
        assert hinted_files() == 12 * epoch
        assert status(m)["hot_extents"] == 12
        assert all(file_is_hot(p) for p in names)


def test_hinting_sampler_never_interleaves_two_epochs(mount_factory, monkeypatch):
    """An epoch that begins while the last one's list is still being sent (a list
    of many requests) stops that list: the daemon never gets the two mixed."""
    m = mount_factory()
    names = [m.path(f"s{i:02d}") for i in range(30)]
    for i, name in enumerate(names):
        write_file(name, pattern(1000, i))
    monkeypatch.setattr(tierfs.hints, "PATHS_PER_REQUEST", 10)
    sent = []
    first_sent, go_on = threading.Event(), threading.Event()
    real_call = tierfs.hints.call

    def held_after_the_first(*args, **kw):
        sent.append((kw["paths"], kw["replace"]))
        result = real_call(*args, **kw)
        if len(sent) == 1:
            first_sent.set()
            go_on.wait(60)
        return result

    monkeypatch.setattr(tierfs.hints, "call", held_after_the_first)

    class Epochs:  # 0..29, then 29..0
        epoch = 0

        def __iter__(self):
            self.epoch += 1
            return iter(range(30) if self.epoch == 1 else range(29, -1, -1))

        def __len__(self):
            return 30

    sampler = tierfs.HintingSampler(Epochs(), names)
    assert list(sampler) == list(range(30))
    assert first_sent.wait(60), "the first epoch's list never went out"
    assert list(sampler) == list(range(29, -1, -1))  # while the first is half sent
    go_on.set()
    wait_until(lambda: len(sent) >= 4, 60, "the second epoch's list to be sent")
    rel = [os.path.basename(n) for n in names]
    second = rel[::-1]
    assert sent == [(rel[:10], True), (second[:10], True), (second[10:20], False),
                    (second[20:], False)]
    # The daemon took both lists in (10 files of the first, all 30 of the second).
    wait_until(lambda: status(m)["counters"].get("hinted_files", 0) >= 40, 30,
               "the hinted files to be worked through")
    assert status(m)["counters"]["hinted_files"] == 40


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


def test_a_hint_list_that_begins_with_a_missing_file_skips_it(mount_factory):
    """A hinted path that names nothing is skipped and counted as unknown. One that
    was first in the list made tierfs.hint() raise "... does not exist" instead (the
    mount was looked up through it), and HintingSampler lost that epoch's hints."""
    m = mount_factory()
    os.makedirs(m.path("ds"))
    write_file(m.path("ds", "a"), b"a")
    assert tierfs.hint([m.path("ds", "gone"), m.path("ds", "a")]) == 1
    assert tierfs.hint([m.path("nodir", "gone"), m.path("ds", "a")], replace=True) == 1


def hint_from_another_process(*lists: list[str]) -> None:
    """tierfs.hint(paths, replace=True) of each list in turn, in one other process (a
    rank of the same job on this node)."""
    code = ("import json, sys, tierfs\n"
            "for paths in json.loads(sys.argv[1]):\n"
            "    tierfs.hint(paths, replace=True)\n")
    subprocess.run([sys.executable, "-c", code, json.dumps(lists)], check=True, timeout=60)


def test_ranks_on_one_node_keep_their_own_hint_lists(mount_factory, tmp_path):
    """Two ranks of a job on one node each send their epoch order with replace=True
    (each its own HintingSampler): the second replaced the first one's list, and
    only the last rank's files were prefetched. Each process now has its own list."""
    faults = tmp_path / "faults.json"
    m = mount_factory(args=("--extent-size", "1M", "--fault-file", str(faults),
                            "--pack-below", "0"))
    names = [m.path(f"s{i:02d}") for i in range(2 * (HEAD + 8))]
    write_cold(m, names, 20_000)
    rank0, rank1 = names[:HEAD + 8], names[HEAD + 8:]
    faults.write_text(json.dumps({"hang": True, "hang_ops": ["get"]}))  # nothing done yet
    try:
        assert tierfs.hint(rank0, replace=True) == len(rank0)
        hint_from_another_process(rank1)
    finally:
        faults.write_text(json.dumps({}))
    wait_until(lambda: all(file_is_hot(p) for p in rank0 + rank1), 60,
               "the hinted files of both ranks to be hot")


def test_an_empty_replacing_hint_list_drops_the_hints_still_queued(mount_factory, tmp_path):
    """tierfs.hint([], replace=True) (a job that stops its prefetch) sent nothing, so
    the files still queued were fetched all the same. It now drops them: a loader's
    read of one is no longer taken for prefetch being behind."""
    faults = tmp_path / "faults.json"
    m = mount_factory(args=("--extent-size", "1M", "--fault-file", str(faults),
                            "--pack-below", "0"))
    names = [m.path(f"s{i:02d}") for i in range(HEAD + 8)]
    write_cold(m, names, 20_000)
    faults.write_text(json.dumps({"hang": True, "hang_ops": ["get"]}))  # the head stays in flight
    reader = threading.Thread(target=read_file, args=(names[-1],))
    try:
        hint_from_another_process(names, [])
        wait_until(lambda: status(m)["fetches_in_flight"] == HEAD, 30, "the list's head in flight")
        reader.start()  # the loader reaches the last file: a miss
        wait_until(lambda: status(m)["fetches_in_flight"] == HEAD + 1, 30, "the loader's miss")
        assert "hint_depth_raised" not in status(m)["counters"], "the list was not dropped"
    finally:
        faults.write_text(json.dumps({}))
        if reader.ident is not None:  # started
            reader.join(60)
    assert read_file(names[-1]) == pattern(20_000, len(names) - 1)
