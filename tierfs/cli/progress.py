"""Terminal output of the tierfs command: a progress line for long waits, and plurals.

    from tierfs.cli.progress import Progress, plural

    progress = Progress("uploading", total_bytes)   # stream defaults to sys.stderr
    for chunk in work():
        progress.update(done_bytes)                  # absolute bytes done; call as often as you like
    progress.close()                                 # final line, then a newline

    plural(1, "file") -> "1 file";  plural(3, "copy", "copies") -> "3 copies"

`Progress(label, total_bytes, stream=None)` draws one line, refreshed in place:
``LABEL: 512.0 MiB of 1.0 GiB (50%), 93.1 MiB/s, ETA 6s``. It is a no-op unless the
stream is a terminal, so scripts and CI logs stay quiet; nothing is drawn for waits
shorter than half a second. `update(done_bytes, total_bytes=None, note=None)` moves it
on (a new total when it changes; `note` is appended to the line, e.g. why it waits).
The rate is measured over the last few seconds, the ETA shown once a rate is known,
and the line is redrawn at most a few times a second. `close()` redraws the final state
and ends the line with a newline (if a line was drawn at all); it is idempotent, and a
`with Progress(...) as p:` block calls it.
"""
from __future__ import annotations

import collections
import os
import sys
import time

from ..config import format_size

REFRESH_S = 0.25   # at most four redraws a second
WINDOW_S = 5.0     # the rate is that of the last few seconds, not of the whole run
SHOW_AFTER_S = 0.5  # a wait shorter than this draws nothing


def plural(n: int, word: str, words: str | None = None) -> str:
    """'1 file', '2 files', '0 files' (words: the irregular plural)."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def format_duration(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class Progress:
    """One refreshed progress line on a terminal (see the module docstring)."""

    def __init__(self, label: str, total_bytes: int | None, stream=None, *,
                 clock=time.monotonic):
        self.label = label
        self.total = total_bytes
        self.stream = sys.stderr if stream is None else stream
        self.clock = clock  # tests pass a fake clock
        try:
            self.active = self.stream.isatty()
        except (AttributeError, ValueError):  # no isatty, or closed
            self.active = False
        self.start = clock()
        self.done = 0
        self.note = ""
        self.samples: collections.deque[tuple[float, int]] = collections.deque([(self.start, 0)])
        self.drawn_at: float | None = None
        self.width = 0      # length of the line on screen, to blank what a shorter one leaves
        self.closed = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, done_bytes: int, total_bytes: int | None = None,
               note: str | None = None) -> None:
        if not self.active or self.closed:
            return
        now = self.clock()
        self.done = done_bytes
        if total_bytes is not None:
            self.total = total_bytes
        if note is not None:
            self.note = note
        if now - self.samples[-1][0] >= 0.05:  # bounded however often update() is called
            self.samples.append((now, done_bytes))
        # Keep one sample older than the window: the rate then spans the whole window.
        while len(self.samples) > 2 and now - self.samples[1][0] >= WINDOW_S:
            self.samples.popleft()
        if now - self.start < SHOW_AFTER_S:
            return
        if self.drawn_at is None or now - self.drawn_at >= REFRESH_S:
            self._draw(now)

    def rate(self, now: float) -> float | None:
        """Bytes per second over the window; None until there is enough to tell."""
        t0, d0 = self.samples[0]
        if now - t0 < REFRESH_S:
            return None
        return max(0.0, (self.done - d0) / (now - t0))

    def line(self, now: float) -> str:
        done = format_size(self.done)
        if self.total:
            text = (f"{self.label}: {done} of {format_size(self.total)} "
                    f"({min(100, self.done * 100 // self.total)}%)")
        else:
            text = f"{self.label}: {done}"
        rate = self.rate(now)
        if rate is not None:
            text += f", {format_size(rate)}/s"
            if self.total and rate > 0 and self.done < self.total:
                text += f", ETA {format_duration((self.total - self.done) / rate)}"
        return text + (f" ({self.note})" if self.note else "")

    def _draw(self, now: float) -> None:
        text = self.line(now)
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns or 80  # 0: unknown
        except (OSError, ValueError, AttributeError):
            columns = 80
        text = text[:max(columns - 1, 10)]  # a wrapped line could not be redrawn in place
        pad = " " * max(0, self.width - len(text))
        self.width = len(text)
        self.drawn_at = now
        try:
            self.stream.write("\r" + text + pad)
            self.stream.flush()
        except (OSError, ValueError):
            self.active = False  # the terminal went away: the work itself goes on

    def close(self) -> None:
        """Redraw the final state and end the line, if a line is on the screen."""
        if self.closed:
            return
        self.closed = True
        if not self.active:
            return
        if self.drawn_at is None:  # too quick to show: leave the terminal alone
            return
        self._draw(self.clock())
        try:
            self.stream.write("\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass
