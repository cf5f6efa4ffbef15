"""The progress line of the tierfs command (tierfs/cli/progress.py)."""
from __future__ import annotations

import fcntl
import io
import os
import struct
import termios

import pytest

from tierfs.cli.progress import Progress, format_duration, plural

MiB = 1 << 20


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def read_all(fd: int) -> str:
    os.set_blocking(fd, False)
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        out += chunk
    return out.decode().replace("\r\n", "\n")  # the terminal's own newline translation


@pytest.fixture
def pty_stream():
    """A stream that is a terminal (the slave end of a pseudo-terminal), and a
    function returning everything written to it so far."""
    master, slave = os.openpty()
    stream = os.fdopen(slave, "w", buffering=1)
    yield stream, lambda: read_all(master)
    stream.close()
    os.close(master)


def test_draws_bytes_rate_and_eta_in_place_then_a_newline(pty_stream):
    stream, written = pty_stream
    clock = FakeClock()
    p = Progress("uploading", 100 * MiB, stream, clock=clock)
    assert p.active
    for second in range(1, 5):           # 10 MiB a second
        clock.now += 1
        p.update(second * 10 * MiB)
    text = written()
    lines = text.split("\r")
    assert lines[0] == "" and len(lines) == 1 + 4  # each redraw starts at the line's start
    last = lines[-1].strip()
    assert last.startswith("uploading: 40.0 MiB of 100.0 MiB (40%), 10.0 MiB/s, ETA 6s"), last
    assert "\n" not in text                # refreshed in place until the end
    clock.now += 1
    p.update(100 * MiB, note="3 of 8 upload slots busy")
    p.close()
    text = written()
    assert text.endswith("\n")
    final = text.rstrip("\n").split("\r")[-1].strip()
    assert final.startswith("uploading: 100.0 MiB of 100.0 MiB (100%)")
    assert "ETA" not in final and final.endswith("(3 of 8 upload slots busy)")
    p.close()                              # idempotent: no second newline
    p.update(5)                            # and nothing after close
    assert written() == ""


def test_rate_is_that_of_the_last_seconds(pty_stream):
    stream, written = pty_stream
    clock = FakeClock()
    p = Progress("x", None, stream, clock=clock)
    for _ in range(20):                    # 20 s at 100 MiB/s ...
        clock.now += 1
        p.update(p.done + 100 * MiB)
    for _ in range(10):                    # ... then 10 s at 1 MiB/s
        clock.now += 1
        p.update(p.done + MiB)
    assert p.rate(clock.now) == pytest.approx(MiB, rel=0.01)
    p.close()
    assert "1.0 MiB/s" in written().split("\r")[-1]


def test_redraws_at_most_four_times_a_second_and_not_for_quick_waits(pty_stream):
    stream, written = pty_stream
    clock = FakeClock()
    p = Progress("x", 1000, stream, clock=clock)
    for i in range(40):                    # the first 0.4 s: nothing at all
        clock.now += 0.01
        p.update(i)
    assert written() == ""
    for i in range(100):                   # the next second: four redraws at most
        clock.now += 0.01
        p.update(40 + i)
    assert 1 <= written().count("\r") <= 5
    quick = Progress("y", 1000, stream, clock=clock)
    quick.update(1000)
    quick.close()                          # done before anything was drawn
    assert written() == ""


def test_eta_only_once_a_rate_is_known(pty_stream):
    stream, written = pty_stream
    clock = FakeClock()
    p = Progress("x", 1000, stream, clock=clock)
    clock.now += 0.6
    p.update(0)
    first = written()
    assert first.strip() == "x: 0 B of 1000 B (0%), 0 B/s"   # stalled: no ETA
    assert "ETA" not in first


def test_nothing_is_written_to_a_stream_that_is_not_a_terminal(tmp_path):
    clock = FakeClock()
    for stream in (io.StringIO(), open(tmp_path / "log", "w")):
        p = Progress("uploading", 100, stream, clock=clock)
        assert not p.active
        for i in range(10):
            clock.now += 1
            p.update(i * 10)
        p.close()
        if isinstance(stream, io.StringIO):
            assert stream.getvalue() == ""
        stream.close()
    assert (tmp_path / "log").read_text() == ""


def test_line_fits_the_terminal_width(pty_stream):
    """A line wider than the terminal would wrap, and a carriage return could not
    redraw it in place."""
    stream, written = pty_stream
    fcntl.ioctl(stream.fileno(), termios.TIOCSWINSZ, struct.pack("HHHH", 24, 40, 0, 0))
    clock = FakeClock()
    p = Progress("uploading", 100 * MiB, stream, clock=clock)
    clock.now += 1
    p.update(10 * MiB, note="a long note about why it waits")
    p.close()
    drawn = written().rstrip("\n").split("\r")[1:]
    assert drawn and all(len(line) == 39 for line in drawn), drawn
    assert drawn[0].startswith("uploading: 10.0 MiB of 100.0 MiB (10%)")


def test_plural_and_durations():
    assert plural(1, "file") == "1 file"
    assert plural(0, "file") == "0 files" and plural(2, "error") == "2 errors"
    assert plural(1, "damaged hot copy", "damaged hot copies") == "1 damaged hot copy"
    assert plural(3, "fetch", "fetches") == "3 fetches"
    assert format_duration(6.2) == "6s" and format_duration(75) == "1m15s"
    assert format_duration(7322) == "2h02m"
