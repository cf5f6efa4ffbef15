import os


def test_write_read_remount(mnt):
    with open(mnt.path("hello.txt"), "wb") as f:
        f.write(b"hello tierfs\n" * 1000)
    os.mkdir(mnt.path("dir"))
    mnt.remount()
    with open(mnt.path("hello.txt"), "rb") as f:
        assert f.read() == b"hello tierfs\n" * 1000
    assert sorted(os.listdir(mnt.mountpoint)) == ["dir", "hello.txt"]
