"""`tierfs status`: the state of a mount, a directory or a file.

The mount point gets the whole-mount block; a file inside it its own extents; a
directory the totals of everything below it (walked by the daemon, bounded).
"""
from __future__ import annotations

import json
import os
import stat

from ..config import format_size
from ..errors import EXIT_NOT_IN_BUCKET
from .progress import plural


def cmd_status(args) -> int:
    from ..client import call, check_answers, daemon_info
    path = os.path.abspath(args.path)
    # Before any stat: a stopped daemon's mount would hold that in the kernel.
    check_answers(path)
    daemon = daemon_info(path)
    st = os.stat(path)
    if os.path.ismount(path):
        req = {}
    elif stat.S_ISDIR(st.st_mode):
        req = {"dir_ino": st.st_ino}
    else:
        req = {"ino": st.st_ino}
    out = call(path, "status", daemon=daemon, **req)
    out.pop("ok", None)
    fenced = out.get("fenced_by")
    if args.json:
        if "file" in out:
            out["file"]["path"] = path
        if "directory" in out:
            out["directory"]["path"] = path
        print(json.dumps(out, indent=2, sort_keys=True))
        return EXIT_NOT_IN_BUCKET if fenced else 0
    print(f"mount        {out['mountpoint']}  ->  {out['cold']}")
    if fenced:
        print(f"FENCED       {fenced} took the filesystem over: this mount is read-only and "
              f"uploads nothing; unmount it")
    if "file" in out:
        _print_file(path, out["file"])
    elif "directory" in out:
        _print_directory(path, out["directory"])
    else:
        _print_mount(out)
    return EXIT_NOT_IN_BUCKET if fenced else 0


def _print_mount(out: dict) -> None:
    print(f"hot          {format_size(out['hot_bytes'])} in {plural(out['hot_extents'], 'extent')}")
    print(f"cold only    {format_size(out['cold_bytes'])} (in the bucket, not on the hot tier)")
    print(f"dirty        {format_size(out['dirty_bytes'])} in "
          f"{plural(out['dirty_extents'], 'extent')}")
    print(f"pinned       {format_size(out['pinned_bytes'])}")
    if out.get("trash_files"):
        print(f"freeing      {format_size(out['trash_bytes'])} of dropped hot copies "
              f"({plural(out['trash_files'], 'file')})")
    note = out.get("cache_limit_note")
    # Brackets: the note may hold parentheses of its own.
    print(f"cache        limit {format_size(out['cache_limit'])}"
          + (f" [{note}]" if note else "") + f", policy {out['cache_policy']}")
    queued = out["uploads_queued"]
    print(f"uploads      backlog {format_size(out['upload_backlog_bytes'])}, oldest "
          f"{out['upload_backlog_age_s']:.1f}s, {out['uploads_running']} of "
          f"{plural(out['upload_slots'], 'upload slot')} busy"
          + (f", {plural(queued, 'extent')} queued" if queued else "")
          + (f", failing: {out['upload_error']}" if out.get("upload_error") else ""))
    print(f"bucket gc    {plural(out['gc_backlog_objects'], 'superseded object')} "
          f"({format_size(out['gc_backlog_bytes'])}) waiting for deletion")
    if out.get("packs"):
        print(f"packs        {plural(out['packs'], 'object')} of small files, "
              f"{format_size(out['pack_live_bytes'])} of {format_size(out['pack_bytes'])} "
              f"still in use")
    hit = out["hit_rate"]
    print(f"hit rate     {'-' if hit is None else f'{hit * 100:.1f}%'} of bytes read")
    c = out["counters"]
    requests = sum(v for k, v in c.items() if k.startswith("s3_requests:"))
    errors = sum(v for k, v in c.items() if k.startswith("s3_errors:"))
    print(f"bucket       {plural(requests, 'request')}, {plural(errors, 'error')}, "
          f"{plural(c.get('uploads', 0), 'upload')} ({format_size(c.get('upload_bytes', 0))}), "
          f"{plural(c.get('cold_reads', 0), 'fetch', 'fetches')} "
          f"({format_size(c.get('cold_read_bytes', 0))})")
    if c.get("direct_open_files"):  # tierfs.open() readers, served outside FUSE
        print(f"direct reads {plural(c['direct_open_files'], 'file')} opened, "
              f"{format_size(c.get('direct_bytes', 0))} in "
              f"{plural(c.get('direct_extents', 0), 'extent file')} handed out")
    print(f"hot tier     {plural(c.get('evictions', 0), 'eviction')}, "
          f"{plural(c.get('backpressure_waits', 0), 'writer wait')} for room")
    bad_cold, bad_hot = c.get("checksum_errors", 0), c.get("hot_checksum_errors", 0)
    print(f"integrity    {bad_cold} bucket and {bad_hot} hot checksum "
          f"{'failure' if bad_cold + bad_hot == 1 else 'failures'}, "
          f"{plural(c.get('checkpoints', 0), 'metadata checkpoint')}")


def _print_file(path: str, f: dict) -> None:
    print(f"file         {path}: {format_size(f['size'])} in "
          f"{plural(len(f['extents']), 'extent')} of {format_size(f['extent_size'])}")
    print(f"hot          {format_size(f['hot'])}")
    print(f"cold only    {format_size(f['cold'])} (in the bucket, not on the hot tier)")
    print(f"dirty        {format_size(f['dirty'])} (not in the bucket yet)")
    print(f"pinned       {format_size(f['pinned'])}")
    for first, last, state in _runs(f["extents"]):
        span = f"{first}" if first == last else f"{first}-{last}"
        print(f"  extents {span:<13} {state}")


def _print_directory(path: str, d: dict) -> None:
    print(f"directory    {path}: {plural(d['files'], 'file')} "
          f"({format_size(d['bytes'])}), {plural(d['directories'], 'subdirectory', 'subdirectories')}"
          + (f", {plural(d['other'], 'other entry', 'other entries')}" if d["other"] else ""))
    print(f"hot          {format_size(d['hot'])}")
    print(f"cold only    {format_size(d['cold'])} (in the bucket, not on the hot tier)")
    print(f"dirty        {format_size(d['dirty'])} (not in the bucket yet)")
    print(f"pinned       {format_size(d['pinned'])}")
    if not d["complete"]:
        print(f"partial      the walk stopped after {d['entries_limit']:,} entries: the "
              f"figures above cover only those; ask for smaller directories")


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
