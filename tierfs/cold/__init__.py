"""Cold tier: object stores that hold evicted file data.

Importing this package never imports boto3; the S3 store loads on demand.
"""
from __future__ import annotations

import posixpath
import re

from tierfs.cold.base import ObjectStore
from tierfs.errors import UserError

__all__ = ["ObjectStore", "open_store", "parse_cold_url"]

_FORMS = "use file:///abs/path or s3://bucket/prefix"
# S3 bucket naming rules: 3-63 chars of a-z 0-9 . -, starting and ending
# with a letter or digit, no "..", not shaped like an IP address.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IPV4 = re.compile(r"\d+\.\d+\.\d+\.\d+")


def parse_cold_url(url: str) -> tuple[str, str, str]:
    """Split a cold URL into (scheme, location, prefix).

    file:///abs/dir        -> ("file", "/abs/dir", "")
    s3://bucket/some/path/ -> ("s3", "bucket", "some/path")
    """
    if "://" not in url:
        hint = f"file://{url}" if url.startswith("/") else None
        fix = f"use {hint}" if hint else _FORMS
        raise UserError(f"cold location {url!r} is not a URL: {fix}")
    scheme, rest = url.split("://", 1)
    if scheme == "file":
        if not rest.startswith("/"):
            raise UserError(f"cold location {url!r} is not an absolute file URL: use file:///abs/path (three slashes)")
        path = posixpath.normpath("/" + rest.strip("/"))
        return "file", path, ""
    if scheme == "s3":
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise UserError(f"cold location {url!r} names no bucket: use s3://bucket/prefix")
        if not _BUCKET.fullmatch(bucket) or ".." in bucket or _IPV4.fullmatch(bucket):
            raise UserError(
                f"cold location {url!r} has invalid bucket name {bucket!r}: "
                "use 3-63 lowercase letters, digits, '.' or '-', as in s3://my-bucket/prefix"
            )
        prefix = prefix.strip("/")
        if "//" in prefix:
            raise UserError(f"cold location {url!r} has an empty path segment: use s3://bucket/some/prefix")
        return "s3", bucket, prefix
    raise UserError(f"cold location {url!r} has unknown scheme {scheme!r}: {_FORMS}")


def open_store(
    url: str,
    *,
    s3_endpoint: str | None = None,
    s3_region: str | None = None,
    s3_path_style: bool = False,
) -> ObjectStore:
    """Build the store a cold URL names. Does not contact it; call check() for that."""
    scheme, location, prefix = parse_cold_url(url)
    if scheme == "file":
        from tierfs.cold.file import FileStore

        return FileStore(location)
    from tierfs.cold.s3 import S3Store  # lazy: keeps boto3 out of non-S3 runs

    return S3Store(location, prefix, endpoint=s3_endpoint, region=s3_region, path_style=s3_path_style)
