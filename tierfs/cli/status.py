"""`tierfs status`: the state of a mount, a directory or a file."""
from __future__ import annotations

import json
import os
import stat

from ..config import format_size
from ..errors import EXIT_NOT_IN_BUCKET


def cmd_status(args) -> int:
    from ..client import call
    path = os.path.abspath(args.path)
    st = os.stat(path)
    req = {"ino": st.st_ino} if stat.S_ISREG(st.st_mode) else {}
    out = call(path, "status", **req)
    out.pop("ok", None)
    fenced = out.get("fenced_by")
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return EXIT_NOT_IN_BUCKET if fenced else 0
    print(f"mount        {out['mountpoint']}  ->  {out['cold']}")
    if fenced:
        print(f"FENCED       {fenced} took the filesystem over: this mount is read-only and "
              f"uploads nothing; unmount it")
    print(f"hot          {format_size(out['hot_bytes'])} in {out['hot_extents']} extents")
    print(f"cold only    {format_size(out['cold_bytes'])} (in the bucket, not on the hot tier)")
    print(f"dirty        {format_size(out['dirty_bytes'])} in {out['dirty_extents']} extents")
    print(f"pinned       {format_size(out['pinned_bytes'])}")
    print(f"cache        limit {format_size(out['cache_limit'])}, policy {out['cache_policy']}")
    print(f"uploads      backlog {format_size(out['upload_backlog_bytes'])}, oldest "
          f"{out['upload_backlog_age_s']:.1f}s, extents uploading now {out['uploads_in_flight']}"
          + (f", failing: {out['upload_error']}" if out.get("upload_error") else ""))
    print(f"bucket gc    {out['gc_backlog_objects']} superseded objects "
          f"({format_size(out['gc_backlog_bytes'])}) waiting for deletion")
    hit = out["hit_rate"]
    print(f"hit rate     {'-' if hit is None else f'{hit * 100:.1f}%'} of bytes read")
    c = out["counters"]
    requests = sum(v for k, v in c.items() if k.startswith("s3_requests:"))
    errors = sum(v for k, v in c.items() if k.startswith("s3_errors:"))
    print(f"bucket       {requests} requests, {errors} errors, {c.get('uploads', 0)} uploads "
          f"({format_size(c.get('upload_bytes', 0))}), {c.get('cold_reads', 0)} fetches "
          f"({format_size(c.get('cold_read_bytes', 0))})")
    print(f"hot tier     {c.get('evictions', 0)} evictions, "
          f"{c.get('backpressure_waits', 0)} writer waits for room")
    print(f"integrity    {c.get('checksum_errors', 0)} bucket and "
          f"{c.get('hot_checksum_errors', 0)} hot checksum failures, "
          f"{c.get('checkpoints', 0)} metadata checkpoints")
    if "file" in out:
        f = out["file"]
        print(f"file         {path}: {format_size(f['size'])}, hot {format_size(f['hot'])}, "
              f"cold {format_size(f['cold'])}, dirty {format_size(f['dirty'])}")
        for first, last, state in _runs(f["extents"]):
            span = f"{first}" if first == last else f"{first}-{last}"
            print(f"  extents {span:<13} {state}")
    return EXIT_NOT_IN_BUCKET if fenced else 0


def _runs(extents: list[dict]):
    """Group consecutive extents in the same state: (first, last, state)."""
    runs = []
    for e in extents:
        state = " ".join([e["where"]] + [w for w in ("dirty", "pinned") if e[w]])
        if runs and runs[-1][2] == state and runs[-1][1] == e["index"] - 1:
            runs[-1][1] = e["index"]
        else:
            runs.append([e["index"], e["index"], state])
    return runs
