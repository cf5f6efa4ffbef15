#!/usr/bin/env python3
"""What one ranged GET costs the benchmark's S3 servers: stock moto, and moto reading
only the range (tests/moto_ranges.py, `scripts/bench.py --bucket moto-ranges`).

    python scripts/bench_ranged_get.py [--gets 30]
    python scripts/bench_ranged_get.py --cpu [--gets 48]

For each server: the median time of a GET of 64 KiB from a 64 KiB object, and of a
64 KiB range in the middle of a 64 MiB object (a pack of small files), over --gets
GETs each, one after another from one client. Stock moto copies the whole object
for every GET, so its second figure grows with the object; a real S3 does not.

With --cpu: the CPU time one GET costs the server (moto-ranges) and the client
(boto3, reading the body whole), per range size, 8 GETs at a time from 8 threads:
on one machine both share its cores, which a real bucket's server does not.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import cpu_ticks, stat_fields  # noqa: E402
from tests.moto_server import SERVER_PIDS, make_bucket, moto_server, s3_env  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
BUCKET = "bench-ranged-get"


def median_ms(client, key: str, byte_range: str, gets: int) -> float:
    times = []
    for _ in range(gets):
        t0 = time.perf_counter()
        client.get_object(Bucket=BUCKET, Key=key, Range=byte_range)["Body"].read()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    return cpu_ticks(stat_fields(f"/proc/{pid}/stat")) / os.sysconf("SC_CLK_TCK")


def cpu_per_get(gets: int) -> None:
    import boto3
    print(f"{'range':>8} {'server ms/GET':>14} {'client ms/GET':>14} {'MB/s':>6}")
    with moto_server(ranges=True) as endpoint:
        os.environ.update(s3_env(endpoint))
        make_bucket(endpoint, BUCKET)
        client = boto3.session.Session().client("s3")
        client.put_object(Bucket=BUCKET, Key="pack", Body=os.urandom(64 * MiB))
        server = SERVER_PIDS[endpoint]
        for size in (64 * KiB, 1 * MiB, 4 * MiB, 8 * MiB):
            def one(i: int) -> int:
                start = (i * 7919 * 64 * KiB) % (64 * MiB - size)
                resp = client.get_object(Bucket=BUCKET, Key="pack",
                                         Range=f"bytes={start}-{start + size - 1}")
                return len(resp["Body"].read())
            server0, client0 = cpu_seconds(server), sum(resource.getrusage(0)[:2])
            t0 = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                assert sum(pool.map(one, range(gets))) == gets * size
            wall = time.monotonic() - t0
            server_ms = 1000 * (cpu_seconds(server) - server0) / gets
            client_ms = 1000 * (sum(resource.getrusage(0)[:2]) - client0) / gets
            print(f"{size // KiB:>5} KiB {server_ms:>14.2f} {client_ms:>14.2f} "
                  f"{gets * size / wall / 1e6:>6.0f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gets", type=int, default=30, help="GETs per figure (default 30)")
    p.add_argument("--cpu", action="store_true",
                   help="CPU per GET of the server and the client, per range size")
    args = p.parse_args()
    import boto3

    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    if args.cpu:
        cpu_per_get(args.gets)
        return 0
    print(f"{'server':<13} {'64 KiB object':>14} {'64 KiB of 64 MiB':>17}   (median ms per GET)")
    for label, ranges in (("moto", False), ("moto-ranges", True)):
        with moto_server(ranges=ranges) as endpoint:
            os.environ.update(s3_env(endpoint))
            make_bucket(endpoint, BUCKET)
            client = boto3.session.Session().client("s3")
            client.put_object(Bucket=BUCKET, Key="small", Body=os.urandom(64 * KiB))
            client.put_object(Bucket=BUCKET, Key="pack", Body=os.urandom(64 * MiB))
            small = median_ms(client, "small", f"bytes=0-{64 * KiB - 1}", args.gets)
            start = 32 * MiB
            pack = median_ms(client, "pack", f"bytes={start}-{start + 64 * KiB - 1}", args.gets)
            print(f"{label:<13} {small:>14.2f} {pack:>17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
