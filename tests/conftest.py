"""Shared fixtures: a moto S3 server per session and mounted tierfs daemons."""
from __future__ import annotations

import collections
import os
import signal
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness import (SESSION_ENV, Mount, _gone, mounts, stop_daemon, sweep_dead_sessions,
                           tierfs_daemons, wait_until)
from tierfs.mountpoint import unmount_lazy
from tests.moto_server import make_bucket, moto_server, s3_env
from tests.pg_server import pg_server
from tests.watchdog import Watchdog

_watchdog: Watchdog | None = None


def pytest_configure(config):
    os.environ[SESSION_ENV] = str(os.getpid())  # inherited by every daemon the tests start
    # Daemons and commands run the tierfs of this checkout, also where the installed
    # one (an editable install) points at another: `python -m tierfs` is started in
    # other directories, where the checkout is not on the path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # A run that is told to stop (timeout, CI, kill) still runs every fixture's
        # teardown, as Ctrl-C does: no mount outlives it.
        def stop(signum, _frame):
            raise KeyboardInterrupt(f"stopped by signal {signum}")
        signal.signal(signal.SIGTERM, stop)
    for what in sweep_dead_sessions():
        print(f"tests: stopped {what}, left behind by an earlier run that was killed")
    global _watchdog
    capture = config.pluginmanager.getplugin("capturemanager")

    def say(text: str) -> None:
        if capture is not None:
            capture.suspend_global_capture()  # the last words must reach the terminal
        print(f"\n{text}", file=sys.stderr, flush=True)

    _watchdog = Watchdog(say)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of each test together run within the watchdog's limit."""
    _watchdog.arm(item.nodeid)
    try:
        yield
    finally:
        _watchdog.disarm()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    found = _watchdog.take_report(item.nodeid)
    if found:  # the phase in which the test ran past its limit fails, whatever it did
        report.outcome = "failed"
        report.longrepr = f"{found}\n\n{report.longrepr or ''}"


def pytest_sessionfinish(session, exitstatus):
    """The last net: whatever this run started and still runs (an interrupted
    teardown) is stopped before pytest exits."""
    for pid, (mountpoint, owner) in tierfs_daemons().items():
        if owner == os.getpid():
            stop_daemon(pid, mountpoint)


@pytest.fixture(scope="session", autouse=True)
def run_lock(tmp_path_factory):
    """pytest locks the base temp dir it numbers itself, not one given with
    --basetemp: lock that one to this run, so that another run's sweep
    (sweep_dead_sessions) leaves this run's mounts alone."""
    lock = os.path.join(str(tmp_path_factory.getbasetemp()), ".lock")
    if not os.path.exists(lock):
        with open(lock, "w") as f:
            f.write(str(os.getpid()))


@pytest.fixture(autouse=True)
def no_leftover_mounts(request, tmp_path_factory):
    """Every test ends with the mounts and daemons it started gone, also when it
    failed: what is left is stopped here, and the test fails for leaving it.
    Mounts of other processes (another test worker, a benchmark) are not ours:
    a mount is ours if one of our daemons serves it or it lies in our temp dir."""
    if "tests/fuse/" not in str(request.node.fspath):
        yield  # the other levels mount nothing
        return
    ours = str(tmp_path_factory.getbasetemp()) + "/"
    before_mounts = {p for p, kind in mounts().items() if kind == "fuse.tierfs"}
    before_daemons = set(tierfs_daemons())
    yield
    daemons = {pid: d for pid, d in tierfs_daemons().items()
               if pid not in before_daemons and d[1] == os.getpid()}
    served = {d[0] for d in daemons.values()}
    left_mounts = [p for p, kind in mounts().items()
                   if kind == "fuse.tierfs" and p not in before_mounts
                   and (p in served or p.startswith(ours))]
    for path in left_mounts:
        for pid in [pid for pid, d in daemons.items() if d[0] == path]:
            stop_daemon(pid, path)
            del daemons[pid]
        unmount_lazy(path)  # also one whose daemon died
    # An unmounted daemon may still be finishing its exit: give it time first.
    lingering = []
    for pid, (mountpoint, _owner) in daemons.items():
        try:
            wait_until(lambda: _gone(pid), 30, f"daemon {pid} to exit")
        except AssertionError:
            stop_daemon(pid, mountpoint)
            lingering.append(f"daemon {pid} ({mountpoint or 'no mount point'})")
    if left_mounts or lingering:
        pytest.fail("the test left running: " + ", ".join(left_mounts + lingering))


def pytest_collection_modifyitems(config, items):
    # FUSE tests need root and /dev/fuse; say so loudly rather than skipping quietly.
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        for item in items:
            if "tests/fuse/" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason="needs root and /dev/fuse"))


@pytest.fixture(scope="session")
def s3_endpoint():
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for the session (started on first use, stopped at the end)."""
    with pg_server() as server:
        yield server


@pytest.fixture
def s3_url(s3_endpoint):
    """A fresh bucket on the session's moto server, as an s3:// URL (env set for boto3)."""
    bucket = f"tierfs-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    return f"s3://{bucket}/fs"


@pytest.fixture
def mount_factory(tmp_path, request):
    """Create mounts: factory(cold_url=None, args=(), start=True, name='m') -> Mount."""
    created: list[Mount] = []

    def factory(cold_url=None, args=(), start=True, name="m", env=None):
        url = cold_url or f"file://{tmp_path}/{name}-cold"
        m = Mount(str(tmp_path), url, args=args, env=env, name=name)
        created.append(m)
        if start:
            m.start()
        return m

    yield factory
    # The mounts of different mount points stop at once (each waits for its own daemon
    # to exit); those of one mount point in the order they were made.
    by_place = collections.defaultdict(list)
    for m in created:
        by_place[m.mountpoint].append(m)
    with ThreadPoolExecutor(max(1, len(by_place))) as pool:
        stops = [pool.submit(lambda ms: [m.cleanup() for m in ms], ms)
                 for ms in by_place.values()]
    for stop in stops:
        stop.result()  # re-raises what a cleanup raised, once all of them are done
    problems = []
    for m in created:
        problems += m.unexpected_log_lines()
    if problems and not request.node.get_closest_marker("allow_log_errors"):
        pytest.fail("daemon logged unexpected errors:\n" + "\n".join(problems[:20]))


def pytest_generate_tests(metafunc):
    """The POSIX battery runs on both metadata engines: LMDB and a shared PostgreSQL
    namespace."""
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    if ("mnt" in metafunc.fixturenames and module.startswith("test_posix_")
            and not metafunc.definition.get_closest_marker("lmdb_only")):
        metafunc.parametrize("meta_engine", ["lmdb", "postgres"], indirect=True)


@pytest.fixture
def meta_engine(request):
    return getattr(request, "param", "lmdb")


@pytest.fixture
def mnt(mount_factory, meta_engine, request):
    """One mounted filesystem on the embedded file:// cold store (its namespace in
    LMDB, or in PostgreSQL for the POSIX battery's second run)."""
    if meta_engine == "postgres":
        url = request.getfixturevalue("postgres").new_schema()
        return mount_factory(args=("--meta-url", url))
    return mount_factory()


@pytest.fixture
def s3_mount(mount_factory, s3_url, s3_endpoint):
    env = dict(os.environ, **s3_env(s3_endpoint))
    return mount_factory(cold_url=s3_url, env=env)
