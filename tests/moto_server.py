"""Run a throwaway moto S3 server in a subprocess for tests.

A plain helper module (not a conftest): import moto_server() where needed.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
TEST_REGION = "us-east-1"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Talk to the local server directly even when an HTTP proxy is configured.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _answers(url: str) -> bool:
    try:
        _DIRECT.open(url, timeout=1).close()
        return True
    except urllib.error.HTTPError:
        return True  # any HTTP status means the server is up
    except OSError:
        return False


# endpoint -> pid of each server running (a benchmark counts its CPU)
SERVER_PIDS: dict[str, int] = {}


@contextlib.contextmanager
def moto_server(timeout_s: float = 30, ranges: bool = False) -> Iterator[str]:
    """Start moto's server on a free port; yield its endpoint URL; stop it on exit.
    ranges: the variant that reads only the range of a ranged GET (moto_ranges.py)."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    module = "tests.moto_ranges" if ranges else "moto.server"
    with tempfile.TemporaryFile(prefix="moto-server-", suffix=".log") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "-p", str(port), "-H", "127.0.0.1"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=_REPO,  # where `tests` is a package
            start_new_session=True,  # Ctrl-C reaches the caller, which stops it in order
        )
        try:
            deadline = time.monotonic() + timeout_s
            while not _answers(endpoint):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read()[-2000:].decode(errors="replace")
                    raise RuntimeError(f"moto server did not start at {endpoint}:\n{tail}")
                time.sleep(0.1)
            SERVER_PIDS[endpoint] = proc.pid
            yield endpoint
        finally:
            SERVER_PIDS.pop(endpoint, None)
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def s3_env(endpoint: str) -> dict[str, str]:
    """Environment variables that point boto3 at the test server."""
    return {**TEST_CREDENTIALS, "AWS_DEFAULT_REGION": TEST_REGION, "AWS_ENDPOINT_URL": endpoint}


def make_bucket(endpoint: str, name: str) -> None:
    import boto3

    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name=TEST_REGION,
        aws_access_key_id=TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )
    client.create_bucket(Bucket=name)
