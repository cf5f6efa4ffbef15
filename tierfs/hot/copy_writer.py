"""A process of its own that writes hot copies for the daemon (copy_writers.py).

Run as a script, `python -I -S copy_writer.py FD SIZE PARENT`: it imports only the
standard library. FD is a shared memory file of SIZE bytes; each line on stdin is a
JSON list of [path, offset, length], and the process writes each file (created if it
is not there, its directory too) with those bytes of the shared memory, in order, and
answers one line: null when all are written, or [index, errno, message] of the first
that failed (the rest are not written). It ends when stdin ends (the daemon closed it)
and dies with the daemon (PARENT, its pid): a copy it went on writing into a spare
after a kill -9 of the daemon could land in a file the next daemon took for an empty
spare and wrote a copy of its own into.
"""
import ctypes
import json
import mmap
import os
import signal
import sys

FLAGS = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    """SIGKILL when the thread that started this process ends: the daemon's main
    thread, which ends with the daemon. A parent gone already ends this at once."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        sys.exit(f"tierfs copy writer: prctl failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent:
        sys.exit(0)


def write_copy(path: str, data: memoryview) -> None:
    try:
        fd = os.open(path, FLAGS, 0o600)
    except FileNotFoundError:  # the first copy in its directory
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, FLAGS, 0o600)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        if os.fstat(fd).st_size > len(data):  # a spare someone else left non-empty
            os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def main() -> None:
    # Ctrl-C or a stop of the daemon's process group ends the daemon, whose end (or
    # close) ends this: no file is cut off halfway while the daemon lives.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    die_with(int(sys.argv[3]))
    shared = mmap.mmap(int(sys.argv[1]), int(sys.argv[2]))
    view = memoryview(shared)
    for line in sys.stdin.buffer:
        failure = None
        for i, (path, offset, length) in enumerate(json.loads(line)):
            try:
                write_copy(path, view[offset:offset + length])
            except OSError as e:
                failure = [i, e.errno, e.strerror]
                break
        try:
            sys.stdout.buffer.write(json.dumps(failure).encode() + b"\n")
            sys.stdout.buffer.flush()
        except BrokenPipeError:  # the daemon closed its end: nothing waits for this
            os._exit(0)


if __name__ == "__main__":
    main()
