"""Records sorted in runs on disk and merged back."""
from __future__ import annotations

import random

from tierfs.tier.sortrun import SortedRecords


def test_records_come_back_in_order_across_many_runs():
    rng = random.Random(7)
    records = [(rng.randrange(1 << 64), rng.randrange(50)) for _ in range(1000)]
    records += records[:10]  # repeats are kept
    sorter = SortedRecords(2, run=64)  # 16 runs, each in memory alone
    sorter.BLOCK = 5  # runs read back in many blocks
    try:
        for rec in records:
            sorter.add(*rec)
        assert list(sorter) == sorted(records)
    finally:
        sorter.close()


def test_no_records_and_fewer_than_a_run():
    sorter = SortedRecords(1, run=10)
    assert list(sorter) == []
    sorter.add(3)
    sorter.add(1)
    assert list(sorter) == [(1,), (3,)]
    sorter.close()
