"""`tierfs sync | prefetch | release | pin | unpin`: tiering control of a live mount."""
from __future__ import annotations

import concurrent.futures
import itertools
import os
import stat
import sys
import time

from ..config import format_size
from ..errors import NotInBucket, UserError
from ..client import ANSWER_CHECK_S, NotAnswering, call, check_answers, daemon_info, request
from .progress import Progress, plural


def collect_files(paths: list[str], recursive: bool) -> list[tuple[str, int, int]]:
    """(path, inode, size) of the regular files named or (with -r) below the paths."""
    return [f for _daemon, group in collect_groups(paths, recursive) for f in group]


def collect_groups(paths: list[str], recursive: bool) -> list[tuple[dict, list]]:
    """collect_files, one list per path named, with the daemon serving it. Every path
    named must be inside a tierfs mount (checked before any walk); the walk stays on
    the filesystem of the path it starts from. Requests go to that daemon without
    asking the mount again: a daemon stopped meanwhile would hold such a question in
    the kernel for ever, where a request to its socket ends (client.request)."""
    named = []
    for path in paths:
        path = os.path.abspath(path)
        check_answers(path)  # before the stat, which a stopped daemon would hold
        try:
            st = os.stat(path)  # a symlink named on the command line is followed
        except OSError as e:
            raise UserError(f"{path}: {e.strerror}") from None
        daemon = daemon_info(path)  # UserError "... is not inside a tierfs mount"
        if stat.S_ISDIR(st.st_mode) and not recursive:
            raise UserError(f"{path} is a directory: add -r to include what is below it")
        named.append((path, st, daemon))
    groups = []
    for path, st, daemon in named:
        out = []
        if stat.S_ISREG(st.st_mode):
            out.append((path, st.st_ino, st.st_size))
        elif stat.S_ISDIR(st.st_mode):
            for root, dirs, files in os.walk(path):
                for name in files:
                    p = os.path.join(root, name)
                    try:
                        s = os.lstat(p)
                    except FileNotFoundError:  # removed while we walk
                        continue
                    if stat.S_ISREG(s.st_mode) and s.st_dev == st.st_dev:
                        out.append((p, s.st_ino, s.st_size))
                # Another filesystem mounted below is not this mount's business.
                dirs[:] = [d for d in dirs if _same_dev(os.path.join(root, d), st.st_dev)]
        groups.append((daemon, out))
    return groups


def _same_dev(path: str, dev: int) -> bool:
    try:
        return os.lstat(path).st_dev == dev
    except FileNotFoundError:
        return False


def _call(path: str, cmd: str, on_progress=None, **args) -> dict:
    """client.call, handing the daemon's progress lines to on_progress."""
    last = None
    for last in request(path, cmd, **args):
        if not last.get("progress"):
            break
        if on_progress is not None:
            on_progress(last)
    if last is None or last.get("progress"):
        raise UserError("the tierfs daemon closed the connection without answering")
    if not last.get("ok"):
        raise UserError(f"{cmd} failed: {last.get('error', 'unknown error')}")
    return last


