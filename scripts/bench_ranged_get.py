#!/usr/bin/env python3
"""What one ranged GET costs the benchmark's S3 servers: stock moto, and moto reading
only the range (tests/moto_ranges.py, `scripts/bench.py --bucket moto-ranges`).

    python scripts/bench_ranged_get.py [--gets 30]

For each server: the median time of a GET of 64 KiB from a 64 KiB object, and of a
64 KiB range in the middle of a 64 MiB object (a pack of small files), over --gets
GETs each, one after another from one client. Stock moto copies the whole object
for every GET, so its second figure grows with the object; a real S3 does not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.moto_server import make_bucket, moto_server, s3_env  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
BUCKET = "bench-ranged-get"


def median_ms(client, key: str, byte_range: str, gets: int) -> float:
    times = []
    for _ in range(gets):
        t0 = time.perf_counter()
        client.get_object(Bucket=BUCKET, Key=key, Range=byte_range)["Body"].read()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gets", type=int, default=30, help="GETs per figure (default 30)")
    args = p.parse_args()
    import boto3

    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
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
