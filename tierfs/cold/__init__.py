"""Cold tier: object stores that hold evicted file data.

Importing this package never imports boto3; the S3 store loads on demand.
"""
from __future__ import annotations

import os
import posixpath
import re
from urllib.parse import urlsplit

from tierfs.cold.base import ObjectStore
from tierfs.errors import ColdConfigError, UserError

__all__ = ["ObjectStore", "check_s3_environment", "endpoint_problem", "open_store",
           "parse_cold_url", "region_problem"]

_FORMS = "use file:///abs/path or s3://bucket/prefix"
# S3 bucket naming rules: 3-63 chars of a-z 0-9 . -, starting and ending
# with a letter or digit, no "..", not shaped like an IP address.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IPV4 = re.compile(r"\d+\.\d+\.\d+\.\d+")
# What botocore accepts as an endpoint's host name (botocore.utils.is_valid_endpoint_url)
# and as a region name (validate_region_name): it refuses anything else with a bare
# ValueError or InvalidRegionError when the client is created.
_HOST = re.compile(r"((?!-)[a-z\d-]{1,63}(?<!-)\.)*((?!-)[a-z\d-]{1,63}(?<!-))", re.I)
_REGION = re.compile(r"(?![0-9]+$)(?!-)[a-zA-Z0-9-]{1,63}(?<!-)")


def endpoint_problem(url: str) -> str | None:
    """Why boto3 would refuse `url` as an S3 endpoint, as the end of a sentence naming
    the setting; None if it is fine."""
    if not url.strip():
        return "is empty: give a URL such as http://HOST:PORT, or leave it out for AWS"
    if "://" not in url:
        return f"has no scheme: use http://{url} or https://{url}"
    scheme, rest = url.split("://", 1)
    if scheme.lower() not in ("http", "https"):
        return f"has scheme {scheme!r}: use http://{rest} or https://{rest}"
    parts = urlsplit(url)
    host = parts.hostname or ""
    if not host:
        return "names no host: use http://HOST:PORT or https://HOST"
    if ":" not in host and (len(host) > 255 or not _HOST.fullmatch(host.rstrip("."))):
        return (f"has an invalid host name {host!r}: use letters, digits, '-' and '.', "
                f"or an IP address")
    try:
        parts.port
    except ValueError:
        return f"has an invalid port: use {scheme}://{host}:PORT with PORT from 1 to 65535"
    return None


def region_problem(region: str) -> str | None:
    """Why boto3 would refuse `region` (same form as endpoint_problem)."""
    if not _REGION.fullmatch(region):
        return "is not a region name: use one like us-east-1 (letters, digits and '-')"
    return None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def check_s3_environment(env=os.environ, *, endpoint: str | None = None,
                         region: str | None = None) -> None:
    """Check the settings boto3 takes from the environment that it would refuse with an
    error naming neither the variable nor the fix. Cheap (no boto3 import): the mount
    command runs it before it spawns the daemon."""
    if endpoint is not None:
        problem = endpoint_problem(endpoint)
        if problem:
            raise ColdConfigError(f"--s3-endpoint {endpoint} {problem}")
    elif not _truthy(env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")):
        # botocore's order; an empty variable counts as unset.
        for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if env.get(var):
                problem = endpoint_problem(env[var])
                if problem:
                    raise ColdConfigError(f"{var}={env[var]} {problem}")
                break
    if region is not None:
        problem = region_problem(region)
        if problem:
            raise ColdConfigError(f"--s3-region {region} {problem}")
    elif env.get("AWS_DEFAULT_REGION"):
        problem = region_problem(env["AWS_DEFAULT_REGION"])
        if problem:
            raise ColdConfigError(f"AWS_DEFAULT_REGION={env['AWS_DEFAULT_REGION']} {problem}")
    # botocore takes AWS_CA_BUNDLE, else REQUESTS_CA_BUNDLE; set but empty, it refuses to
    # create a client; a missing file fails every request as "cannot connect".
    for var in ("AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE"):
        if var in env:
            path = env[var]
            if not path.strip():
                raise ColdConfigError(f"{var} is set but empty: unset it (unset {var}) or "
                                      f"set it to a CA bundle file")
            if not os.path.exists(path):
                raise ColdConfigError(f"{var}={path} does not exist: set it to an existing "
                                      f"CA bundle file, or unset it")
            break


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
    timeout: float = 30,
) -> ObjectStore:
    """Build the store a cold URL names. Does not contact it; call check() for that.
    `timeout` (--cold-timeout) bounds an S3 GET's body (S3Store's MIN_GET_RATE)."""
    scheme, location, prefix = parse_cold_url(url)
    if scheme == "file":
        from tierfs.cold.file import FileStore

        return FileStore(location)
    from tierfs.cold.s3 import S3Store  # lazy: keeps boto3 out of non-S3 runs

    return S3Store(location, prefix, endpoint=s3_endpoint, region=s3_region,
                   path_style=s3_path_style, get_timeout=timeout)
