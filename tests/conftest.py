"""Shared fixtures: a moto S3 server per session and mounted tierfs daemons."""
from __future__ import annotations

import os
import uuid

import pytest

from tests.harness import Mount
from tests.moto_server import make_bucket, moto_server, s3_env


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
    problems = []
    for m in created:
        m.cleanup()
        problems += m.unexpected_log_lines()
    if problems and not request.node.get_closest_marker("allow_log_errors"):
        pytest.fail("daemon logged unexpected errors:\n" + "\n".join(problems[:20]))


@pytest.fixture
def mnt(mount_factory):
    """One mounted filesystem on the embedded file:// cold store."""
    return mount_factory()


@pytest.fixture
def s3_mount(mount_factory, s3_url, s3_endpoint):
    env = dict(os.environ, **s3_env(s3_endpoint))
    return mount_factory(cold_url=s3_url, env=env)
