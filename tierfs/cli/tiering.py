"""`tierfs sync | prefetch | release | pin | unpin`: tiering control of a live mount."""
from __future__ import annotations

import concurrent.futures
import os
import stat
import sys
import time

from ..config import format_size
from ..errors import NotInBucket, UserError
from ..client import call, request


def collect_files(paths: list[str], recursive: bool) -> list[tuple[str, int, int]]:
    """(path, inode, size) of the regular files named or (with -r) below the paths."""
    out = []
    for path in paths:
        path = os.path.abspath(path)
        try:
            st = os.lstat(path)
        except OSError as e:
            raise UserError(f"{path}: {e.strerror}") from None
        if stat.S_ISREG(st.st_mode):
            out.append((path, st.st_ino, st.st_size))
        elif stat.S_ISDIR(st.st_mode):
            if not recursive:
                raise UserError(f"{path} is a directory: add -r to include what is below it")
            for root, _dirs, files in os.walk(path):
                for name in files:
                    p = os.path.join(root, name)
                    s = os.lstat(p)
                    if stat.S_ISREG(s.st_mode):
                        out.append((p, s.st_ino, s.st_size))
    return out


class Progress:
    """A one-line progress display on stderr (only on a terminal)."""

    def __init__(self, files: int, total: int, verb: str):
        self.files, self.total, self.verb = files, total, verb
        self.done_files = self.done_bytes = 0
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def rate(self) -> float:
        return self.done_bytes / max(time.monotonic() - self.start, 1e-6)

    def advance(self, nbytes: int) -> None:
        self.done_files += 1
        self.done_bytes += nbytes
        now = time.monotonic()
        if self.tty and (now - self._last > 0.1 or self.done_files == self.files):
            self._last = now
            rate = self.rate()
            eta = (self.total - self.done_bytes) / rate if rate > 0 else 0
            sys.stderr.write(f"\r{self.verb} {self.done_files}/{self.files} files  "
                             f"{format_size(self.done_bytes)}/{format_size(self.total)}  "
                             f"{format_size(rate)}/s  ETA {eta:.0f}s   ")
            sys.stderr.flush()

    def finish(self) -> float:
        if self.tty:
            sys.stderr.write("\n")
        return time.monotonic() - self.start


def for_each_file(verb: str, cmd: str, args, **extra) -> tuple[list[dict], list[str], float]:
    files = collect_files(args.paths, args.recursive)
    progress = Progress(len(files), sum(f[2] for f in files), verb)
    results, failures = [], []
    with concurrent.futures.ThreadPoolExecutor(max(1, getattr(args, "jobs", 8))) as pool:
        futures = {pool.submit(call, path, cmd, ino=ino, **extra): (path, size)
                   for path, ino, size in files}
        for fut in concurrent.futures.as_completed(futures):
            path, size = futures[fut]
            try:
                results.append(fut.result())
            except UserError as e:
                failures.append(f"{path}: {e}")
            progress.advance(size)
    return results, failures, progress.finish()


def report_failures(failures: list[str]) -> int:
    for line in failures:
        print(f"tierfs: {line}", file=sys.stderr)
    return 1 if failures else 0


def cmd_prefetch(args) -> int:
    results, failures, secs = for_each_file("prefetch", "prefetch", args, parallel=args.jobs)
    fetched = sum(r["fetched"] for r in results)
    already = sum(r["already_hot"] for r in results)
    print(f"prefetched {len(results)} files: {format_size(fetched)} fetched, "
          f"{format_size(already)} already hot, {secs:.1f}s "
          f"({format_size(fetched / max(secs, 1e-6))}/s)")
    return report_failures(failures)


def cmd_release(args) -> int:
    results, failures, _ = for_each_file("release", "release", args)
    released = sum(r["released"] for r in results)
    dirty = sum(r["dirty_kept"] for r in results)
    pinned = sum(r["pinned_kept"] for r in results)
    print(f"released {format_size(released)} from the hot tier in {len(results)} files"
          + (f"; kept {dirty} dirty extents (not uploaded yet: run tierfs sync --wait)" if dirty else "")
          + (f"; kept {pinned} pinned extents" if pinned else ""))
    return report_failures(failures)


def cmd_pin(args) -> int:
    verb = "pin" if args.command == "pin" else "unpin"
    results, failures, _ = for_each_file(verb, verb, args)
    key = "pinned" if verb == "pin" else "unpinned"
    print(f"{key} {len(results)} files ({sum(r[key] for r in results)} extents changed)")
    return report_failures(failures)


