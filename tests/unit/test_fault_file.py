"""The fault file that tests of a mounted daemon steer its bucket with: a setting is
never lost to a read that catches the file between its truncation and its write."""
import json
import os

from tierfs.cold.faulty import ControlledFaults
from tierfs.cold.memory import MemoryStore


def test_a_file_caught_half_written_is_read_again(tmp_path):
    path = tmp_path / "faults.json"
    path.write_text(json.dumps({"latency_s": 0.001}))
    store = ControlledFaults(MemoryStore(), str(path))
    store.put("a", b"x")
    assert store.latency_s == 0.001
    stamp = os.stat(path).st_mtime_ns + 1_000_000  # the next write, a tick later
    path.write_text("")  # open(..., "w") has truncated it; the daemon reads now
    os.utime(path, ns=(stamp, stamp))
    store.put("b", b"y")
    assert store.latency_s == 0.001  # the last whole setting stays
    path.write_text(json.dumps({"outage": True}))
    os.utime(path, ns=(stamp, stamp))  # the write lands in the same clock tick
    assert store._hanging() is False and store.outage is True
    path.unlink()  # no file: no faults
    assert store._hanging() is False and store.outage is False
