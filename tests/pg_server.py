"""Run a throwaway PostgreSQL server from Debian's packages for tests.

initdb refuses to run as root, so as root the cluster is made and run by the
`postgres` user (which Debian's postgresql package creates) in a private
temporary directory; the server listens only on a Unix socket in that
directory. A plain helper module (not a conftest): import pg_server() where needed.
"""
from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator

INSTALL_HINT = "run scripts/install.sh (it installs Debian's postgresql package)"


def server_binaries() -> str:
    """The directory holding initdb and postgres (the newest installed version)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    if initdb:
        return os.path.dirname(os.path.realpath(initdb))
    raise RuntimeError(f"PostgreSQL server binaries (initdb, postgres) not found: {INSTALL_HINT}")


def _server_user() -> dict:
    """Popen arguments that run the server's programs as `postgres` when we are root."""
    if os.geteuid() != 0:
        return {}
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError(f"no 'postgres' user to run the test server as: {INSTALL_HINT}") from None
    return {"user": "postgres", "group": "postgres", "extra_groups": []}


class PgServer:
    """A cluster in `top` (data, socket, log), run by start() and stop()."""

    def __init__(self, top: str, bindir: str, durable: bool = False):
        self.durable = durable  # fsync on, as a production server runs (benchmarks)
        self.socket_dir = top
        self.data = os.path.join(top, "data")
        self.log_path = os.path.join(top, "server.log")
        self.bindir = bindir
        self.proc: subprocess.Popen | None = None

    def url(self, database: str = "tierfs", schema: str | None = None) -> str:
        """A libpq URL for a database on this server, optionally with its own schema
        (search_path) so tests do not see each other's tables."""
        options = f"&options=-csearch_path%3D{schema}" if schema else ""
        return f"postgresql://postgres@/{database}?host={self.socket_dir}{options}"

    def new_schema(self, database: str = "tierfs") -> str:
        """A URL naming a new, empty schema: one filesystem's metadata per test."""
        name = "t_" + uuid.uuid4().hex[:12]
        self.sql(f"CREATE SCHEMA {name}", database)
        return self.url(database, name)

    def sql(self, statement: str, database: str = "tierfs") -> None:
        import psycopg
        with psycopg.connect(self.url(database), autocommit=True) as conn:
            conn.execute(statement)

    def start(self, timeout_s: float = 60) -> None:
        """Run the server and wait until it answers."""
        import psycopg
        with open(self.log_path, "ab") as log:
            # fsync off for tests: a test server's durability is the machine's, not the
            # product's. Benchmarks ask for a durable one.
            fast = [] if self.durable else ["-c", "fsync=off", "-c", "full_page_writes=off"]
            self.proc = subprocess.Popen(
                [os.path.join(self.bindir, "postgres"), "-D", self.data, "-k", self.socket_dir,
                 "-c", "listen_addresses=", *fast, "-c", "max_connections=200"],
                cwd=self.socket_dir, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, **_server_user())
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    with open(self.log_path, errors="replace") as f:
                        raise RuntimeError("test PostgreSQL server did not start:\n"
                                           + f.read()[-2000:])
                time.sleep(0.1)

    def _children(self) -> list[int]:
        """The server's backends and helpers (each a process group of its own)."""
        pids = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                        pids.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
        return pids

    def pause(self) -> None:
        """Stop the server without closing anything: connections stay open and
        nothing answers, as when it is frozen or stuck on its disk. The postmaster
        first, so that no backend starts after the others were listed."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        for pid in self._children():
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in [self.proc.pid, *self._children()]:
            with contextlib.suppress(ProcessLookupError):  # a backend whose client left
                os.kill(pid, signal.SIGCONT)

    @contextlib.contextmanager
    def frozen_backends(self, application_name: str) -> Iterator[list[int]]:
        """Stop the backends of the connections named `application_name` (one
        node's change feed, say) until the block ends: their clients get nothing,
        as over a slow network, while every other connection works."""
        import psycopg
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            pids = [row[0] for row in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                (application_name,))]
        if not pids:
            raise AssertionError(f"no connection named {application_name!r}")
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield pids
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        """Fast shutdown: open connections are cut, committed data stays."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@contextlib.contextmanager
def pg_server(timeout_s: float = 60, durable: bool = False) -> Iterator[PgServer]:
    """Start a PostgreSQL server with a database `tierfs`; stop and remove it on exit.
    durable: fsync on (benchmarks), else off (tests)."""
    bindir = server_binaries()
    top = tempfile.mkdtemp(prefix="tierfs-pg-")
    os.chmod(top, 0o755)
    if os.geteuid() == 0:
        shutil.chown(top, "postgres", "postgres")
    server = PgServer(top, bindir, durable)
    try:
        subprocess.run([os.path.join(bindir, "initdb"), "-D", server.data, "-A", "trust",
                        "-U", "postgres", "--no-sync", "-E", "UTF8"], cwd=top, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout_s,
                       **_server_user())
        server.start(timeout_s)
        server.sql("CREATE DATABASE tierfs", "postgres")
        yield server
    finally:
        server.stop()
        shutil.rmtree(top, ignore_errors=True)


class ForgetfulProxy:
    """TCP in front of a test server's Unix socket. forget() makes every connection
    open at that moment carry nothing from then on, without closing it, as a NAT or
    firewall that forgot a connection while it was idle drops its packets; new
    connections go through."""

    def __init__(self, server: PgServer):
        import socket
        import threading
        self._socket, self._threading = socket, threading
        self.target = os.path.join(server.socket_dir, ".s.PGSQL.5432")
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[dict] = []
        threading.Thread(target=self._accept, daemon=True, name="pg-proxy").start()

    def url(self, server_url: str) -> str:
        """`server_url` (a PgServer URL) through this proxy."""
        return server_url.replace("@/", f"@127.0.0.1:{self.port}/").replace(
            f"?host={os.path.dirname(self.target)}&", "?").replace(
            f"?host={os.path.dirname(self.target)}", "")

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = self._socket.socket(self._socket.AF_UNIX)
            upstream.connect(self.target)
            pair = {"sockets": (client, upstream), "forgotten": False}
            with self._lock:
                self._pairs.append(pair)
            for src, dst in ((client, upstream), (upstream, client)):
                self._threading.Thread(target=self._pump, args=(pair, src, dst),
                                       daemon=True).start()

    @staticmethod
    def _pump(pair: dict, src, dst) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not pair["forgotten"]:
                    dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(2)  # SHUT_RDWR

    def forget(self) -> None:
        with self._lock:
            for pair in self._pairs:
                pair["forgotten"] = True

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            for pair in self._pairs:
                for sock in pair["sockets"]:
                    sock.close()