def cmd_scrub(args) -> int:
    args.paths, args.recursive = [args.path], True
    results, failures, secs = for_each_file("scrub", "scrub", args)
    total = {k: sum(r[k] for r in results) for k in
             ("hot_ok", "hot_repaired", "cold_ok", "cold_bad", "dirty_skipped")}
    print(f"scrubbed {len(results)} files in {secs:.1f}s: {total['hot_ok']} hot extents ok, "
          f"{total['hot_repaired']} damaged hot copies replaced from the bucket, "
          f"{total['cold_ok']} objects ok, {total['cold_bad']} damaged objects, "
          f"{total['dirty_skipped']} dirty extents not checked")
    if total["cold_bad"]:
        print("damaged objects with a good hot copy are uploaded again; the others are lost "
              "(see the daemon log)", file=sys.stderr)
        return 1
    return report_failures(failures)


def cmd_sync(args) -> int:
    path = os.path.abspath(args.path)
    st = os.stat(path)
    inos = None
    if not os.path.ismount(path):
        inos = [ino for _p, ino, _s in collect_files([path], True)] if stat.S_ISDIR(st.st_mode) \
            else [st.st_ino]
    t0 = time.monotonic()
    if args.wait:
        out = _sync_wait(path, inos, args.timeout)
    else:
        out = call(path, "sync", inos=inos, wait=False)
    if args.wait:
        print(f"synced {path}: everything is in the bucket ({format_size(out['dirty_bytes_before'])} "
              f"was dirty, {time.monotonic() - t0:.1f}s)")
    else:
        print(f"sync of {path} started: {format_size(out['dirty_bytes_before'])} dirty")
    return 0


def _sync_wait(path: str, inos, timeout: float) -> dict:
    """sync --wait: show what is still on its way to the bucket (a refreshed line on a
    terminal; elsewhere one line when the bucket fails), and its final answer."""
    tty = sys.stderr.isatty()
    told_error = False
    last = None
    for last in request(path, "sync", inos=inos, wait=True, timeout=timeout):
        if not last.get("progress"):
            break
        error = last.get("upload_error")
        if tty:
            sys.stderr.write(f"\rwaiting for {format_size(last['dirty_bytes'])} to reach the "
                             f"bucket ({last['uploads_in_flight']} uploads in flight)"
                             + (f"; bucket failing: {error}" if error else "") + "   ")
            sys.stderr.flush()
        elif error and not told_error:
            told_error = True
            print(f"tierfs: waiting for {format_size(last['dirty_bytes'])} to reach the bucket, "
                  f"which fails: {error}", file=sys.stderr)
    if tty:
        sys.stderr.write("\n")
    if last is None:
        raise UserError("the tierfs daemon closed the connection without answering")
    if not last.get("ok"):
        raise NotInBucket(f"sync failed: {last.get('error', 'unknown error')}")
    return last


def add_parsers(sub) -> None:
    for name, helptext in (("prefetch", "bring files hot from the bucket"),
                           ("release", "drop hot copies of clean data (it stays in the bucket)"),
                           ("pin", "keep files hot: fetch them and never evict them"),
                           ("unpin", "let pinned files be evicted again")):
        p = sub.add_parser(name, help=helptext, description=helptext[0].upper() + helptext[1:] + ".")
        p.add_argument("paths", metavar="PATH", nargs="+")
        p.add_argument("-r", "--recursive", action="store_true", help="include directories' contents")
        p.add_argument("-j", "--jobs", type=int, default=8, help="files handled in parallel")
    p = sub.add_parser("sync", help="upload dirty data now",
                       description="Upload everything dirty under PATH (default: the whole "
                       "mount of the current directory). With --wait, return only once it is "
                       "in the bucket: the durability signal for checkpoints.")
    p.add_argument("path", metavar="PATH", nargs="?", default=".")
    p.add_argument("--wait", action="store_true", help="wait until the data is in the bucket")
    p.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="with --wait: give up after this long, exit status 3 (default: 3600)")
    p = sub.add_parser("scrub", help="verify checksums of hot copies and bucket objects",
                       description="Re-read every clean extent under PATH (default: the "
                       "current directory), hot copy and bucket object, and verify checksums. "
                       "Damaged hot copies are replaced from the bucket.")
    p.add_argument("path", metavar="PATH", nargs="?", default=".")
    p.add_argument("-j", "--jobs", type=int, default=4, help="files checked in parallel")


COMMANDS = {"prefetch": cmd_prefetch, "release": cmd_release, "pin": cmd_pin,
            "unpin": cmd_pin, "sync": cmd_sync, "scrub": cmd_scrub}
