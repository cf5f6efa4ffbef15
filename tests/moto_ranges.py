"""moto's S3 server, except that a GET of one byte range reads only that range.

Stock moto reads an object's whole value for every GET and slices the range out of
it: a 64 KiB range of a 64 MiB pack costs it a 64 MiB copy (about 35 ms of CPU on
the benchmark machine, against 3-6 ms for a small object). S3, MinIO and the
file:// bucket read only the range, so a benchmark of packed small files against
stock moto measures moto's copies more than tierfs. `python -m tests.moto_ranges`
takes moto.server's arguments; the benchmark starts it with `--bucket moto-ranges`.
Everything else is moto's own code; the tests use stock moto.
"""
from __future__ import annotations

import re
import threading

from moto.s3.models import FakeKey
from moto.s3.responses import S3Response
from moto.server import main

_ONE_RANGE = re.compile(r"bytes=\d+-\d+")
_request = threading.local()  # moto's server answers each request in a thread


class _Value:
    """A key's value as moto's ranged-GET path uses it: its length, and the slice it
    asks for, read from the key's buffer alone."""

    def __init__(self, key: FakeKey):
        self.key = key

    def __len__(self) -> int:
        return self.key.size

    def __getitem__(self, span: slice) -> bytes:
        start, stop, _step = span.indices(self.key.size)
        with self.key.lock:
            buf = self.key._value_buffer
            buf.seek(start)
            return buf.read(max(0, stop - start))


_stock_value = FakeKey.value


def _value(self: FakeKey):
    return _Value(self) if getattr(_request, "one_range", False) else _stock_value.fget(self)


_stock_key_response = S3Response.key_response


def _key_response(self, request, full_url, headers):
    _request.one_range = (request.method == "GET"
                          and bool(_ONE_RANGE.fullmatch(request.headers.get("range", ""))))
    try:
        return _stock_key_response(self, request, full_url, headers)
    finally:
        _request.one_range = False


FakeKey.value = property(_value, _stock_value.fset)
S3Response.key_response = _key_response

if __name__ == "__main__":
    main()
