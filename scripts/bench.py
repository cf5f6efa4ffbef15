#!/usr/bin/env python3
"""Benchmark of tierfs against the physical limit: a plain directory on the same disk.

    python scripts/bench.py [--quick] [--reps N] [--out results.json] [--size-scale X]
                            [--workdir DIR] [--skip W...]

Runs the same workloads, in one run, on (a) a plain directory next to the hot tier
and (b) a tierfs mount backed by a moto S3 server that this script starts itself,
then prints medians over the repetitions with the ratio tierfs/local and the target
of every row (PASS/FAIL), and writes every raw figure to a JSON file.

Workloads (full sizes; --quick uses smaller ones, --size-scale multiplies them):
  W1  checkpoint write: one 2 GiB file in 1 MiB writes, then fsync; then (tierfs) the
      same through tierfs.open (direct writes), against the local plain write
  W2  large-file read, 1 MiB reads: hot (page cache dropped), warm, and (tierfs only)
      cold from the bucket, next to the S3 server's raw GET rate at 8 threads; hot and
      warm again through tierfs.open (direct reads), against the local plain reads
  W3  small files: create 20,000 x 64 KiB in 100 directories; read them all in random
      order with 8 reader processes, hot (page cache dropped) and warm; then (tierfs)
      through tierfs.open, and warm through tierfs.open_many of 64 files at a time (each
      reader imports the direct path before the clock starts, as a loader's worker does
      once for all its epochs); then hot again after a remount (no hot copy verified yet
      on the new mount)
  W4  metadata: stat every W3 file with cold caches; `ls -lR` of the tree (cold too)
  W5  mixed: W2's sequential read concurrently with a 1 GiB checkpoint write + fsync;
      then (tierfs) both through tierfs.open
  W6  training-loop stall: 8 prefetching loader processes feed batches of 32 W3 files
      to a loop that "computes" (sleeps) a calibrated time per batch; accelerator-busy %
      for a hot and a warm epoch (and with torch's DataLoader when torch is installed, on
      tierfs also with tierfs.accelerate() in its workers); on tierfs also cold epochs
      (data only in the bucket) with 20 and 50 ms added to every GET, without and with
      tierfs.hint
  W7  (torch installed) a model's state dict saved with torch.save + fsync and loaded
      back hot, through the mount and (tierfs) tierfs.open; and with
      torch.distributed.checkpoint (local FileSystemWriter, FsspecWriter on tierfs://)
  scale  metadata scale on a fresh file:// mount: N empty files in 1000 directories,
      then mount time, stat ops/s with cold caches and daemon peak RSS, next to 10,000
  packscale  N files of 4 KiB on a fresh file:// mount: objects in the bucket and PUTs
      per file; then half of them deleted, and bucket bytes over live bytes once
      compaction and gc are done

Every timed phase starts after `tierfs sync --wait` (tierfs) / sync (local), so that
background uploads of an earlier phase do not run inside it. Mounts, daemons and the
S3 server are always stopped at the end, also on Ctrl-C, SIGTERM or an error.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import multiprocessing
import os
import platform
import queue
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(SCRIPTS)
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)
if REPO not in sys.path:
    # After the PYTHONPATH entries: a checkout put there (to compare two commits) is the
    # code under test on the client side too, not only in the daemon it mounts.
    _pp = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    sys.path.insert(max([i + 1 for i, p in enumerate(sys.path) if p and os.path.abspath(p) in _pp],
                        default=0), REPO)

import bench_workers as bw  # noqa: E402
from tests import moto_server as moto  # noqa: E402
from tierfs.cli.mount import pid_alive  # noqa: E402
from tierfs.client import daemon_info  # noqa: E402
from tierfs.mountpoint import mounts  # noqa: E402
from tests.moto_server import TEST_REGION, make_bucket, s3_env  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
COLD_GET_LATENCY_S = 0.02  # W6 cold epochs: a real bucket's time to first byte
SLOW_GET_LATENCY_S = 0.05  # and a slow one's
WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "torch", "scale", "packscale")
BUCKET = "tierfs-bench"
RAW_BUCKET = "tierfs-bench-raw"
SPAWN = multiprocessing.get_context("spawn")
WORKER_TIMEOUT_S = 3600


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- configuration ----------------------------------------------------------------------

@dataclass
class Config:
    quick: bool
    reps: int
    ckpt_bytes: int            # W1/W2 checkpoint
    mixed_write_bytes: int     # W5 checkpoint written during the read
    small_files: int           # W3/W4/W6
    small_file_bytes: int = 64 * KiB
    small_dirs: int = 100
    scale_files: int = 1_000_000
    scale_ref_files: int = 10_000
    scale_dirs: int = 1000
    rawget_bytes: int = 1 * GiB
    rawget_object_bytes: int = 8 * MiB
    threads: int = 8           # readers (W3), S3 GET threads, loader workers (W6)
    batch_size: int = 32
    prefetch_factor: int = 2
    block: int = 1 * MiB
    skip: tuple[str, ...] = ()
    mount_args: tuple[str, ...] = ()  # extra `tierfs mount` flags, to compare configurations
    bucket: str = "moto"  # the tierfs side's bucket: moto, moto-ranges, or a file:// directory
    compute_s: float | None = None  # W6 compute per batch; None: calibrate on the local side

    def runs(self, workload: str) -> bool:
        return workload not in self.skip


def make_config(args) -> Config:
    x = args.size_scale
    if args.quick:
        ckpt, mixed, files, scale = 512 * MiB, 256 * MiB, 4000, 20_000
    else:
        ckpt, mixed, files, scale = 2 * GiB, 1 * GiB, 20_000, 1_000_000

    def mib(n: float) -> int:
        return max(8 * MiB, int(n) // MiB * MiB)

    ckpt = mib(ckpt * x)
    per_round = 8 * 8 * MiB  # 8 threads x one 8 MiB object
    rawget = max(per_round, min(ckpt, 1 * GiB) // per_round * per_round)
    return Config(quick=args.quick, reps=args.reps or (2 if args.quick else 3),
                  ckpt_bytes=ckpt, mixed_write_bytes=mib(mixed * x),
                  small_files=max(200, int(files * x)), scale_files=max(1000, int(scale * x)),
                  rawget_bytes=rawget, skip=tuple(args.skip),
                  mount_args=tuple(shlex.split(args.mount_args)), bucket=args.bucket,
                  compute_s=args.compute_ms / 1000 if args.compute_ms else None)


# ---- system helpers -----------------------------------------------------------------------

_drop_ok: bool | None = None


def drop_caches() -> None:
    """Write back dirty pages and drop the page cache, dentries and inodes."""
    global _drop_ok
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        _drop_ok = True
    except OSError as e:
        if _drop_ok is None:
            log(f"WARNING: cannot drop the page cache ({e.strerror}): 'hot' rows are warm")
        _drop_ok = False


def proc_memory_mib(pid: int) -> dict[str, float]:
    """VmHWM (peak resident set size), VmRSS, RssAnon and RssFile of a process, in MiB.
    RssFile includes the pages of the LMDB memory map the daemon has touched."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def tierfs_cli(*args, timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run `tierfs ARGS` (this interpreter's tierfs) and fail loudly if it fails."""
    cmd = [sys.executable, "-m", "tierfs", *map(str, args)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"tierfs {' '.join(map(str, args))} failed ({res.returncode}): "
                           f"{res.stderr.strip()} {res.stdout.strip()}")
    return res


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---- a tierfs mount -------------------------------------------------------------------------

