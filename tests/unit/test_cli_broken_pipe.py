"""The command's exit status when a pipe breaks: 0 and quiet when stdout's reader has
gone (`tierfs status | head`: test_status_into_a_closed_pipe_is_quiet), an error and
1 when a pipe or socket of the command's own work broke."""
from __future__ import annotations

import os
import sys

from tierfs.cli import main as cli_main
from tierfs.cli import tiering


class Stdout:
    """A stand-in for sys.stdout that writes to `fd`."""

    def __init__(self, fd: int):
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


def test_stdout_is_gone_only_once_its_reader_has_closed(monkeypatch):
    r, w = os.pipe()
    try:
        monkeypatch.setattr(sys, "stdout", Stdout(w))
        assert not cli_main.stdout_gone()
        os.close(r)
        r = None
        assert cli_main.stdout_gone()
    finally:
        os.close(w)
        if r is not None:
            os.close(r)


def test_a_broken_pipe_of_the_commands_own_work_fails(monkeypatch, capsys):
    def breaks(args):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setitem(tiering.COMMANDS, "sync", breaks)
    assert cli_main.main(["sync", "/"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tierfs: ") and "broken pipe" in err and len(err.splitlines()) == 1
