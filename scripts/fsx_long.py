#!/usr/bin/env python3
"""Long fsx runs against real tierfs mounts (the exerciser of tests/fsx.py).

Mounts tierfs itself (a moto S3 server of its own for the s3 configurations, a
PostgreSQL server of its own for the pg ones: a schema per run as its namespace),
runs the exerciser for --ops ops per configuration and seed, then a full
verify, a remount and a full verify again. Prints one line per run (config,
seed, ops done, ops/s, outcome, counters from `tierfs status --json`), writes
a JSON summary to --out, and exits non-zero if any run failed. Mounts and the
moto server are always torn down, also on Ctrl-C or failure.

Run from the repository root:
    .venv/bin/python scripts/fsx_long.py                       # everything, 100000 ops
    .venv/bin/python scripts/fsx_long.py --configs s3-16m-64m-wb --seeds 1,2 --ops 20000
    .venv/bin/python scripts/fsx_long.py --list
Needs root and /dev/fuse.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from contextlib import ExitStack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.fsx import (DEFAULT_WEIGHTS, DIRECT_WEIGHTS, LEGACY_WEIGHTS,  # noqa: E402
                       MMAP_HEAVY_WEIGHTS, Fsx, FsxFailure, MiB)
from tests.harness import Mount  # noqa: E402
from tests.moto_server import make_bucket, moto_server, s3_env  # noqa: E402
from tests.pg_server import pg_server  # noqa: E402

WEIGHTS = {"default": DEFAULT_WEIGHTS, "mmap-heavy": MMAP_HEAVY_WEIGHTS,
           "legacy": LEGACY_WEIGHTS, "direct": DIRECT_WEIGHTS}

# name -> backend, mount args, file size, extent size (must match the mount), weights;
# meta="pg": the namespace in PostgreSQL (--meta-url)
CONFIGS: dict[str, dict] = {
    # The bug report: S3, 16 MiB hot tier, one 64 MiB file, 4 MiB extents.
    "s3-16m-64m-wb": dict(backend="s3", file_mib=64, extent_mib=4, weights="default",
                          args=["--cache-size", "16M", "--upload-delay", "0.2",
                                "--checkpoint-interval", "0"]),
    "s3-16m-64m-nowb": dict(backend="s3", file_mib=64, extent_mib=4, weights="default",
                            args=["--cache-size", "16M", "--upload-delay", "0.2",
                                  "--checkpoint-interval", "0", "--no-writeback-cache"]),
    # The msync ENOSPC report: file://, 16 MiB hot tier, 64 MiB file, mostly mmap writes.
    "file-16m-64m-mmap": dict(backend="file", file_mib=64, extent_mib=4, weights="mmap-heavy",
                              args=["--cache-size", "16M", "--upload-delay", "0.2",
                                    "--checkpoint-interval", "0"]),
    "file-16m-64m-mmap-nowb": dict(backend="file", file_mib=64, extent_mib=4,
                                   weights="mmap-heavy",
                                   args=["--cache-size", "16M", "--upload-delay", "0.2",
                                         "--checkpoint-interval", "0",
                                         "--no-writeback-cache"]),
    # 1 MiB extents, a hot tier of four of them, a 24 MiB file (the CI regime, longer).
    "s3-1m-4m-24m": dict(backend="s3", file_mib=24, extent_mib=1, weights="default",
                         args=["--extent-size", "1M", "--cache-size", "4M",
                               "--upload-delay", "0.05", "--checkpoint-interval", "0"]),
    "s3-1m-4m-24m-nowb": dict(backend="s3", file_mib=24, extent_mib=1, weights="default",
                              args=["--extent-size", "1M", "--cache-size", "4M",
                                    "--upload-delay", "0.05", "--checkpoint-interval", "0",
                                    "--no-writeback-cache"]),
    "file-1m-4m-24m": dict(backend="file", file_mib=24, extent_mib=1, weights="default",
                           args=["--extent-size", "1M", "--cache-size", "4M",
                                 "--upload-delay", "0.05", "--checkpoint-interval", "1"]),
    # The same on a shared namespace (the writeback cache is off there), as CI's
    # pg-file-wb-4M regime, longer.
    "pg-file-1m-4m-24m": dict(backend="file", meta="pg", file_mib=24, extent_mib=1,
                              weights="default",
                              args=["--extent-size", "1M", "--cache-size", "4M",
                                    "--upload-delay", "0.05", "--checkpoint-interval", "0"]),
    # The direct path's reads and writes between the mount's ops, on a hot tier a sixth
    # of the file (evictions under held descriptors), with and without the writeback cache.
    "s3-1m-4m-24m-direct": dict(backend="s3", file_mib=24, extent_mib=1, weights="direct",
                                args=["--extent-size", "1M", "--cache-size", "4M",
                                      "--upload-delay", "0.05", "--checkpoint-interval", "0"]),
    "file-1m-4m-24m-direct-nowb": dict(backend="file", file_mib=24, extent_mib=1,
                                       weights="direct",
                                       args=["--extent-size", "1M", "--cache-size", "4M",
                                             "--upload-delay", "0.05",
                                             "--checkpoint-interval", "1",
                                             "--no-writeback-cache"]),
    "file-1m-8m-24m-packed-direct": dict(backend="file", file_mib=24, extent_mib=1,
                                         weights="direct",
                                         args=["--extent-size", "1M", "--cache-size", "8M",
                                               "--upload-delay", "0.05",
                                               "--checkpoint-interval", "1",
                                               "--pack-below", "64M", "--pack-size", "4M",
                                               "--compact-dead", "0.2"]),
    "file-4m-16m-64m-direct": dict(backend="file", file_mib=64, extent_mib=4, weights="direct",
                                   args=["--cache-size", "16M", "--upload-delay", "0.2",
                                         "--checkpoint-interval", "0"]),
    # Every extent of the file packed, 4 MiB packs, compaction of packs 20% dead: reads
    # around misses, rewrites and truncates inside packs, packs rewritten meanwhile.
    "s3-1m-8m-24m-packed": dict(backend="s3", file_mib=24, extent_mib=1, weights="default",
                                args=["--extent-size", "1M", "--cache-size", "8M",
                                      "--upload-delay", "0.05", "--checkpoint-interval", "1",
                                      "--pack-below", "64M", "--pack-size", "4M",
                                      "--compact-dead", "0.2"]),
    "file-1m-8m-24m-packed": dict(backend="file", file_mib=24, extent_mib=1,
                                  weights="mmap-heavy",
                                  args=["--extent-size", "1M", "--cache-size", "8M",
                                        "--upload-delay", "0.05", "--checkpoint-interval", "1",
                                        "--pack-below", "64M", "--pack-size", "4M",
                                        "--compact-dead", "0.2"]),
}
DEFAULT_CONFIGS = ["s3-16m-64m-wb", "s3-16m-64m-nowb", "file-16m-64m-mmap", "s3-1m-4m-24m"]

COUNTERS = ("evictions", "checksum_errors", "hot_checksum_errors", "cold_reads", "uploads",
            "upload_errors", "cold_errors", "backpressure_waits", "checkpoints",
            "hot_file_lost", "packed_extents", "read_around_extents", "compactions")


class Interrupted(Exception):
    pass


def _on_signal(signum, _frame):
    raise Interrupted(signal.Signals(signum).name)


ACTIVE: list[Mount] = []  # mounts that may still be up: torn down on any exit


def teardown(mnt: Mount) -> None:
    """Unmount and stop the daemon; a second Ctrl-C does not cut this short."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        mnt.cleanup()
        if mnt in ACTIVE:
            ACTIVE.remove(mnt)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def daemon_status(mnt: Mount) -> dict | None:
    if not mnt.mounted:
        return None
    try:
        res = mnt.cli("status", mnt.mountpoint, "--json", timeout=60)
        if res.returncode != 0:
            return None
        return json.loads(res.stdout)
    except Exception:  # noqa: BLE001 - best effort, the run's outcome matters more
        return None


def counters_of(status: dict | None) -> dict:
    if not status:
        return {}
    c = status.get("counters", {})
    out = {k: c.get(k, 0) for k in COUNTERS}
    for k in ("hot_bytes", "dirty_bytes", "upload_backlog_bytes"):
        out[k] = status.get(k)
    return out


def run_one(name: str, seed: int, args, endpoint: str | None, workdir: str,
            results: list[dict], pg=None) -> dict:
    """One run; its result dict goes into `results` at once and is filled in as it
    goes, so an interrupted run is reported too."""
    cfg = CONFIGS[name]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if cfg["backend"] == "s3":
        bucket = f"fsx-{uuid.uuid4().hex[:12]}"
        make_bucket(endpoint, bucket)
        url = f"s3://{bucket}/fs"
        env.update(s3_env(endpoint))
    else:
        url = f"file://{workdir}/cold"
    mount_args = list(cfg["args"])
    if cfg.get("meta") == "pg":
        mount_args += ["--meta-url", pg.new_schema()]
    mnt = Mount(workdir, url, args=mount_args, env=env, name="m")
    ACTIVE.append(mnt)
    result = {"config": name, "seed": seed, "backend": cfg["backend"], "mount_args": mount_args,
              "file_mib": cfg["file_mib"], "weights": cfg["weights"], "ops_wanted": args.ops,
              "ops_done": 0, "outcome": "error", "workdir": workdir}
    results.append(result)
    fsx = None
    t0 = time.monotonic()
    status = None
    try:
        mnt.start()
        fsx = Fsx(mnt.path(f"fsx{seed}"), seed, max_size=cfg["file_mib"] * MiB,
                  extent_size=cfg["extent_mib"] * MiB, max_len=args.max_len * MiB,
                  weights=WEIGHTS[cfg["weights"]], check_every=args.check_every)

        def progress(f: Fsx) -> None:
            dt = time.monotonic() - t0
            print(f"  {name} seed {seed}: {f.ops_done} ops, {f.ops_done / dt:.1f} ops/s, "
                  f"file {len(f.model) / MiB:.1f} MiB", file=sys.stderr, flush=True)

        deadline = t0 + args.max_seconds if args.max_seconds else None

        def remount() -> None:
            nonlocal status
            result["ops_done"] = fsx.ops_done
            result["elapsed_s"] = round(time.monotonic() - t0, 1)
            status = daemon_status(mnt)  # this daemon's counters, before they are lost
            mnt.remount()

        fsx.run_verify_remount(args.ops, remount, deadline=deadline, progress=progress,
                               progress_every=args.progress)
        result["status_after_remount"] = counters_of(daemon_status(mnt))
        result["outcome"] = "pass" if fsx.ops_done >= args.ops else "pass (time limit)"
    except FsxFailure as e:
        result["outcome"] = "FAIL"
        result["failure"] = e.summary()
        result["failure_text"] = str(e)
        print(str(e), file=sys.stderr, flush=True)
    except Interrupted:
        result["outcome"] = "interrupted"
        raise
    except Exception as e:  # noqa: BLE001 - a mount that would not start, a dead daemon...
        result["outcome"] = "error"
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        print(result["traceback"], file=sys.stderr, flush=True)
    finally:
        if status is None:
            status = daemon_status(mnt)
        result["counters"] = counters_of(status)
        if fsx is not None:
            result["counts"] = dict(fsx.counts)
            result["ops_done"] = fsx.ops_done
            fsx.close(check=False)
        result.setdefault("elapsed_s", round(time.monotonic() - t0, 1))
        dt = result["elapsed_s"] or 1e-9
        result["ops_per_s"] = round(result["ops_done"] / dt, 1)
        try:
            teardown(mnt)
        finally:
            bad = mnt.unexpected_log_lines()
            result["log_errors"] = len(bad)
            result["log_error_lines"] = bad[:20]
            if bad and result["outcome"].startswith("pass"):
                result["outcome"] = "FAIL (daemon logged errors)"
    return result