class TierfsMount:
    """One tierfs filesystem: mount, remount, unmount, peak RSS of its daemons."""

    def __init__(self, cold_url: str, base: str, extra_args=()):
        self.cold_url = cold_url
        self.mountpoint = os.path.join(base, "mnt")
        self.cache_dir = os.path.join(base, "cache")
        self.extra_args = list(extra_args)
        self.pid: int | None = None
        self.peak_rss_mib = 0.0
        self.memory: dict[str, float] = {}  # at the last record_rss()
        os.makedirs(self.mountpoint, exist_ok=True)

    @property
    def mounted(self) -> bool:
        return mounts().get(self.mountpoint, "").startswith("fuse")

    def mount(self) -> float:
        """Mount; return the seconds `tierfs mount` took to return."""
        t0 = time.monotonic()
        tierfs_cli("mount", self.cold_url, self.mountpoint, "--cache-dir", self.cache_dir,
                   *self.extra_args, timeout=600)
        took = time.monotonic() - t0
        self.pid = daemon_info(self.mountpoint)["pid"]  # no status: that scans the database
        return took

    def record_rss(self) -> float | None:
        """The daemon's VmHWM now (also kept as the peak over this mount's daemons)."""
        mem = proc_memory_mib(self.pid) if self.pid else {}
        if "VmHWM" not in mem:
            return None
        self.memory = mem
        self.peak_rss_mib = max(self.peak_rss_mib, mem["VmHWM"])
        return mem["VmHWM"]

    def umount(self) -> None:
        self.record_rss()
        tierfs_cli("umount", self.mountpoint, timeout=600)
        self.pid = None

    def remount(self) -> None:
        self.umount()
        self.mount()

    def log_problems(self) -> list[str]:
        try:
            with open(os.path.join(self.cache_dir, "tierfs.log"), errors="replace") as f:
                return [ln.rstrip() for ln in f
                        if re.search(r"Traceback|\bERROR\b|\bCRITICAL\b", ln)]
        except FileNotFoundError:
            return []

    def cleanup(self) -> None:
        """Unmount and stop the daemon whatever state it is in (never raises)."""
        try:
            if self.mounted:
                if self.pid:
                    self.record_rss()
                try:
                    tierfs_cli("umount", self.mountpoint, timeout=180)
                except Exception as e:
                    log(f"tierfs umount {self.mountpoint} failed ({e}); lazy unmount")
                    subprocess.run(["fusermount3", "-u", "-z", self.mountpoint],
                                   capture_output=True)
            if self.pid:
                deadline = time.monotonic() + 30
                while pid_alive(self.pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if pid_alive(self.pid):
                    log(f"killing tierfs daemon {self.pid}")
                    os.kill(self.pid, signal.SIGKILL)
                self.pid = None
        except Exception as e:  # cleanup must go on with the next resource
            log(f"cleanup of {self.mountpoint} failed: {e}")


# ---- benchmark targets: the same workloads on a directory or a mount ---------------------------

class LocalTarget:
    name = "local"

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)

    def settle(self) -> None:
        os.sync()

    def cold_metadata(self) -> None:
        drop_caches()

    def cold_data(self, path: str) -> dict:
        raise NotImplementedError("a local directory has no cold tier")


class TierfsTarget:
    name = "tierfs"

    def __init__(self, mount: TierfsMount):
        self.mount = mount
        self.root = mount.mountpoint

    def settle(self) -> None:
        tierfs_cli("sync", self.root, "--wait")
        os.sync()

    def cold_metadata(self) -> None:
        """A fresh mount (no kernel attribute or dentry cache) and no page cache."""
        self.mount.remount()
        drop_caches()

    def cold_data(self, path: str) -> dict:
        """Leave the file only in the bucket: sync, release its hot copy, drop caches."""
        tierfs_cli("sync", self.root, "--wait")
        tierfs_cli("release", path)
        state = json.loads(tierfs_cli("status", path, "--json").stdout)["file"]
        drop_caches()
        return {"hot_bytes_after_release": state.get("hot", 0)}


# ---- S3 server and raw rate ---------------------------------------------------------------

# ---- S3 raw rate ----------------------------------------------------------------------------

def s3_client():
    import boto3
    from botocore.config import Config as BotoConfig

    return boto3.session.Session().client(
        "s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name=TEST_REGION,
        config=BotoConfig(max_pool_connections=32, retries={"max_attempts": 3}))


def upload_raw_objects(cfg: Config) -> list[str]:
    from concurrent.futures import ThreadPoolExecutor

    client = s3_client()
    data = os.urandom(cfg.rawget_object_bytes)
    keys = [f"raw/{i:05d}" for i in range(cfg.rawget_bytes // cfg.rawget_object_bytes)]
    with ThreadPoolExecutor(cfg.threads) as ex:
        list(ex.map(lambda k: client.put_object(Bucket=RAW_BUCKET, Key=k, Body=data), keys))
    return keys


def raw_get_rate(cfg: Config, keys: list[str]) -> float:
    """MiB/s of `threads` threads, each GETting its own share of the objects."""
    from concurrent.futures import ThreadPoolExecutor

    client = s3_client()

    def get_share(share: list[str]) -> int:
        return sum(len(client.get_object(Bucket=RAW_BUCKET, Key=k)["Body"].read())
                   for k in share)

    shares = [keys[i::cfg.threads] for i in range(cfg.threads)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(cfg.threads) as ex:
        total = sum(ex.map(get_share, shares))
    return total / MiB / (time.monotonic() - t0)


def delete_prefix(bucket: str, prefix: str) -> None:
    client = s3_client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(objs), 1000):
            client.delete_objects(Bucket=bucket, Delete={"Objects": objs[i:i + 1000]})


# ---- process helpers -------------------------------------------------------------------------

def next_result(results, procs) -> tuple:
    """The next ("ok", ...) message of a worker; raise if one failed or died silently."""
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while True:
        try:
            r = results.get(timeout=1)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"worker process {dead[0].pid} died "
                                   f"(exit code {dead[0].exitcode})") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"no result from the workers in {WORKER_TIMEOUT_S} s") from None
            continue
        if r[0] == "error":
            raise RuntimeError("a worker process failed:\n" + r[1])
        return r


def run_parallel(jobs: list[tuple], watch: "CpuWatch | None" = None
                 ) -> tuple[list[tuple], float]:
    """Start one spawned process per (function, *args) job; they all wait on a barrier,
    the clock (and `watch`) starts when it opens. Returns (their results, seconds until
    the last one)."""
    barrier = SPAWN.Barrier(len(jobs) + 1)
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=fn, args=(*fargs, barrier, results), daemon=True)
             for fn, *fargs in jobs]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=120)
        with watch or contextlib.nullcontext():
            t0 = time.monotonic()
            out = [next_result(results, procs) for _ in procs]
            return out, time.monotonic() - t0
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


