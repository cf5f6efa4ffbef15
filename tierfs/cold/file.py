"""A store kept in a local (or network-mounted) directory."""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import uuid

from tierfs.cold.base import FILE_PIECE, check_range, content_version, probe_key
from tierfs.errors import ColdConfigError, ColdStoreError, ObjectNotFound, PreconditionFailed
from tierfs.mount_table import unescape

# put() writes "<name>.<random><TMP_SUFFIX>" then renames it; list() hides these.
TMP_SUFFIX = ".tierfs-tmp"
# errno values that a network filesystem may return and later recover from.
_TRANSIENT = {errno.EIO, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR, errno.ESTALE}
# A location under a mount point listed here that is not mounted lies on the disk
# beneath it: what is written there is hidden once the share is mounted.
FSTAB = "/etc/fstab"


class FileStore:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.checked = False  # check() found the location (or made it)
        self.mount_point = "/"  # of the filesystem check() found the location on

    def _path(self, key: str) -> str:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts) or key.endswith(TMP_SUFFIX):
            raise ValueError(f"invalid object key {key!r}")
        return os.path.join(self.root, *parts)

    def _error(self, op: str, key: str, e: OSError) -> ColdStoreError:
        return ColdStoreError(
            f"{op} '{key}' in {self.describe()} failed: {e.strerror or e}",
            transient=e.errno in _TRANSIENT,
        )

    def put(self, key: str, data: bytes) -> None:
        self._put(key, lambda fd: _write_all(fd, data))

    def put_file(self, key: str, f) -> None:
        def copy(fd: int) -> None:
            while piece := f.read(FILE_PIECE):
                _write_all(fd, piece)
        self._put(key, copy)

    def _put(self, key: str, write) -> None:
        """write(fd) fills a temporary file, renamed to the key once synced."""
        path = self._path(key)
        directory = os.path.dirname(path)
        tmp = f"{path}.{uuid.uuid4().hex}{TMP_SUFFIX}"
        try:
            self._make_dirs(key, directory)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                write(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            fsync_dir(directory)  # make the rename itself durable
        except OSError as e:
            _unlink_quietly(tmp)
            raise self._error("put", key, e) from e
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def _check_location(self, op: str, key: str) -> None:
        """Raise a transient error if the location check() found is gone: a share
        unmounted under the daemon, or the directory moved away, is an outage that ends
        when it is back. Never an empty bucket: objects put on the disk beneath would be
        missing once the share is back, and "not found", a delete done or an empty list
        would be answers about objects that are still on the share."""
        if not self.checked:
            return
        if not os.path.isdir(self.root):
            problem = "the cold directory is missing: is it mounted?"
        elif not os.path.ismount(self.mount_point):
            # A share unmounted leaves its mount point's directory on the disk beneath
            # (maybe with one of the location's name): there, but not the location.
            problem = (f"{self.mount_point}, the filesystem the cold directory was found "
                       f"on, is no longer mounted: mount it again")
        else:
            return
        raise ColdStoreError(f"{op} '{key}' in {self.describe()} failed: {problem}",
                             transient=True)

    def _make_dirs(self, key: str, directory: str) -> None:
        """Create the key's directories, but never the location itself (see above)."""
        self._check_location("put", key)
        make_dirs_durable(directory)

    def _not_found(self, key: str) -> ObjectNotFound:
        self._check_location("get", key)  # an answer only while the location is there
        return ObjectNotFound(f"object '{key}' not found in {self.describe()}")

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        chunks = []
        self._get(key, offset, length, chunks.append)
        return b"".join(chunks)

    def get_file(self, key: str, f, offset: int = 0) -> int:
        return self._get(key, offset, None, f.write, FILE_PIECE)

    def _get(self, key: str, offset: int, length: int | None, out, piece: int | None = None
             ) -> int:
        """Hand [offset, offset+length) to out() in pieces (of at most `piece`
        bytes); how many bytes."""
        check_range(offset, length)
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise self._not_found(key) from e
        except OSError as e:
            raise self._error("get", key, e) from e
        try:
            end = os.fstat(fd).st_size
            if length is not None:
                end = min(end, offset + length)
            pos = offset
            while pos < end:  # pread may return short counts on huge reads
                chunk = os.pread(fd, min(end - pos, piece or end), pos)
                if not chunk:
                    break
                out(chunk)
                pos += len(chunk)
            return max(0, pos - offset)
        except IsADirectoryError as e:
            raise self._not_found(key) from e
        except OSError as e:
            raise self._error("get", key, e) from e
        finally:
            os.close(fd)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        data = self.get(key)
        return data, content_version(data)

    def put_if(self, key: str, data: bytes, version: str | None) -> None:
        """Under an exclusive flock on the key's directory, which every put_if there
        takes (processes on one machine; a network filesystem's flock may be weaker)."""
        directory = os.path.dirname(self._path(key))
        try:
            self._make_dirs(key, directory)
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise self._error("put", key, e) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = self.get_versioned(key)[1]
            except ObjectNotFound:
                current = None
            if current != version:
                raise PreconditionFailed(f"object '{key}' in {self.describe()} changed")
            self.put(key, data)
        finally:
            os.close(fd)  # and the lock with it

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            self._check_location("delete", key)  # not gone: it may be on the share
        except OSError as e:
            raise self._error("delete", key, e) from e

    def list(self, prefix: str = "") -> list[str]:
        # Walk only the deepest directory the prefix pins down.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = os.path.join(self.root, *base.split("/")) if base else self.root
        if not self.checked and not os.path.isdir(self.root):
            raise ColdStoreError(f"cold directory {self.root} is missing: is it mounted?")

        def onerror(e: OSError) -> None:
            # A subdirectory removed while we walk simply has no keys.
            if not isinstance(e, (FileNotFoundError, NotADirectoryError)):
                raise e

        keys = []
        try:
            for dirpath, _dirs, files in os.walk(top, onerror=onerror):
                rel = os.path.relpath(dirpath, self.root)
                rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
                for name in files:
                    key = rel + name
                    if key.startswith(prefix) and not name.endswith(TMP_SUFFIX):
                        keys.append(key)
        except OSError as e:
            raise self._error("list", prefix, e) from e
        self._check_location("list", prefix)  # gone before or during the walk: not empty
        return sorted(keys)

    def size(self, key: str) -> int | None:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            self._check_location("size", key)
            return None
        except OSError as e:
            raise self._error("size", key, e) from e
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def check(self) -> None:
        root = self.root
        parent = os.path.dirname(root)
        share = unmounted_fstab_mount_point(root)
        if share is not None:
            raise ColdConfigError(f"cold location {root} lies under {share}, a mount point in "
                                  f"{FSTAB} that is not mounted: mount it (mount {share}), "
                                  f"or fix the URL")
        if not os.path.isdir(root):
            if os.path.exists(root):
                raise ColdConfigError(f"cold location {root} is not a directory: use a directory path in file:///abs/path")
            if not os.path.isdir(parent):
                raise ColdConfigError(
                    f"cannot create cold directory {root}: parent {parent} does not exist: "
                    f"create it (mkdir -p {parent}) or fix the URL"
                )
            try:
                make_dirs_durable(root)
            except OSError as e:
                raise ColdConfigError(
                    f"cannot create cold directory {root}: {e.strerror}: check permissions on {parent}"
                ) from e
        probe = probe_key()
        try:
            self.put(probe, b"tierfs probe")
            ok = self.get(probe) == b"tierfs probe"
            self.delete(probe)
        except ColdStoreError as e:
            raise ColdConfigError(f"cold directory {root} is not usable ({e}): check its permissions and free space") from e
        if not ok:
            raise ColdConfigError(f"cold directory {root} returned wrong data for a probe file: check the filesystem")
        self.mount_point = mount_point_of(root)
        self.checked = True

    def describe(self) -> str:
        return f"file://{self.root}"


def unmounted_fstab_mount_point(path: str) -> str | None:
    """A mount point listed in FSTAB at or above `path` that is not mounted now."""
    try:
        with open(FSTAB) as f:
            listed = [unescape(fields[1]) for fields in (line.split() for line in f)
                      if len(fields) >= 2 and not fields[0].startswith("#")
                      and fields[1].startswith("/")]
        with open("/proc/self/mounts") as f:
            mounted = {unescape(fields[1]) for fields in (line.split() for line in f)
                       if len(fields) >= 2}
    except OSError:
        return None  # no fstab (a container): nothing to compare
    real = os.path.realpath(path)
    for mount_point in map(os.path.realpath, listed):
        if os.path.commonpath([mount_point, real]) == mount_point and mount_point not in mounted:
            return mount_point
    return None


def mount_point_of(path: str) -> str:
    """The mount point of the filesystem that holds the directory `path`."""
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def make_dirs_durable(path: str) -> None:
    """os.makedirs, then fsync the parent of each directory it lacked: an object's rename
    is synced in its directory, but a power cut could still lose a new directory (and
    every object in it) whose own entry was never synced."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            pass  # made by another put at this moment: synced here too, to be sure
        fsync_dir(os.path.dirname(directory))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