def for_each_file(verb: str, cmd: str, args, groups=None) -> tuple[list[dict], list[str], float]:
    """Run `cmd` on every file (of `groups`, or those args names), `--jobs` at a time,
    with a progress line in bytes. At most a few requests per job wait to be sent:
    waiting on a future per file of a large tree would cost time in the square of
    its size."""
    groups = collect_groups(args.paths, args.recursive) if groups is None else groups
    files = [(f, daemon) for daemon, group in groups for f in group]
    t0 = time.monotonic()
    progress = Progress(verb, sum(f[2] for f, _daemon in files))
    results, failures = [], []
    jobs = max(1, getattr(args, "jobs", 8))
    todo = iter(files)
    finished_bytes = done = 0
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {}

        def submit_more() -> None:
            for (path, ino, size), daemon in itertools.islice(todo, 4 * jobs - len(futures)):
                futures[pool.submit(_call, path, cmd, daemon=daemon, ino=ino)] = (path, size)
        submit_more()
        while futures:
            finished, _ = concurrent.futures.wait(
                futures, timeout=0.25, return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in finished:
                path, size = futures.pop(fut)
                try:
                    results.append(fut.result())
                except NotAnswering:
                    for queued in futures:  # each would wait for the stopped daemon too
                        queued.cancel()
                    raise
                except UserError as e:
                    failures.append(f"{path}: {e}")
                finished_bytes += size
                done += 1
            submit_more()
            progress.update(finished_bytes,
                            note=f"{done} of {plural(len(files), 'file')} done")
    progress.close()
    return results, failures, time.monotonic() - t0


SYNC_INOS = 100_000  # inode numbers per sync request (well within its 8 MiB at most)
# sync --wait: the daemon sends a progress line every half second; one silent this
# long (three times TIERFS_ANSWER_WAIT) is stopped or stuck, and the wait ends (exit 3)
# instead of lasting for ever.
SYNC_SILENCE_S = 3 * ANSWER_CHECK_S
# Files per request of prefetch, pin, release and unpin (a prefetch's files packed next to
# each other come in one GET).
BATCH_FILES = 1024


def batches(args) -> tuple[list, list, list[tuple[dict, list]]]:
    """(the groups of files args names, every file of them, (daemon, batch) of those
    files BATCH_FILES at a time): a batch goes to one daemon, so it never mixes the
    files of two paths named (two mounts, maybe)."""
    groups = collect_groups(args.paths, args.recursive)
    return (groups, [f for _daemon, group in groups for f in group],
            [(daemon, group[i:i + BATCH_FILES]) for daemon, group in groups
             for i in range(0, len(group), BATCH_FILES)])


def _sort_answers(verb: str, batch: list, reply: dict, results: list, failures: list) -> None:
    """Each file's answer in a reply to a request of many: into results, or failures."""
    for path, ino, _size in batch:
        res = reply["files"].get(str(ino), {"error": "no answer for this file"})
        if "error" in res:
            failures.append(f"{path}: {verb} failed: {res['error']}")
        else:
            results.append(res)


def for_each_batch(verb: str, cmd: str, args) -> tuple[list[dict], list[str]]:
    """Run `cmd` (a command taking "inos") on every file, BATCH_FILES per request,
    with a progress line in bytes. A daemon that does not know `cmd` (one started by
    an older release) gets the command of one file, file by file."""
    groups, files, todo = batches(args)
    results, failures = [], []
    done_bytes = done = 0
    with Progress(verb, sum(f[2] for f in files)) as progress:
        for daemon, batch in todo:
            try:
                reply = _call(batch[0][0], cmd, daemon=daemon,
                              inos=[ino for _p, ino, _s in batch])
            except UserError as e:
                if done or f"unknown command {cmd!r}" not in str(e):
                    raise
                progress.close()
                return for_each_file(verb, cmd.removesuffix("_many"), args, groups)[:2]
            _sort_answers(verb, batch, reply, results, failures)
            done_bytes += sum(size for _p, _i, size in batch)
            done += len(batch)
            progress.update(done_bytes, note=f"{done} of {plural(len(files), 'file')} done")
    return results, failures


def fetch_files(verb: str, args, *, pin: bool = False) -> tuple[list[dict], list[str], float]:
    """Prefetch (or pin) files, BATCH_FILES per request, with a progress line in
    bytes. One request names many files, so the daemon fetches files packed next
    to each other in one GET; it runs --jobs files at a time."""
    _groups, files, todo = batches(args)
    t0 = time.monotonic()
    progress = Progress(verb, sum(f[2] for f in files))
    results, failures = [], []
    done_bytes = done = 0
    for daemon, batch in todo:
        batch_bytes = sum(size for _p, _i, size in batch)
        note = f"{done} of {plural(len(files), 'file')} done"

        def on_progress(msg: dict, base=done_bytes, cap=batch_bytes, note=note) -> None:
            progress.update(base + min(cap, int(msg.get("hot_bytes", 0))), note=note)
        reply = _call(batch[0][0], "prefetch_many", on_progress if progress.active else None,
                      daemon=daemon, inos=[ino for _p, ino, _s in batch], parallel=args.jobs,
                      pin=pin, progress=progress.active)
        _sort_answers(verb, batch, reply, results, failures)
        done_bytes += batch_bytes
        done += len(batch)
        progress.update(done_bytes, note=f"{done} of {plural(len(files), 'file')} done")
    progress.close()
    return results, failures, time.monotonic() - t0


def report_failures(failures: list[str]) -> int:
    for line in failures:
        print(f"tierfs: {line}", file=sys.stderr)
    return 1 if failures else 0


def cmd_prefetch(args) -> int:
    results, failures, secs = fetch_files("prefetch", args)
    fetched = sum(r["fetched"] for r in results)
    already = sum(r["already_hot"] for r in results)
    not_hot = sum(r.get("not_hot", 0) for r in results)
    print(f"prefetched {plural(len(results), 'file')}: {format_size(fetched)} fetched, "
          f"{format_size(already)} already hot, {secs:.1f}s "
          f"({format_size(fetched / max(secs, 1e-6))}/s)"
          + (f"; {format_size(not_hot)} did not fit in the hot tier (raise --cache-size)"
             if not_hot else ""))
    return report_failures(failures)


def cmd_release(args) -> int:
    results, failures = for_each_batch("release", "release_many", args)
    released = sum(r["released"] for r in results)
    dirty = sum(r["dirty_kept"] for r in results)
    pinned = sum(r["pinned_kept"] for r in results)
    print(f"released {format_size(released)} from the hot tier in {plural(len(results), 'file')}"
          + (f"; kept {plural(dirty, 'dirty extent')} (not uploaded yet: run tierfs sync "
             f"--wait)" if dirty else "")
          + (f"; kept {plural(pinned, 'pinned extent')}" if pinned else ""))
    return report_failures(failures)


def cmd_pin(args) -> int:
    verb = "pin" if args.command == "pin" else "unpin"
    if verb == "pin":
        results, failures, _ = fetch_files(verb, args, pin=True)
    else:
        results, failures = for_each_batch(verb, "unpin_many", args)
    key = "pinned" if verb == "pin" else "unpinned"
    changed = sum(r[key] for r in results)
    print(f"{key} {plural(len(results), 'file')} ({plural(changed, 'extent')} changed)")
    return report_failures(failures)


def cmd_scrub(args) -> int:
    args.paths, args.recursive = [args.path], True
    results, failures, secs = for_each_file("scrub", "scrub", args)
    total = {k: sum(r[k] for r in results) for k in
             ("hot_ok", "hot_repaired", "hot_lost", "cold_ok", "cold_bad", "dirty_skipped")}
    print(f"scrubbed {plural(len(results), 'file')} in {secs:.1f}s: "
          f"{plural(total['hot_ok'], 'hot extent')} ok, "
          f"{plural(total['hot_repaired'], 'damaged hot copy', 'damaged hot copies')} replaced "
          f"from the bucket, "
          + (f"{plural(total['hot_lost'], 'damaged hot copy', 'damaged hot copies')} not "
             f"replaced (object damaged too), " if total["hot_lost"] else "")
          + f"{plural(total['cold_ok'], 'object')} ok, "
          f"{plural(total['cold_bad'], 'damaged object')}, "
          f"{plural(total['dirty_skipped'], 'dirty extent')} not checked")
    if total["cold_bad"]:
        print("tierfs: damaged objects with a good hot copy are uploaded again; the others "
              "are lost (see the daemon log)", file=sys.stderr)
        report_failures(failures)
        return 1
    return report_failures(failures)


def cmd_sync(args) -> int:
    path = os.path.abspath(args.path)
    check_answers(path)  # before the stat, which a stopped daemon would hold
    st = os.stat(path)
    daemon = daemon_info(path)  # outside a mount: fail now, not after walking the tree
    inos = None
    if not os.path.ismount(path):
        inos = [ino for _p, ino, _s in collect_files([path], True)] if stat.S_ISDIR(st.st_mode) \
            else [st.st_ino]
    t0 = time.monotonic()
    # A request holds at most SYNC_INOS of them: a million files' inode numbers would
    # pass the daemon's limit on a request's length. Waiting for one part after another
    # waits for them all; the uploads of every part run from the first request on.
    parts = [None] if inos is None else [inos[i:i + SYNC_INOS]
                                         for i in range(0, len(inos), SYNC_INOS)] or [[]]
    if args.wait:
        first = None
        for part in parts:
            left = args.timeout - (time.monotonic() - t0)
            if left <= 0:
                raise NotInBucket(f"sync failed: timed out after {args.timeout:.0f}s: "
                                  f"files under {path} are not in the bucket yet; they keep "
                                  f"uploading")
            out = _sync_wait(path, daemon, part, left)
            first = first or out
        print(f"synced {path}: everything is in the bucket "
              f"({format_size(first['dirty_bytes_before'])} was dirty, "
              f"{time.monotonic() - t0:.1f}s)")
    else:
        outs = [call(path, "sync", daemon=daemon, inos=part, wait=False) for part in parts]
        print(f"sync of {path} started: {format_size(outs[0]['dirty_bytes_before'])} dirty")
    return 0


def _sync_wait(path: str, daemon: dict, inos, timeout: float) -> dict:
    """sync --wait: show what is still on its way to the bucket (a progress line on a
    terminal; elsewhere one line when the bucket fails), and return the final answer."""
    progress = Progress("uploading", None)
    told_error = False
    done = 0
    last = None
    try:
        for last in request(path, "sync", daemon=daemon, inos=inos, wait=True, timeout=timeout,
                            wait_s=SYNC_SILENCE_S):
            if not last.get("progress"):
                break
            error = last.get("upload_error")
            left = last["dirty_bytes"]
            # Writes during the wait add to what is left: done never goes back.
            done = max(done, last.get("total_bytes", 0) - left)
            note = (f"{last.get('uploads_running', 0)} of "
                    f"{plural(last.get('upload_slots', 0), 'upload slot')} busy"
                    + (f"; bucket failing: {error}" if error else ""))
            progress.update(done, total_bytes=done + left, note=note)
            if error and not told_error and not progress.active:
                told_error = True
                print(f"tierfs: waiting for {format_size(left)} to reach the bucket, "
                      f"which fails: {error}", file=sys.stderr)
    except TimeoutError:
        raise NotInBucket(f"sync failed: the tierfs daemon said nothing for "
                          f"{SYNC_SILENCE_S:g}s (stopped or stuck? kill -USR1 on its pid "
                          f"writes what it waits for to its log): files under {path} are "
                          f"not known to be in the bucket") from None
    finally:
        progress.close()
    if last is None or last.get("progress"):
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
