"""RecentChanges: whether the change feed named an inode or a name after a lookup
started its database read."""
from tierfs.fs.recent_changes import RecentChanges


def test_only_notifications_after_the_mark_that_name_it_count():
    changes = RecentChanges()
    changes.note({7}, set(), False)
    seq = changes.seq
    assert not changes.since(seq, 7)  # noted before the read began
    changes.note({8}, {(1, b"other")}, False)
    assert not changes.since(seq, 7, (1, b"name"))
    changes.note({9}, {(1, b"name")}, False)
    assert changes.since(seq, 7, (1, b"name"))  # its name
    assert not changes.since(seq, 7, (2, b"name"))
    changes.note({7}, set(), False)
    assert changes.since(seq, 7)  # its inode
    assert not changes.since(changes.seq, 7)


def test_everything_names_every_inode():
    changes = RecentChanges()
    seq = changes.seq
    changes.note(set(), set(), True)
    assert changes.since(seq, 12345)


def test_a_mark_older_than_what_is_kept_counts_as_raced():
    changes = RecentChanges(keep=4)
    seq = changes.seq
    for ino in range(100, 105):  # five others: the first is forgotten
        changes.note({ino}, set(), False)
    assert changes.since(seq, 7)
    assert not changes.since(seq + 1, 7)  # everything after this mark is still kept