class Loader:
    """A DataLoader look-alike: `workers` processes, worker k%workers builds batch k,
    at most prefetch_factor batches per worker requested ahead, batches consumed in order."""

    def __init__(self, paths: list[str], cfg: Config):
        self.cfg = cfg
        self.results = SPAWN.Queue()
        self.tasks = [SPAWN.Queue() for _ in range(cfg.threads)]
        self.procs = [SPAWN.Process(target=bw.loader_worker, args=(paths, q, self.results),
                                    daemon=True) for q in self.tasks]
        for p in self.procs:
            p.start()
        for i, q in enumerate(self.tasks):  # wait until every worker is up
            q.put((-1 - i, []))
        for _ in self.tasks:
            self._get()

    def _get(self) -> tuple[int, int]:
        r = next_result(self.results, self.procs)
        return r[1], r[2]

    def epoch(self, order: list[int], compute_s: float,
              first_watch: "CpuWatch | None" = None) -> dict:
        """One epoch in `order`; `first_watch` counts the CPU used until the first
        batch is in (where a cold epoch waits)."""
        bs, w = self.cfg.batch_size, len(self.tasks)
        batches = [order[i:i + bs] for i in range(0, len(order), bs)]
        ahead = w * self.cfg.prefetch_factor

        def request(k: int) -> None:
            if k < len(batches):
                self.tasks[k % w].put((k, batches[k]))

        if first_watch is not None:
            first_watch.__enter__()
        t0 = time.monotonic()
        for k in range(ahead):
            request(k)
        ready: dict[int, int] = {}
        busy = stall = first = 0.0
        tenths = [0.0] * 10  # stall per tenth of the epoch's batches: where the loader waits
        for k in range(len(batches)):
            tw = time.monotonic()
            while k not in ready:
                b, n = self._get()
                ready[b] = n
            waited = time.monotonic() - tw
            stall += waited
            tenths[10 * k // len(batches)] += waited
            if k == 0:
                first = waited
                if first_watch is not None:
                    first_watch.__exit__(None, None, None)
            ready.pop(k)
            request(k + ahead)
            tc = time.monotonic()
            if compute_s > 0:
                time.sleep(compute_s)
            busy += time.monotonic() - tc
        wall = time.monotonic() - t0
        return {"wall_s": wall, "busy_s": busy, "stall_s": stall, "first_batch_s": first,
                "stall_by_tenth_s": [round(x, 4) for x in tenths], "batches": len(batches),
                "busy_pct": 100 * busy / wall if wall else 0.0}

    def close(self) -> None:
        for q in self.tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


# ---- data sets ---------------------------------------------------------------------------------

def ckpt_path(t) -> str:
    return os.path.join(t.root, "ckpt.bin")


def small_paths(t, cfg: Config) -> list[str]:
    per_dir = -(-cfg.small_files // cfg.small_dirs)
    return [os.path.join(t.root, "small", f"d{i // per_dir:03d}", f"f{i:06d}.bin")
            for i in range(cfg.small_files)]


def small_dirs(paths: list[str]) -> list[str]:
    return sorted({os.path.dirname(p) for p in paths})


def write_ckpt(t, cfg: Config, path: str | None = None, direct: bool = False) -> float:
    """Write the checkpoint in 1 MiB writes + fsync; return seconds (open to close).
    direct: through tierfs.open."""
    block = os.urandom(cfg.block)
    opener = open
    if direct:
        import tierfs
        opener = tierfs.open
    t0 = time.monotonic()
    bw.write_blocks(path or ckpt_path(t), cfg.ckpt_bytes, block, opener=opener)
    return time.monotonic() - t0


def create_small_files(t, cfg: Config) -> float:
    paths = small_paths(t, cfg)
    data = os.urandom(cfg.small_file_bytes)
    t0 = time.monotonic()
    for d in small_dirs(paths):
        os.makedirs(d)
    for p in paths:
        with open(p, "wb", buffering=0) as f:
            f.write(data)
    return time.monotonic() - t0


def ensure_ckpt(t, cfg: Config) -> None:
    if not os.path.exists(ckpt_path(t)):
        write_ckpt(t, cfg)


def ensure_small_files(t, cfg: Config) -> None:
    if not os.path.exists(small_paths(t, cfg)[-1]):
        create_small_files(t, cfg)


def read_rate(path: str, expect: int, direct: bool = False) -> float:
    buf = bw.read_buffer()
    opener = open
    if direct:
        import tierfs
        opener = tierfs.open
    t0 = time.monotonic()
    n = bw.read_whole(path, buf, opener)
    dt = time.monotonic() - t0
    if n != expect:
        raise RuntimeError(f"read {n} bytes of {path}, expected {expect}")
    return n / MiB / dt


def parallel_read_rate(paths: list[str], cfg: Config, seed: int,
                       direct: int | None = None, watch: "CpuWatch | None" = None) -> float:
    """Files/s of `threads` processes reading disjoint shares of a shuffled list;
    direct: through tierfs.open (0) or tierfs.open_many of that many files. `watch`
    counts the CPU used while they read (not while they start)."""
    order = list(paths)
    random.Random(seed).shuffle(order)
    n = cfg.threads
    shares = [order[len(order) * i // n:len(order) * (i + 1) // n] for i in range(n)]
    jobs = ([(bw.read_share, share) for share in shares] if direct is None else
            [(bw.read_share_direct, share, direct) for share in shares])
    out, elapsed = run_parallel(jobs, watch)
    files = sum(r[1] for r in out)
    nbytes = sum(r[2] for r in out)
    if files != len(paths) or nbytes != len(paths) * cfg.small_file_bytes:
        raise RuntimeError(f"parallel read got {files} files / {nbytes} bytes")
    return files / elapsed


# ---- workloads: each returns {metric: value} for one target and one repetition ------------------

def w1_checkpoint_write(t, cfg: Config, ctx: dict) -> dict:
    drop_caches()
    before = daemon_usage(t) if t.name == "tierfs" else None
    secs = write_ckpt(t, cfg)
    out = {"w1_write_MiBps": cfg.ckpt_bytes / MiB / secs}
    if before is not None:  # the daemon's cost per MiB written through the mount
        after, mib = daemon_usage(t), cfg.ckpt_bytes / MiB
        out["w1_cpu_ms_per_MiB"] = (after[0] - before[0]) * 1000 / mib
        out["w1_faults_per_MiB"] = (after[1] - before[1]) / mib
    if t.name == "tierfs":  # upload of the checkpoint (informational)
        t0 = time.monotonic()
        t.settle()
        out["w1_upload_MiBps"] = cfg.ckpt_bytes / MiB / (time.monotonic() - t0)
        # The same through tierfs.open (the direct path), to a second file.
        second = os.path.join(t.root, "ckpt-direct.bin")
        drop_caches()
        out["w1_write_direct_MiBps"] = cfg.ckpt_bytes / MiB / write_ckpt(t, cfg, second, True)
        t.settle()
        os.unlink(second)
    return out


def w2_large_read(t, cfg: Config, ctx: dict) -> dict:
    ensure_ckpt(t, cfg)
    path = ckpt_path(t)
    t.settle()
    drop_caches()
    out = {"w2_hot_MiBps": read_rate(path, cfg.ckpt_bytes)}
    out["w2_warm_MiBps"] = read_rate(path, cfg.ckpt_bytes)
    if t.name == "tierfs":
        # Served by the daemon from hot files in the page cache (the mount's own pages
        # dropped), as after a remount or a fetch: the daemon's cost per MiB, no disk.
        drop_file_pages(path)
        before = daemon_usage(t)
        out["w2_served_MiBps"] = read_rate(path, cfg.ckpt_bytes)
        after = daemon_usage(t)
        mib = cfg.ckpt_bytes / MiB
        out["w2_served_cpu_ms_per_MiB"] = (after[0] - before[0]) * 1000 / mib
        out["w2_served_faults_per_MiB"] = (after[1] - before[1]) / mib
    if t.name == "tierfs":  # the same through tierfs.open (the direct path)
        drop_caches()
        out["w2_hot_direct_MiBps"] = read_rate(path, cfg.ckpt_bytes, direct=True)
        out["w2_warm_direct_MiBps"] = read_rate(path, cfg.ckpt_bytes, direct=True)
        info = t.cold_data(path)
        if info["hot_bytes_after_release"]:
            log(f"WARNING: {info['hot_bytes_after_release']} bytes still hot after release")
        out["w2_hot_bytes_after_release"] = info["hot_bytes_after_release"]
        out["w2_cold_MiBps"] = read_rate(path, cfg.ckpt_bytes)
    return out


def w3_small_files(t, cfg: Config, ctx: dict) -> dict:
    paths = small_paths(t, cfg)
    puts = bucket_requests(t, "put")
    out = {"w3_create_fps": cfg.small_files / create_small_files(t, cfg)}
    t0 = time.monotonic()
    t.settle()
    if t.name == "tierfs":  # upload of the new files (informational), and its PUTs
        out["w3_upload_fps"] = cfg.small_files / (time.monotonic() - t0)
        data_mib4 = cfg.small_files * cfg.small_file_bytes / (4 * MiB)
        out["w3_puts_per_4MiB"] = (bucket_requests(t, "put") - puts) / data_mib4
    drop_caches()
    out["w3_read_hot_fps"] = parallel_read_rate(paths, cfg, seed=ctx["seed"] + 1)
    before = daemon_cost(t)
    cpu = CpuWatch()
    out["w3_read_warm_fps"] = parallel_read_rate(paths, cfg, seed=ctx["seed"] + 2, watch=cpu)
    after = daemon_cost(t)
    out["w3_warm_machine_busy_pct"] = cpu.result["machine_busy_pct"]
    out["w3_warm_cpu_us_per_file"] = cpu.result["cpu_s"] / len(paths) * 1e6
    if before and after and after[1] > before[1]:
        # Where the time goes: daemon CPU per FUSE request, and requests per file.
        out["w3_warm_cpu_us_per_request"] = (after[0] - before[0]) / (after[1] - before[1]) * 1e6
        out["w3_warm_requests_per_file"] = (after[1] - before[1]) / len(paths)
    if t.name == "tierfs":  # the same through tierfs.open, and open_many of 64 files
        drop_caches()
        out["w3_read_hot_direct_fps"] = parallel_read_rate(paths, cfg, ctx["seed"] + 1, 0)
        out["w3_read_warm_direct_fps"] = parallel_read_rate(paths, cfg, ctx["seed"] + 2, 0)
        cpu = CpuWatch(t.mount.pid)
        out["w3_read_warm_batch_fps"] = parallel_read_rate(paths, cfg, ctx["seed"] + 2, 64,
                                                           watch=cpu)
        out["w3_warm_batch_machine_busy_pct"] = cpu.result["machine_busy_pct"]
        out["w3_warm_batch_cpu_us_per_file"] = cpu.result["cpu_s"] / len(paths) * 1e6
        out["w3_warm_batch_loop_busy_pct"] = cpu.result["loop_busy_pct"]
        drop_caches()
        out["w3_read_hot_batch_fps"] = parallel_read_rate(paths, cfg, ctx["seed"] + 1, 64)
        # The first epoch after a remount: no hot copy verified yet on this mount.
        t.mount.remount()
        drop_caches()
        out["w3_read_hot_remount_fps"] = parallel_read_rate(paths, cfg, seed=ctx["seed"] + 3)
        # Cold: the files only in the bucket (packed), as moto answers (about 1 ms),
        # then with the first-byte latency of a real bucket added to every GET.
        root = os.path.join(t.root, "small")
        for label, latency in (("", 0.0), ("_20ms", COLD_GET_LATENCY_S)):
            with bucket_latency(t, latency):
                release_settled(t, root)
                drop_caches()
                out[f"w3_read_cold{label}_fps"] = parallel_read_rate(paths, cfg,
                                                                     seed=ctx["seed"] + 4)
    return out


def release_settled(t, root: str, limit_s: float = 300) -> None:
    """Release the hot copies under `root` and wait until the daemon has emptied their
    files (its trash thread frees their blocks in the background): the cold epoch
    that follows is measured on its own, not beside the emptying of 20,000 files
    that setting it up left behind."""
    tierfs_cli("release", "-r", root)
    deadline = time.monotonic() + limit_s
    while json.loads(tierfs_cli("status", t.root, "--json").stdout).get("trash_files"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"dropped hot copies still not emptied after {limit_s:.0f} s")
        time.sleep(0.2)


def start_cold_epoch(t, paths: list[str], order: list[int], hinted: bool) -> None:
    """Leave `paths` only in the bucket and out of the page cache, and with `hinted`
    send their epoch order as tierfs.HintingSampler does at the start of an epoch."""
    release_settled(t, os.path.commonpath(paths))
    drop_caches()
    if hinted:
        import tierfs
        tierfs.hint([paths[i] for i in order], replace=True)


def bucket_requests(t, op: str) -> int:
    """Requests of one kind the mount's daemon made to the bucket so far (0: local)."""
    if t.name != "tierfs":
        return 0
    st = json.loads(tierfs_cli("status", t.root, "--json").stdout)
    return st["counters"].get(f"s3_requests:{op}", 0)


@contextlib.contextmanager
def bucket_latency(t, seconds: float):
    """Every bucket call of the mount waits `seconds` first (its fault file) meanwhile."""
    path = os.path.join(os.path.dirname(t.mount.mountpoint), "bucket-latency.json")
    if seconds:
        with open(path, "w") as f:
            json.dump({"latency_s": seconds}, f)
    try:
        yield
    finally:
        if seconds:
            os.unlink(path)


def drop_file_pages(path: str) -> None:
    """Drop one file's cached pages (on a mount: the mount's, not the hot tier's)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def stat_fields(path: str) -> list[str]:
    """The fields of a /proc/PID[/task/TID]/stat file after the command name."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_ticks(fields: list[str]) -> int:
    """utime + stime of stat_fields(): of every thread for a process, of one for a task."""
    return int(fields[11]) + int(fields[12])


def daemon_usage(t) -> tuple[float, int]:
    """(CPU seconds, minor page faults) of the mount's daemon so far."""
    fields = stat_fields(f"/proc/{t.mount.pid}/stat")
    return cpu_ticks(fields) / os.sysconf("SC_CLK_TCK"), int(fields[7])


class CpuWatch:
    """CPU used while a workload runs, to tell a slow daemon from a full machine: the
    whole machine's CPU time (/proc/stat, every process: readers, daemon, bucket) and,
    given the daemon's pid, its own and its main thread's (the trio event loop, which
    answers every FUSE and control request). Read .result after the with-block."""

    def __init__(self, pid: int | None = None, server_pid: int | None = None):
        self.pid = pid
        self.server_pid = server_pid  # the S3 server's, where it runs on this machine
        self.result: dict = {}

    @staticmethod
    def _machine() -> tuple[int, int]:
        with open("/proc/stat") as f:  # cpu user nice system idle iowait irq softirq steal
            ticks = [int(x) for x in f.readline().split()[1:9]]
        return sum(ticks), ticks[3] + ticks[4]  # (all, idle or waiting for the disk)

    def _threads(self) -> tuple[int, int]:
        """(ticks of every thread of the daemon, ticks of its main thread)."""
        if not self.pid:
            return 0, 0
        return (cpu_ticks(stat_fields(f"/proc/{self.pid}/stat")),
                cpu_ticks(stat_fields(f"/proc/{self.pid}/task/{self.pid}/stat")))

    def _server(self) -> int:
        return cpu_ticks(stat_fields(f"/proc/{self.server_pid}/stat")) if self.server_pid else 0

    def __enter__(self) -> "CpuWatch":
        self.t0 = time.monotonic()
        self.m0, self.d0, self.s0 = self._machine(), self._threads(), self._server()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.monotonic() - self.t0
        (all1, idle1), d1 = self._machine(), self._threads()
        hz = os.sysconf("SC_CLK_TCK")
        total, idle = all1 - self.m0[0], idle1 - self.m0[1]
        self.result = {"cpu_s": (total - idle) / hz,
                       "machine_busy_pct": 100 * (total - idle) / total if total else 0.0}
        if self.pid and wall > 0:
            self.result["daemon_s"] = (d1[0] - self.d0[0]) / hz
            self.result["loop_s"] = (d1[1] - self.d0[1]) / hz
            self.result["daemon_cores"] = self.result["daemon_s"] / wall
            self.result["loop_busy_pct"] = 100 * self.result["loop_s"] / wall
        if self.server_pid and wall > 0:
            self.result["server_cores"] = (self._server() - self.s0) / hz / wall


def daemon_cost(t) -> tuple[float, int] | None:
    """(daemon CPU seconds, FUSE requests answered) so far; None for a local directory."""
    if t.name != "tierfs" or not t.mount.pid:
        return None
    cpu = daemon_usage(t)[0]
    st = json.loads(tierfs_cli("status", t.root, "--json").stdout)
    return cpu, sum(st["fuse_ops"].values())


def w4_metadata(t, cfg: Config, ctx: dict) -> dict:
    ensure_small_files(t, cfg)
    paths = small_paths(t, cfg)
    t.settle()
    t.cold_metadata()
    t0 = time.monotonic()
    for p in paths:
        os.stat(p)
    out = {"w4_stat_ops": len(paths) / (time.monotonic() - t0)}
    t.cold_metadata()
    entries = len(paths) + len(small_dirs(paths)) + 1
    t0 = time.monotonic()
    subprocess.run(["ls", "-lR", os.path.join(t.root, "small")], stdout=subprocess.DEVNULL,
                   check=True, env=dict(os.environ, LC_ALL="C"))
    out["w4_ls_eps"] = entries / (time.monotonic() - t0)
    return out


def w5_mixed(t, cfg: Config, ctx: dict) -> dict:
    ensure_ckpt(t, cfg)
    path2 = os.path.join(t.root, "ckpt-mixed.bin")
    t.settle()
    drop_caches()
    out, _ = run_parallel([(bw.stream_read, ckpt_path(t)),
                           (bw.stream_write, path2, cfg.mixed_write_bytes)])
    rates = {r[1]: r[2] / MiB / r[3] for r in out}
    result = {"w5_read_MiBps": rates["read"], "w5_write_MiBps": rates["write"]}
    if t.name == "tierfs":  # both through tierfs.open (the direct path)
        os.unlink(path2)
        t.settle()
        drop_caches()
        out, _ = run_parallel([(bw.stream_read_direct, ckpt_path(t)),
                               (bw.stream_write_direct, path2, cfg.mixed_write_bytes)])
        rates = {r[1]: r[2] / MiB / r[3] for r in out}
        result.update(w5_read_direct_MiBps=rates["read"], w5_write_direct_MiBps=rates["write"])
    return result


def calibrate_compute(loader: Loader, n: int, seed: int) -> dict:
    """Smallest-ish compute time per batch that keeps the local (warm) loop >= 99% busy."""
    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    e0 = loader.epoch(order, 0.0)  # warms the page cache and measures the loading rate
    compute = max(1.25 * e0["wall_s"] / e0["batches"], 0.0005)
    tries = []

    def busy(c: float) -> float:
        rng.shuffle(order)
        pct = loader.epoch(order, c)["busy_pct"]
        tries.append({"compute_s": c, "busy_pct": pct})
        return pct

    low = None  # the largest compute time seen below 99%
    for _ in range(12):
        if busy(compute) >= 99.0:
            break
        low, compute = compute, compute * 1.5
    for _ in range(2 if low else 0):  # narrow down between the last miss and the hit
        mid = (low * compute) ** 0.5
        if busy(mid) >= 99.0:
            compute = mid
        else:
            low = mid
    return {"compute_s": compute, "load_only_epoch_s": e0["wall_s"], "tries": tries}


def w6_training(t, cfg: Config, ctx: dict) -> dict:
    ensure_small_files(t, cfg)
    paths = small_paths(t, cfg)
    t.settle()
    rng = random.Random(ctx["seed"] + 6)
    out = {}
    loader = Loader(paths, cfg)
    try:
        if ctx.get("compute_s") is None:  # first run is on the local directory
            ctx["calibration"] = calibrate_compute(loader, len(paths), ctx["seed"])
            ctx["compute_s"] = ctx["calibration"]["compute_s"]
            log(f"W6 compute per batch calibrated to {ctx['compute_s'] * 1000:.2f} ms")
        for label in ("hot", "warm"):
            order = list(range(len(paths)))
            rng.shuffle(order)
            if label == "hot":
                drop_caches()
            e = loader.epoch(order, ctx["compute_s"])
            out[f"w6_busy_{label}_pct"] = e["busy_pct"]
            out[f"w6_{label}_epoch"] = e
        if isinstance(t, TierfsTarget):  # cold epochs: data only in the bucket
            # moto on this machine answers in about a millisecond; a real bucket takes
            # tens of milliseconds to the first byte: add that latency to every GET.
            for latency, suffix in ((COLD_GET_LATENCY_S, ""), (SLOW_GET_LATENCY_S, "_50ms")):
                with bucket_latency(t, latency):
                    for label, hinted in (("cold", False), ("cold_hinted", True)):
                        order = list(range(len(paths)))
                        rng.shuffle(order)
                        start_cold_epoch(t, paths, order, hinted)
                        # The moto server shares this machine's CPU (a real bucket would not).
                        server = moto.SERVER_PIDS.get(os.environ.get("AWS_ENDPOINT_URL", ""))
                        server = server if cfg.bucket != "file" else None
                        first = CpuWatch(t.mount.pid, server)
                        with CpuWatch(t.mount.pid, server) as cpu:
                            e = loader.epoch(order, ctx["compute_s"], first)
                        e["cpu"], e["cpu_first_batch"] = cpu.result, first.result
                        out[f"w6_busy_{label}{suffix}_pct"] = e["busy_pct"]
                        for what in ("machine_busy_pct", "loop_busy_pct", "daemon_cores",
                                     "server_cores"):
                            if what in cpu.result and what in first.result:
                                out[f"w6_{label}{suffix}_{what}"] = cpu.result[what]
                                out[f"w6_{label}{suffix}_first_{what}"] = first.result[what]
                        out[f"w6_{label}{suffix}_first_batch_s"] = e["first_batch_s"]
                        out[f"w6_{label}{suffix}_epoch"] = e
    finally:
        loader.close()
    if cfg.runs("torch") and ctx["torch"]:
        out.update(w6_torch(paths, cfg, ctx, rng))
        if isinstance(t, TierfsTarget):  # the same loader, its workers accelerated
            out.update(w6_torch(paths, cfg, ctx, rng, direct=True))
    return out


def w6_torch(paths: list[str], cfg: Config, ctx: dict, rng: random.Random,
             direct: bool = False) -> dict:
    """The same two epochs with a real torch DataLoader (persistent workers); direct:
    its workers call tierfs.accelerate() (worker_init_fn), the dataset is unchanged."""
    import warnings

    from torch.utils.data import DataLoader

    warnings.filterwarnings("ignore", message=".*worker processes in total.*")

    sampler = bw.OrderSampler(range(len(paths)))
    dl = DataLoader(bw.FileDataset(paths), batch_size=cfg.batch_size, sampler=sampler,
                    num_workers=cfg.threads, prefetch_factor=cfg.prefetch_factor,
                    persistent_workers=True, collate_fn=bw.collate_sizes,
                    worker_init_fn=bw.accelerate_worker if direct else None)
    sampler.order = list(range(cfg.batch_size))  # start the workers before the clock
    for _ in dl:
        pass
    out = {}
    for label in ("hot", "warm"):
        order = list(range(len(paths)))
        rng.shuffle(order)
        sampler.order = order
        if label == "hot":
            drop_caches()
        busy, t0 = 0.0, time.monotonic()
        for _batch in dl:
            tc = time.monotonic()
            time.sleep(ctx["compute_s"])
            busy += time.monotonic() - tc
        key = f"w6_torch_direct_busy_{label}_pct" if direct else f"w6_torch_busy_{label}_pct"
        out[key] = 100 * busy / (time.monotonic() - t0)
    del dl
    return out


def w7_torch_checkpoint(t, cfg: Config, ctx: dict) -> dict:
    """A model's state dict (float32 tensors, half the W1 size) saved with torch.save and
    fsync, and loaded back hot (page cache dropped); on tierfs also through tierfs.open,
    and with torch.distributed.checkpoint: FileSystemWriter on the local directory,
    FsspecWriter on a tierfs:// URL (fsync per file in both)."""
    if not ctx["torch"]:
        return {}
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    n_layers = 16
    per = cfg.ckpt_bytes // 2 // n_layers // 4  # float32 elements per tensor
    gen = torch.Generator().manual_seed(ctx["seed"])
    state = {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(n_layers)}
    nbytes = n_layers * per * 4
    out = {}

    def timed(fn) -> float:
        t0 = time.monotonic()
        fn()
        return nbytes / MiB / (time.monotonic() - t0)

    def save(path, opener):
        def run():
            with opener(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        return run

    def load(path, opener):
        def run():
            with opener(path, "rb") as f:
                got = torch.load(f)
            assert torch.equal(got["layer0.weight"], state["layer0.weight"])
        return run

    import tierfs
    openers = [("", open)] + ([("_direct", tierfs.open)] if t.name == "tierfs" else [])
    for suffix, opener in openers:
        path = os.path.join(t.root, f"model{suffix}.pt")
        drop_caches()
        out[f"w7_save{suffix}_MiBps"] = timed(save(path, opener))
        t.settle()
        drop_caches()
        out[f"w7_load{suffix}_MiBps"] = timed(load(path, opener))
        os.unlink(path)
    where = os.path.join(t.root, "dcp")
    writer = (FsspecWriter(f"tierfs://{where}") if t.name == "tierfs"
              else FileSystemWriter(where))
    drop_caches()
    out["w7_dcp_save_MiBps"] = timed(lambda: dcp.save(state, storage_writer=writer, no_dist=True))
    t.settle()
    drop_caches()
    target = {k: torch.empty_like(v) for k, v in state.items()}
    reader = (FsspecReader(f"tierfs://{where}") if t.name == "tierfs"
              else FileSystemReader(where))
    out["w7_dcp_load_MiBps"] = timed(lambda: dcp.load(target, storage_reader=reader, no_dist=True))
    assert torch.equal(target["layer0.weight"], state["layer0.weight"])
    shutil.rmtree(where)
    return out


WORKLOAD_FUNCS = [("W1", w1_checkpoint_write), ("W2", w2_large_read), ("W3", w3_small_files),
                  ("W4", w4_metadata), ("W5", w5_mixed), ("W6", w6_training),
                  ("W7", w7_torch_checkpoint)]


def run_workloads(t, cfg: Config, ctx: dict, out: dict) -> None:
    """Run the workloads on one target, adding their figures to `out` as they come."""
    for name, fn in WORKLOAD_FUNCS:
        if not cfg.runs(name):
            continue
        t0 = time.monotonic()
        res = fn(t, cfg, ctx)
        out.update(res)
        shown = ", ".join(f"{k}={v:.1f}" for k, v in res.items() if isinstance(v, float))
        log(f"  {t.name} {name} ({time.monotonic() - t0:.1f}s): {shown}")


# ---- metadata scale ---------------------------------------------------------------------------

def scale_paths(root: str, n: int, dirs: int):
    """Paths of n empty files spread over `dirs` directories, directory by directory."""
    for d in range(dirs):
        for j in range(d, n, dirs):
            yield os.path.join(root, f"d{d:04d}", f"f{j:07d}")


def scale_one(n: int, cfg: Config, workdir: str, stack: contextlib.ExitStack) -> dict:
    base = os.path.join(workdir, f"scale-{n}")
    m = TierfsMount(f"file://{base}/bucket", base)
    stack.callback(m.cleanup)
    out: dict = {"files": n, "mount_s": [], "stat_ops": [], "rss_MiB": [], "rss_anon_MiB": [],
                 "memory": []}
    try:
        m.mount()
        t0 = time.monotonic()
        for d in range(cfg.scale_dirs):
            os.mkdir(os.path.join(m.mountpoint, f"d{d:04d}"))
        for p in scale_paths(m.mountpoint, n, cfg.scale_dirs):
            os.close(os.open(p, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644))
        out["create_fps"] = n / (time.monotonic() - t0)
        m.umount()
        out["create_daemon_rss_MiB"] = m.peak_rss_mib
        out["create_daemon_memory"] = m.memory
        for _ in range(cfg.reps):
            drop_caches()
            out["mount_s"].append(m.mount())
            t0 = time.monotonic()
            count = sum(1 for p in scale_paths(m.mountpoint, n, cfg.scale_dirs) if os.stat(p))
            out["stat_ops"].append(count / (time.monotonic() - t0))
            out["rss_MiB"].append(m.record_rss())
            out["rss_anon_MiB"].append(m.memory.get("RssAnon"))
            out["memory"].append(m.memory)
            m.umount()
        log(f"  scale {n} files: create {out['create_fps']:.0f}/s, "
            f"mount {median(out['mount_s']):.2f}s, stat {median(out['stat_ops']):.0f}/s, "
            f"RSS {median(out['rss_MiB']):.0f} MiB")
        out["log_problems"] = m.log_problems()[:20]
    finally:
        m.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    return out


PACKED_FILE_BYTES = 4 * KiB


def bucket_usage(root: str) -> tuple[int, int]:
    """(objects, bytes) under the data/ prefix of a file:// bucket."""
    count = size = 0
    for dirpath, _dirs, files in os.walk(os.path.join(root, "data")):
        for name in files:
            count += 1
            size += os.path.getsize(os.path.join(dirpath, name))
    return count, size


def pack_scale(cfg: Config, workdir: str, stack: contextlib.ExitStack) -> dict:
    """Many small files packed: objects and PUTs per file, then bucket bytes over live
    bytes once half of the files are deleted and compaction and gc are done."""
    n = cfg.scale_files
    base = os.path.join(workdir, "packscale")
    bucket = os.path.join(base, "bucket")
    m = TierfsMount(f"file://{bucket}", base, extra_args=("--checkpoint-keep", "1"))
    stack.callback(m.cleanup)
    data = os.urandom(PACKED_FILE_BYTES)
    out: dict = {"files": n}
    try:
        m.mount()
        t0 = time.monotonic()
        for d in range(cfg.scale_dirs):
            os.mkdir(os.path.join(m.mountpoint, f"d{d:04d}"))
        paths = list(scale_paths(m.mountpoint, n, cfg.scale_dirs))
        for p in paths:
            with open(p, "wb", buffering=0) as f:
                f.write(data)
        tierfs_cli("sync", m.mountpoint, "--wait", timeout=3600)
        out["create_upload_fps"] = n / (time.monotonic() - t0)
        st = json.loads(tierfs_cli("status", m.mountpoint, "--json").stdout)
        out["puts_per_file"] = st["counters"].get("uploads", 0) / n
        out["objects"], out["bucket_bytes"] = bucket_usage(bucket)
        for p in paths[::2]:
            os.unlink(p)
        live = (n - len(paths[::2])) * PACKED_FILE_BYTES
        t0 = time.monotonic()
        deadline = t0 + 3600
        while time.monotonic() < deadline:  # until compaction and gc have nothing left
            tierfs_cli("sync", m.mountpoint, "--wait", timeout=600)  # checkpoints: gc may go
            st = json.loads(tierfs_cli("status", m.mountpoint, "--json").stdout)
            if (st["gc_backlog_objects"] == 0 and st["pack_bytes"]
                    and st["pack_live_bytes"] / st["pack_bytes"] >= 0.75):
                break
            time.sleep(2)
        out["compact_s"] = time.monotonic() - t0
        out["objects_after"], out["bucket_bytes_after"] = bucket_usage(bucket)
        out["live_bytes_after"] = live
        out["bucket_over_live"] = out["bucket_bytes_after"] / live
        out["compacted_bytes"] = st["counters"].get("compacted_bytes", 0)
        log(f"  packed {n} files: {out['objects']} objects, {out['puts_per_file']:.4f} PUTs per "
            f"file; after deleting half: bucket/live {out['bucket_over_live']:.2f} "
            f"({out['compact_s']:.0f}s)")
        out["log_problems"] = m.log_problems()[:20]
    finally:
        m.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    return out


def scale_test(cfg: Config, workdir: str, stack: contextlib.ExitStack) -> dict:
    return {"ref": scale_one(cfg.scale_ref_files, cfg, workdir, stack),
            "big": scale_one(cfg.scale_files, cfg, workdir, stack)}


# ---- the run ------------------------------------------------------------------------------------

def torch_available() -> bool:
    try:
        import torch  # noqa: F401
        return True
    except Exception:
        return False


def run_rep(rep: int, cfg: Config, workdir: str, ctx: dict, stack, out: dict) -> None:
    """One repetition: every workload on the local directory, then on a fresh tierfs."""
    out.update(rep=rep, local={}, tierfs={})
    log(f"repetition {rep + 1}/{cfg.reps}: local directory")
    local = LocalTarget(os.path.join(workdir, f"local-r{rep}"))
    try:
        run_workloads(local, cfg, ctx, out["local"])
    finally:
        shutil.rmtree(local.root, ignore_errors=True)
    if ctx.get("raw_keys"):
        out["rawget_MiBps"] = raw_get_rate(cfg, ctx["raw_keys"])
        log(f"  S3 raw GET x{cfg.threads}: {out['rawget_MiBps']:.1f} MiB/s")
    log(f"repetition {rep + 1}/{cfg.reps}: tierfs")
    base = os.path.join(workdir, f"tierfs-r{rep}")
    faults = os.path.join(base, "bucket-latency.json")
    url = f"file://{base}/bucket" if cfg.bucket == "file" else f"s3://{BUCKET}/r{rep}"
    mount = TierfsMount(url, base,
                        extra_args=("--fault-file", faults, *cfg.mount_args))
    stack.callback(mount.cleanup)
    try:
        mount.mount()
        run_workloads(TierfsTarget(mount), cfg, ctx, out["tierfs"])
        mount.umount()
        out["tierfs"]["daemon_peak_rss_MiB"] = mount.peak_rss_mib
        out["tierfs"]["daemon_memory_at_end"] = mount.memory
        out["daemon_log_problems"] = mount.log_problems()[:20]
        for line in out["daemon_log_problems"][:5]:
            log(f"  daemon log: {line}")
    finally:
        mount.cleanup()
        with contextlib.suppress(Exception):  # frees the S3 server's memory
            delete_prefix(BUCKET, f"r{rep}/")
        shutil.rmtree(base, ignore_errors=True)


def run_all(cfg: Config, workdir: str, results: dict, stack: contextlib.ExitStack) -> None:
    endpoint = stack.enter_context(moto.moto_server(ranges=cfg.bucket == "moto-ranges"))
    os.environ.update(s3_env(endpoint))
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    make_bucket(endpoint, BUCKET)
    make_bucket(endpoint, RAW_BUCKET)
    log(f"moto S3 server at {endpoint}; work dir {workdir}")
    ctx = results["context"] = {"seed": 1234, "torch": torch_available(),
                                "compute_s": cfg.compute_s}
    if not ctx["torch"] and cfg.runs("W6") and cfg.runs("torch"):
        log("W6 with torch DataLoader: skipped (import torch failed)")
    if cfg.runs("W2"):
        ctx["raw_keys"] = upload_raw_objects(cfg)
    for rep in range(cfg.reps):
        results["reps"].append({})
        run_rep(rep, cfg, workdir, ctx, stack, results["reps"][-1])
    if cfg.runs("scale"):
        log("metadata scale test")
        results["scale"] = scale_test(cfg, workdir, stack)
    if cfg.runs("packscale"):
        log("packed small files at scale")
        results["packscale"] = pack_scale(cfg, workdir, stack)


# ---- report -------------------------------------------------------------------------------------

@dataclass
class Row:
    name: str
    unit: str
    ref: list            # samples of the reference (ref_name)
    val: list            # samples of tierfs
    check: str = ""      # "ratio" | "value" | "" (informational)
    op: str = ">="
    target: float = 0.0
    ref_name: str = "local"
    ref_median: float | None = None
    val_median: float | None = None
    ratio: float | None = None
    passed: bool | None = None

    def evaluate(self) -> "Row":
        self.ref_median, self.val_median = median(self.ref), median(self.val)
        if self.ref_median and self.val_median is not None:
            self.ratio = self.val_median / self.ref_median
        x = self.ratio if self.check == "ratio" else self.val_median
        if self.check and x is not None:
            self.passed = x >= self.target if self.op == ">=" else x < self.target
        return self

    def target_text(self) -> str:
        if not self.check:
            return "(info)"
        what = "ratio" if self.check == "ratio" else "tierfs"
        return f"{what} {self.op} {self.target:g}"


def w6_cpu_specs(latency: str, suffix: str) -> list[tuple]:
    """Rows of where the CPU went in a hinted cold W6 epoch (`suffix`: of its keys)."""
    key = f"w6_cold_hinted{suffix}"
    rows = [(f"W6 cold + hint, {latency}: machine CPU busy", "%", f"{key}_machine_busy_pct"),
            ("W6 same: daemon CPU", "cores", f"{key}_daemon_cores"),
            ("W6 same: daemon event loop busy", "%", f"{key}_loop_busy_pct"),
            ("W6 same, first batch: wait", "s", f"{key}_first_batch_s"),
            ("W6 same, first batch: machine CPU busy", "%", f"{key}_first_machine_busy_pct"),
            ("W6 same, first batch: daemon CPU", "cores", f"{key}_first_daemon_cores"),
            ("W6 same, first batch: daemon event loop busy", "%",
             f"{key}_first_loop_busy_pct"),
            ("W6 same: S3 server CPU (moto)", "cores", f"{key}_server_cores"),
            ("W6 same, first batch: S3 server CPU", "cores", f"{key}_first_server_cores")]
    return [(*row, "", ">=", 0) for row in rows]  # informational


def build_rows(results: dict) -> list[Row]:
    reps = results["reps"]

    def s(target: str, key: str) -> list:
        return [r[target][key] for r in reps if key in r.get(target, {})]

    raw = [r["rawget_MiBps"] for r in reps if "rawget_MiBps" in r]
    specs = [
        ("W1 checkpoint write+fsync", "MiB/s", "w1_write_MiBps", "ratio", ">=", 0.7),
        ("W1 checkpoint write+fsync, tierfs.open", "MiB/s", "w1_write_direct_MiBps", "ratio",
         ">=", 0.9, "w1_write_MiBps"),
        ("W1 same: daemon CPU per MiB", "ms", "w1_cpu_ms_per_MiB", "", ">=", 0),
        ("W1 same: daemon page faults per MiB", "faults", "w1_faults_per_MiB", "", ">=", 0),
        ("W1 upload (sync --wait)", "MiB/s", "w1_upload_MiBps", "", ">=", 0),
        ("W2 read hot (cache dropped)", "MiB/s", "w2_hot_MiBps", "ratio", ">=", 0.8),
        ("W2 read warm (page cache)", "MiB/s", "w2_warm_MiBps", "ratio", ">=", 0.8),
        ("W2 read, hot tier in page cache", "MiB/s", "w2_served_MiBps", "", ">=", 0),
        ("W2 same: daemon CPU per MiB", "ms", "w2_served_cpu_ms_per_MiB", "", ">=", 0),
        ("W2 same: daemon page faults per MiB", "faults", "w2_served_faults_per_MiB", "",
         ">=", 0),
        ("W2 read hot, tierfs.open", "MiB/s", "w2_hot_direct_MiBps", "ratio", ">=", 0.9,
         "w2_hot_MiBps"),
        ("W2 read warm, tierfs.open", "MiB/s", "w2_warm_direct_MiBps", "ratio", ">=", 0.9,
         "w2_warm_MiBps"),
        ("W3 create 64 KiB files", "files/s", "w3_create_fps", "ratio", ">=", 0.25),
        ("W3 upload (sync --wait)", "files/s", "w3_upload_fps", "", ">=", 0),
        ("W3 upload: PUTs per 4 MiB of files", "req", "w3_puts_per_4MiB", "value", "<", 1),
        ("W3 read x8 cold (from bucket)", "files/s", "w3_read_cold_fps", "value", ">=", 1500),
        ("W3 read x8 cold, 20 ms GETs", "files/s", "w3_read_cold_20ms_fps", "value", ">=",
         1500),
        ("W3 read x8 hot", "files/s", "w3_read_hot_fps", "ratio", ">=", 0.5),
        ("W3 read x8 warm", "files/s", "w3_read_warm_fps", "ratio", ">=", 0.5),
        ("W3 read x8 hot, after remount", "files/s", "w3_read_hot_remount_fps", "ratio", ">=",
         0.5, "w3_read_hot_fps"),
        ("W3 read x8 hot, tierfs.open", "files/s", "w3_read_hot_direct_fps", "ratio", ">=",
         0.9, "w3_read_hot_fps"),
        ("W3 read x8 warm, tierfs.open", "files/s", "w3_read_warm_direct_fps", "ratio", ">=",
         0.9, "w3_read_warm_fps"),
        ("W3 read x8 hot, open_many(64)", "files/s", "w3_read_hot_batch_fps", "ratio", ">=",
         0.9, "w3_read_hot_fps"),
        ("W3 read x8 warm, open_many(64)", "files/s", "w3_read_warm_batch_fps", "ratio", ">=",
         0.9, "w3_read_warm_fps"),
        ("W3 warm: machine CPU per file", "us", "w3_warm_cpu_us_per_file", "", ">=", 0),
        ("W3 warm: machine CPU busy", "%", "w3_warm_machine_busy_pct", "", ">=", 0),
        ("W3 warm open_many(64): machine CPU per file", "us", "w3_warm_batch_cpu_us_per_file",
         "", ">=", 0, "w3_warm_cpu_us_per_file"),
        ("W3 warm open_many(64): machine CPU busy", "%", "w3_warm_batch_machine_busy_pct", "",
         ">=", 0, "w3_warm_machine_busy_pct"),
        ("W3 warm open_many(64): daemon event loop busy", "%", "w3_warm_batch_loop_busy_pct",
         "", ">=", 0),
        ("W3 warm: daemon CPU per FUSE request", "us", "w3_warm_cpu_us_per_request", "", ">=", 0),
        ("W3 warm: FUSE requests per file", "req", "w3_warm_requests_per_file", "", ">=", 0),
        ("W4 stat, caches cold", "ops/s", "w4_stat_ops", "ratio", ">=", 0.25),
        ("W4 ls -lR, caches cold", "entries/s", "w4_ls_eps", "ratio", ">=", 0.25),
        ("W5 mixed: read", "MiB/s", "w5_read_MiBps", "ratio", ">=", 0.6),
        ("W5 mixed: write+fsync", "MiB/s", "w5_write_MiBps", "ratio", ">=", 0.6),
        ("W5 mixed: read, tierfs.open", "MiB/s", "w5_read_direct_MiBps", "ratio", ">=", 0.8,
         "w5_read_MiBps"),
        ("W5 mixed: write+fsync, tierfs.open", "MiB/s", "w5_write_direct_MiBps", "ratio",
         ">=", 0.8, "w5_write_MiBps"),
        ("W6 busy, hot epoch", "%", "w6_busy_hot_pct", "value", ">=", 90),
        ("W6 busy, warm epoch", "%", "w6_busy_warm_pct", "value", ">=", 95),
        ("W6 busy, cold epoch, 20 ms GETs", "%", "w6_busy_cold_pct", "", ">=", 0),
        ("W6 busy, same + tierfs.hint", "%", "w6_busy_cold_hinted_pct", "", ">=", 0),
        ("W6 busy, cold epoch, 50 ms GETs", "%", "w6_busy_cold_50ms_pct", "", ">=", 0),
        ("W6 busy, same + tierfs.hint", "%", "w6_busy_cold_hinted_50ms_pct", "", ">=", 0),
        *w6_cpu_specs("20 ms", ""),
        *w6_cpu_specs("50 ms", "_50ms"),
        ("W7 torch.save+fsync", "MiB/s", "w7_save_MiBps", "ratio", ">=", 0.7),
        ("W7 torch.save+fsync, tierfs.open", "MiB/s", "w7_save_direct_MiBps", "ratio", ">=",
         0.9, "w7_save_MiBps"),
        ("W7 torch.load hot", "MiB/s", "w7_load_MiBps", "ratio", ">=", 0.8),
        ("W7 torch.load hot, tierfs.open", "MiB/s", "w7_load_direct_MiBps", "ratio", ">=", 0.9,
         "w7_load_MiBps"),
        ("W7 DCP save (tierfs:// fsspec)", "MiB/s", "w7_dcp_save_MiBps", "ratio", ">=", 0.9),
        ("W7 DCP load hot (tierfs:// fsspec)", "MiB/s", "w7_dcp_load_MiBps", "ratio", ">=",
         0.9),
        ("W6 torch busy, hot epoch", "%", "w6_torch_busy_hot_pct", "value", ">=", 90),
        ("W6 torch busy, warm epoch", "%", "w6_torch_busy_warm_pct", "value", ">=", 95),
        ("W6 torch busy, hot, accelerate()", "%", "w6_torch_direct_busy_hot_pct", "value",
         ">=", 90, "w6_torch_busy_hot_pct"),
        ("W6 torch busy, warm, accelerate()", "%", "w6_torch_direct_busy_warm_pct", "value",
         ">=", 95, "w6_torch_busy_warm_pct"),
    ]
    rows = []
    for name, unit, key, check, op, target, *ref_key in specs:
        # A direct-path row compares with the local figure of its plain workload.
        ref, val = s("local", ref_key[0] if ref_key else key), s("tierfs", key)
        if val:
            rows.append(Row(name, unit, ref, val, check, op, target,
                            ref_name="local" if ref else "-"))
        if key == "w2_warm_MiBps" and s("tierfs", "w2_cold_MiBps"):
            rows.append(Row("W2 read cold (from bucket)", "MiB/s", raw,
                            s("tierfs", "w2_cold_MiBps"), "ratio", ">=", 0.8,
                            ref_name="raw GET x8"))
    rss = s("tierfs", "daemon_peak_rss_MiB")
    if rss:
        rows.append(Row("daemon peak RSS (W1-W6)", "MiB", [], rss, "value", "<", 300,
                        ref_name="-"))
    sc = results.get("scale")
    if sc:
        ref, big = sc["ref"], sc["big"]
        n, rn = f"{big['files']:,}", f"{ref['files']:,}"
        rows += [
            Row(f"scale: create empty files ({n})", "files/s", [ref["create_fps"]],
                [big["create_fps"]], ref_name=f"{rn} files"),
            Row(f"scale: mount time ({n} files)", "s", ref["mount_s"], big["mount_s"],
                "value", "<", 2.0, ref_name=f"{rn} files"),
            Row(f"scale: stat, attr cache cold ({n})", "ops/s", ref["stat_ops"],
                big["stat_ops"], "ratio", ">=", 0.8, ref_name=f"{rn} files"),
            Row(f"scale: daemon peak RSS ({n} files)", "MiB", ref["rss_MiB"], big["rss_MiB"],
                "value", "<", 300, ref_name=f"{rn} files"),
            Row(f"scale: daemon RssAnon after stat ({n})", "MiB", ref["rss_anon_MiB"],
                big["rss_anon_MiB"], ref_name=f"{rn} files"),
            Row(f"scale: creating daemon peak RSS ({n})", "MiB",
                [ref["create_daemon_rss_MiB"]], [big["create_daemon_rss_MiB"]],
                ref_name=f"{rn} files"),
        ]
    ps = results.get("packscale")
    if ps:
        n = f"{ps['files']:,}"
        rows += [
            Row(f"packed: objects in the bucket ({n} x 4 KiB)", "objects", [], [ps["objects"]],
                ref_name="-"),
            Row(f"packed: uploads per 1,000 files ({n})", "PUT", [],
                [ps["puts_per_file"] * 1000], ref_name="-"),
            Row(f"packed: bucket / live bytes, half deleted ({n})", "x", [],
                [ps["bucket_over_live"]], "value", "<", 1.34, ref_name="-"),
        ]
    return [r.evaluate() for r in rows]


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def format_table(rows: list[Row]) -> str:
    head = ("row", "unit", "reference", "ref", "tierfs", "ratio", "target", "result")
    lines = [head]
    for r in rows:
        result = "" if r.passed is None else ("PASS" if r.passed else "FAIL")
        lines.append((r.name, r.unit, r.ref_name, fmt(r.ref_median), fmt(r.val_median),
                      "-" if r.ratio is None else f"{r.ratio:.2f}", r.target_text(), result))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    right = {3, 4, 5}
    out = []
    for j, line in enumerate(lines):
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells).rstrip())
        if j == 0:
            out.append("-" * len(out[0]))
    return "\n".join(out)


def machine_info(workdir: str) -> dict:
    info = {"nproc": os.cpu_count(), "nproc_usable": len(os.sched_getaffinity(0)),
            "kernel": platform.release(), "python": platform.python_version(),
            "hostname": platform.node()}
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            info["ram_GiB"] = round(int(f.readline().split()[1]) / 1024 / 1024, 1)
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu"] = models[0] if models else platform.machine()
    info["disk"] = disk_info(workdir)
    with contextlib.suppress(Exception):
        from tierfs import __version__
        info["tierfs_version"] = __version__
    with contextlib.suppress(OSError):
        head = open(os.path.join(REPO, ".git", "HEAD")).read().strip()
        if head.startswith("ref: "):
            head = open(os.path.join(REPO, ".git", head[5:])).read().strip()
        info["git_commit"] = head
    return info


def disk_info(path: str) -> dict:
    st = os.stat(path)
    d = {"path": path, "dev": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"}
    with contextlib.suppress(OSError):
        best = ""
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                mp, rest = parts[4], parts[parts.index("-") + 1:]
                if path.startswith(mp.rstrip("/") + "/") and len(mp) > len(best):
                    best = mp
                    d.update(mount=mp, fstype=rest[0], source=rest[1])
    with contextlib.suppress(OSError):
        sysdev = os.path.realpath(f"/sys/dev/block/{d['dev']}")
        name = os.path.basename(sysdev)
        if os.path.exists(os.path.join(sysdev, "partition")):
            sysdev = os.path.dirname(sysdev)
        d["block_device"] = name
        for key, rel in (("rotational", "queue/rotational"), ("model", "device/model")):
            with contextlib.suppress(OSError):
                d[key] = open(os.path.join(sysdev, rel)).read().strip()
        d["size_GiB"] = round(int(open(os.path.join(sysdev, "size")).read()) * 512 / GiB, 1)
    du = shutil.disk_usage(path)
    d["free_GiB"] = round(du.free / GiB, 1)
    return d


def print_report(results: dict, rows: list[Row], cfg: Config) -> None:
    m = results["machine"]
    print()
    print(f"tierfs benchmark  {results['date']}  ({'quick' if cfg.quick else 'full'}, "
          f"{cfg.reps} reps, medians)")
    print(f"machine: {m.get('nproc')} CPUs ({m.get('cpu', '?')}), {m.get('ram_GiB')} GiB RAM, "
          f"kernel {m.get('kernel')}, disk {m['disk'].get('source', '?')} "
          f"({m['disk'].get('fstype', '?')}, rotational={m['disk'].get('rotational', '?')})")
    print(f"sizes: checkpoint {cfg.ckpt_bytes // MiB} MiB, W5 write "
          f"{cfg.mixed_write_bytes // MiB} MiB, {cfg.small_files:,} x "
          f"{cfg.small_file_bytes // KiB} KiB files, scale {cfg.scale_files:,} files")
    print("tierfs bucket: " + {
        "file": "a file:// directory on the same disk",
        "moto-ranges": "the moto S3 server on this machine, reading only the range of a "
                       "ranged GET (tests/moto_ranges.py)",
    }.get(cfg.bucket, "the moto S3 server on this machine"))
    ctx = results.get("context", {})
    cal = ctx.get("calibration")
    if cal:
        print(f"W6 compute per batch: {cal['compute_s'] * 1000:.2f} ms (calibrated on the "
              f"local directory, warm)")
    elif ctx.get("compute_s"):
        print(f"W6 compute per batch: {ctx['compute_s'] * 1000:.2f} ms (--compute-ms)")
    if cfg.runs("W6") and cfg.runs("torch") and not ctx.get("torch"):
        print("W6 with torch DataLoader: skipped (torch is not installed)")
    if results.get("drop_caches") is False:
        print("WARNING: the page cache could not be dropped: 'hot' and 'cold' rows are warm")
    print()
    print(format_table(rows) if rows else "(no results)")
    failed = [r.name for r in rows if r.passed is False]
    print()
    print(f"{sum(r.passed is True for r in rows)} PASS, {len(failed)} FAIL"
          f"; total runtime {results['total_runtime_s']:.0f} s")
    if results.get("error"):
        print(f"RUN FAILED: {results['error'].strip().splitlines()[-1]}")


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small sizes (512 MiB checkpoint, 4,000 files, 20k scale files), 2 reps")
    p.add_argument("--reps", type=int, default=0, help="repetitions (default 3, quick 2)")
    p.add_argument("--out", help="JSON file for all raw figures "
                   "(default bench-results/bench-DATE.json in the repository)")
    p.add_argument("--size-scale", type=float, default=1.0,
                   help="multiply data sizes and file counts by this")
    p.add_argument("--workdir", help="directory on the disk to test (default: a new directory "
                   "in $TMPDIR or /var/tmp); local dir, hot tier and mounts go below it")
    p.add_argument("--skip", nargs="+", default=[], choices=WORKLOADS, metavar="W",
                   help=f"workloads to skip: {' '.join(WORKLOADS)}")
    p.add_argument("--mount-args", default="",
                   help="extra `tierfs mount` flags for the tierfs side, e.g. '--no-writeback-cache'")
    p.add_argument("--bucket", choices=("moto", "moto-ranges", "file"), default="moto",
                   help="bucket of the tierfs side: the moto S3 server (default); the same "
                   "server reading only the range of a ranged GET (moto-ranges: stock moto "
                   "reads a whole object for every ranged GET, a real S3 does not); or a "
                   "file:// directory on the same disk"),
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="W6 compute per batch in ms instead of calibrating it on the local "
                   "directory (the calibration follows the machine's speed of the moment: "
                   "set it to compare two versions)")
    return p.parse_args(argv)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupt(signum, frame):
    """Stop the run on the first signal; ignore further ones so cleanup completes."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = make_config(args)
    if os.geteuid() != 0:
        print("bench.py needs root (FUSE mounts, dropping the page cache)", file=sys.stderr)
        return 2
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_interrupt)
    started = time.monotonic()
    date = datetime.datetime.now().astimezone()
    out_path = args.out or os.path.join(REPO, "bench-results",
                                         f"bench-{date.strftime('%Y%m%d-%H%M%S')}.json")
    parent = args.workdir or os.environ.get("TMPDIR") or "/var/tmp"
    os.makedirs(parent, exist_ok=True)
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="tierfs-bench-", dir=parent))
    results: dict = {"command": [sys.executable, *sys.argv], "date": date.isoformat(),
                     "config": dataclasses.asdict(cfg), "machine": machine_info(workdir),
                     "reps": []}
    if results["machine"]["disk"].get("fstype") == "tmpfs":
        log(f"WARNING: {workdir} is on tmpfs: 'local' is memory, not a disk")
    rc = 0
    try:
        with contextlib.ExitStack() as stack:
            run_all(cfg, workdir, results, stack)
    except KeyboardInterrupt:
        results["error"] = "interrupted"
        log("interrupted: cleaning up")
        rc = 130
    except Exception:
        results["error"] = traceback.format_exc()
        log(f"ERROR:\n{results['error']}")
        rc = 1
    finally:
        left = [m for m in mounts() if m.startswith(workdir + "/")]
        if left:  # never delete through a mount that could not be removed
            log(f"WARNING: still mounted, {workdir} kept: {' '.join(left)}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        results["drop_caches"] = _drop_ok
        results["total_runtime_s"] = time.monotonic() - started
        rows = build_rows(results)
        results["rows"] = [dataclasses.asdict(r) for r in rows]
        print_report(results, rows, cfg)
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"raw figures: {out_path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