def line(r: dict) -> str:
    c = r.get("counters", {})
    counters = " ".join(f"{k}={c.get(k)}" for k in COUNTERS if c.get(k) is not None)
    extra = ""
    if "failure" in r:
        f = r["failure"]
        extra = (f" [{f['kind']} at op {f['op']}, offset {f['offset']}"
                 f"{', ' + str(f['errno']) if f['errno'] else ''}]")
    elif "error" in r:
        extra = f" [{r['error']}]"
    fb = r.get("counts", {}).get("copy_range_fallback")
    if fb:
        extra += f" copy_range_fallback={fb}"
    return (f"config={r['config']} seed={r['seed']} ops={r['ops_done']}/{r['ops_wanted']} "
            f"ops/s={r.get('ops_per_s')} outcome={r['outcome']}{extra} {counters} "
            f"log_errors={r.get('log_errors')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=100000, help="ops per configuration and seed")
    p.add_argument("--seeds", default="1", help="comma-separated seeds (default: 1)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated configuration names (default: "
                        f"{','.join(DEFAULT_CONFIGS)}; --list shows all)")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "fsx_long.json"),
                   help="JSON summary path (default: %(default)s)")
    p.add_argument("--check-every", type=int, default=1000,
                   help="full read-back of the file every N ops (0: only at the end)")
    p.add_argument("--max-len", type=int, default=1, help="largest op in MiB (default 1)")
    p.add_argument("--max-seconds", type=float, default=0,
                   help="stop each run after this many seconds (0: no limit)")
    p.add_argument("--progress", type=int, default=1000, help="progress line every N ops")
    p.add_argument("--keep", action="store_true",
                   help="keep the work directories of passing runs too (failing ones are kept)")
    p.add_argument("--list", action="store_true", help="list the configurations and exit")
    args = p.parse_args(argv)

    if args.list:
        for name, cfg in CONFIGS.items():
            print(f"{name:24} {cfg['backend']:4} file {cfg['file_mib']} MiB, "
                  f"weights {cfg['weights']}, {' '.join(cfg['args'])}"
                  + (" --meta-url (PostgreSQL)" if cfg.get("meta") == "pg" else ""))
        return 0
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        print("fsx_long: needs root and /dev/fuse", file=sys.stderr)
        return 2

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    results: list[dict] = []
    interrupted = None
    started = time.time()
    base = tempfile.mkdtemp(prefix="tierfs-fsx-long-")

    def write_summary() -> None:
        summary = {"started": started, "elapsed_s": round(time.time() - started, 1),
                   "ops": args.ops, "seeds": seeds, "configs": names,
                   "interrupted": interrupted, "results": results,
                   "failed": [f"{r['config']}/seed{r['seed']}" for r in results
                              if not r["outcome"].startswith("pass")]}
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)

    try:
        with ExitStack() as stack:
            endpoint = None
            if any(CONFIGS[n]["backend"] == "s3" for n in names):
                endpoint = stack.enter_context(moto_server())
            pg = None
            if any(CONFIGS[n].get("meta") == "pg" for n in names):
                pg = stack.enter_context(pg_server())
            for name in names:
                for seed in seeds:
                    workdir = os.path.join(base, f"{name}-seed{seed}")
                    os.makedirs(workdir)
                    print(f"== {name} seed {seed} ({args.ops} ops, work dir {workdir})",
                          file=sys.stderr, flush=True)
                    try:
                        r = run_one(name, seed, args, endpoint, workdir, results, pg)
                    finally:
                        if results and results[-1]["config"] == name \
                                and results[-1]["seed"] == seed:
                            print(line(results[-1]), flush=True)
                    if r["outcome"].startswith("pass") and not args.keep:
                        shutil.rmtree(workdir, ignore_errors=True)
                    write_summary()
    except (KeyboardInterrupt, Interrupted) as e:
        interrupted = str(e) or type(e).__name__
        print(f"fsx_long: interrupted ({interrupted}); mounts and moto stopped",
              file=sys.stderr)
    finally:
        for mnt in list(ACTIVE):
            try:
                teardown(mnt)
            except Exception as e:  # noqa: BLE001
                print(f"fsx_long: could not tear down {mnt.mountpoint}: {e}", file=sys.stderr)
        write_summary()
        if not os.listdir(base):
            os.rmdir(base)
        else:
            print(f"fsx_long: work dirs of failed runs kept under {base}", file=sys.stderr)
    print(f"fsx_long: summary in {args.out}", file=sys.stderr)
    failed = [r for r in results if not r["outcome"].startswith("pass")]
    if interrupted:
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
