"""An S3 (or S3-compatible) bucket, optionally under a key prefix.

The only module that imports boto3/botocore, so the rest of tierfs loads fast
and works without them when no S3 store is used.
"""
from __future__ import annotations

import contextlib
import ctypes
import email.utils
import http.client
import logging
import os
import socket
import threading
import time

import boto3
import botocore
import botocore.exceptions as bce
from botocore.awsrequest import (AWSHTTPConnection, AWSHTTPConnectionPool, AWSHTTPSConnection,
                                 AWSHTTPSConnectionPool, AWSRequest)
from botocore.config import Config

from tierfs.cold import check_s3_environment
from tierfs.cold.base import check_range, probe_key
from tierfs.errors import (ColdConfigError, ColdStoreError, ConditionalWritesUnsupported,
                           ObjectNotFound, PreconditionFailed)

log = logging.getLogger(__name__)

_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
# A conditional write lost: the object changed, or another conditional write of it was
# under way at the same moment.
_CHANGED = {"PreconditionFailed", "ConditionalRequestConflict"}
_DENIED = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403",
    "Forbidden", "AllAccessDisabled", "ExpiredToken", "InvalidToken",
}
_TRANSIENT = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
    "RequestTimeoutException", "InternalError", "ServiceUnavailable", "503", "500",
}
# bytearray(n) zeroes its n bytes holding the interpreter lock: for a fetched span of
# 8 MiB, 2,048 fresh pages faulted in while the event loop waits for the lock.
# A body's buffer is made unfilled instead (it is returned only once every byte of it
# is received), so its pages fault in recv_into(), with the lock released.
_unfilled_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_unfilled_bytearray.restype = ctypes.py_object
_unfilled_bytearray.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
# A GET's body must arrive within its timeout plus this rate's time for its size: the
# socket's read timeout bounds each wait for bytes, never a body that trickles in.
MIN_GET_RATE = 1 << 20  # bytes per second
# A PUT's share of a slow uplink may be far below a GET's: 32 uploads of 64 MiB packs
# at once over 100 Mbit/s get about 0.4 MB/s each, and must still finish.
MIN_PUT_RATE = 1 << 18  # bytes per second
GET_PIECE = 1 << 20  # a body is read this much at a time (into a file: the buffer's size)
PRESIGNED_GET_S = 15 * 60  # a presigned GET's URL is signed for each GET; it expires after this
# After a presigned GET is refused, GETs go through boto3 for this long, then one is
# tried presigned again: a 403 may also mean credentials revoked for a while, not a
# bucket policy that refuses presigned URLs for good.
PRESIGNED_RETRY_S = 10 * 60
# S3 refuses a request signed further than this off its own clock (RequestTimeTooSkewed).
MAX_CLOCK_SKEW_S = 15 * 60
# S3 refuses a single PutObject above 5 GiB: a file larger than this (a checkpoint of a
# namespace of millions of files) goes up as a multipart upload, a part at a time.
MULTIPART_THRESHOLD = 1 << 30
MULTIPART_PART = 64 << 20  # S3's minimum is 5 MiB (but for the last part)
MAX_PARTS = 10_000  # S3's limit
# Connections kept for reuse: one for each call that may run at once, the engine's 32
# S3 threads and the lease, sync and control calls on threads of their own. A call
# beyond them closes its connection when it ends (urllib3 warns each time) and the
# next one opens a new connection.
MAX_CONNECTIONS = 32 + 16
CUT_RETRY_S = 0.05  # how often the watchdog looks again at an overdue request still connecting


class _Request:
    """The bound on the requests of one store call (in one thread)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = float("inf")  # of the request being sent
        self.conn = None  # its connection
        self.expired = False


class _Watchdog:
    """Ends each HTTP request that runs past its bound. The socket timeout bounds
    each wait for bytes, never an answer that trickles in a byte at a time (its
    headers too): such a request would hold its worker thread and its S3 slot as long
    as the server goes on. One thread for all stores shuts the socket of an overdue
    request down, which fails the request at once (the connection is then dropped)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._calls: dict[int, _Request] = {}  # thread id -> its bounded call
        self._wake_at = float("inf")  # when the watchdog looks again, unless notified
        self._thread = None

    @contextlib.contextmanager
    def bound(self, seconds: float):
        """Bound each request the calling thread sends inside this block to
        `seconds` from its start; yields the _Request, whose `expired` says whether
        the watchdog ended one."""
        me, call = threading.get_ident(), _Request(seconds)
        with self._cond:
            self._calls[me] = call
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="s3-deadlines",
                                                daemon=True)
                self._thread.start()
        try:
            yield call
        finally:
            with self._cond:
                del self._calls[me]

    def sending(self, conn) -> None:
        """A connection starts a request in this thread: its bound starts now."""
        with self._cond:
            call = self._calls.get(threading.get_ident())
            for other in self._calls.values():
                if other.conn is conn:  # back in the pool, taken by another call
                    other.conn = None
            if call is not None:
                self._arm(call, conn, time.monotonic() + call.seconds)

    def reading(self, conn, deadline: float) -> None:
        """The calling thread reads the body of a request on `conn` until `deadline`."""
        with self._cond:
            self._arm(self._calls[threading.get_ident()], conn, deadline)

    def _arm(self, call: _Request, conn, deadline: float) -> None:
        """Cut `conn` at `deadline` (with the condition held)."""
        call.conn, call.deadline = conn, deadline
        if deadline < self._wake_at:  # else the watchdog wakes in time anyway:
            self._cond.notify()       # a thread wakeup per request is dear

    def _watch(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for call in self._calls.values():
                    if call.conn is not None and call.deadline <= now:
                        call.expired = True
                        if _cut(call.conn):
                            call.conn = None
                        else:  # still connecting: cut it once it has a socket
                            call.deadline = now + CUT_RETRY_S
                wake = min((c.deadline for c in self._calls.values() if c.conn is not None),
                           default=None)
                self._wake_at = float("inf") if wake is None else wake
                self._cond.wait(None if wake is None else wake - now)


class _BodySocket:
    """What the watchdog cuts to end a body's read: the connection's socket, or where
    the server closes the connection after its answer (http.client then hands the
    socket over to the response), the socket the response reads from."""

    def __init__(self, conn, response):
        self.sock = conn.sock or getattr(getattr(response.fp, "raw", None), "_sock", None)


def _cut(conn) -> bool:
    """Shut the connection's socket down, failing the request on it; False if it
    has no socket yet."""
    sock = getattr(conn, "sock", None)
    if sock is None:
        return False
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    return True


_WATCHDOG = _Watchdog()


class _Watched:
    def request(self, *args, **kwargs):
        _WATCHDOG.sending(self)
        return super().request(*args, **kwargs)


class _HTTPConnection(_Watched, AWSHTTPConnection):
    pass


class _HTTPSConnection(_Watched, AWSHTTPSConnection):
    pass


class _HTTPPool(AWSHTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(AWSHTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


def _watch_requests(client) -> None:
    """Make the client's connections tell the watchdog of each request they send.
    botocore offers no hook for this: its pool classes are swapped, where they are
    where this botocore keeps them (shared by its proxy managers)."""
    http = getattr(getattr(client, "_endpoint", None), "http_session", None)
    pools = getattr(http, "_pool_classes_by_scheme", None)
    if not isinstance(pools, dict) or set(pools) != {"http", "https"}:
        log.warning("botocore %s keeps its connection pools elsewhere: only each wait "
                    "for bytes of an S3 request is bounded, not the whole request",
                    botocore.__version__)
        return
    pools["http"], pools["https"] = _HTTPPool, _HTTPSPool


def _clock_skew(e: bce.ClientError) -> float | None:
    """How far this node's clock is ahead of the server's (seconds, negative: behind),
    by the Date of its answer; None where it sent none."""
    date = e.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return time.time() - email.utils.parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        return None


class _AnswerCutShort(bce.ConnectionError):
    fmt = "the connection closed before the whole answer arrived"


# The successful answers whose headers or body tierfs reads; of the others only the
# status counts.
_READ_ANSWERS = {"GetObject", "HeadObject", "ListObjectsV2"}


def _refuse_cut_answers(response_dict, operation_model, **_kwargs) -> None:
    """botocore's before-parse hook: refuse an answer the connection cut short, as
    a closed connection (transient). http.client takes headers that end with the
    connection for whole ones, and botocore reads a body that is not streamed
    without checking its Content-Length: a HEAD would have no size, a GET an empty
    body, a LIST no keys."""
    headers = response_dict["headers"]
    if response_dict["status_code"] >= 300 or operation_model.name not in _READ_ANSWERS:
        return
    length = headers.get("content-length")
    if length is None:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return  # urllib3 fails a chunked body cut short
        cut = True
    else:
        body = response_dict.get("body")
        cut = (isinstance(body, bytes) and operation_model.http.get("method") != "HEAD"
               and length.isdigit() and len(body) < int(length))
    if cut:
        raise _AnswerCutShort()


def _config_error(e: Exception) -> ColdConfigError:
    """What boto3 refused in the AWS configuration, as one line naming the setting and
    the fix. The arguments and the environment were checked before, so what is left is
    mostly the AWS config file."""
    env = os.environ
    if isinstance(e, bce.ProfileNotFound):
        var = next((v for v in ("AWS_DEFAULT_PROFILE", "AWS_PROFILE") if env.get(v)),
                   "AWS_PROFILE")
        return ColdConfigError(
            f"AWS profile {e.kwargs.get('profile')!r} ({var}) is in neither the AWS config "
            f"file nor the credentials file: fix {var}, unset it, or add the profile to "
            f"~/.aws/config")
    if isinstance(e, bce.InvalidRegionError):
        return ColdConfigError(
            f"S3 region {e.kwargs.get('region_name')!r} from the AWS config file is not a "
            f"region name: fix its region setting, or pass --s3-region (e.g. us-east-1)")
    if isinstance(e, bce.ConfigParseError):
        return ColdConfigError(
            f"cannot parse the AWS config file {e.kwargs.get('path')}: fix it, or point "
            f"AWS_CONFIG_FILE at another file")
    if isinstance(e, ValueError) and str(e).startswith("Invalid endpoint"):
        url = str(e).partition(": ")[2]
        return ColdConfigError(
            f"S3 endpoint {url!r} from the AWS config file (endpoint_url) is not a URL: fix "
            f"it to http://HOST:PORT or https://HOST, or pass --s3-endpoint")
    return ColdConfigError(
        f"invalid AWS configuration: {e}: check the AWS_* environment variables and "
        f"~/.aws/config")


def _asked_range(whole: bytes, offset: int, length: int | None) -> bytes:
    """The range a GET asked for, out of the whole object that came instead (a proxy or
    a server that ignores Range)."""
    return whole[offset:] if length is None else whole[offset:offset + length]


class S3Store:
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        path_style: bool = False,
        connect_timeout: float = 10,
        read_timeout: float = 30,
        get_timeout: float = 30,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.get_timeout = get_timeout  # --cold-timeout: see MIN_GET_RATE
        self.presigned_gets = True  # get() sends presigned URLs: see _get_presigned
        self.presigned_retry_s = PRESIGNED_RETRY_S
        self._presigned_refused_at: float | None = None  # monotonic time of the last refusal
        config = Config(
            max_pool_connections=MAX_CONNECTIONS,
            # tierfs retries itself (RetryingStore): one attempt (max_attempts counts
            # retries after the first, so 1 had botocore send each failed request twice).
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            # SigV4 for presigned GETs too (botocore presigns with SigV2 unless told).
            signature_version="s3v4",
            s3={"addressing_style": "path"} if path_style else None,
            # Default CRC trailers break some S3-compatible servers; tierfs
            # checksums its data itself.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        check_s3_environment(os.environ, endpoint=endpoint, region=region)
        # A private session: the default one is shared and not thread-safe to create clients from.
        # endpoint=None lets boto3 use AWS_ENDPOINT_URL or the AWS default.
        try:
            self._client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint, region_name=region, config=config
            )
        except (ValueError, bce.BotoCoreError) as e:
            raise _config_error(e) from None
        _watch_requests(self._client)
        self._client.meta.events.register("before-parse.s3", _refuse_cut_answers)
        self.endpoint = self._client.meta.endpoint_url

    # -- helpers ---------------------------------------------------------

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, e: Exception, op: str, key: str | None = None) -> ColdStoreError:
        """Translate a botocore exception into a tierfs error."""
        what = f"{op} s3://{self.bucket}/{self._key(key)}" if key is not None else f"{op} on {self.describe()}"
        if isinstance(e, (bce.NoCredentialsError, bce.PartialCredentialsError)):
            return ColdConfigError(
                "no AWS credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
            )
        if isinstance(e, (bce.ConnectionError, bce.HTTPClientError)):
            return ColdStoreError(f"{what} failed: cannot reach S3 endpoint {self.endpoint}: {e}", transient=True)
        if isinstance(e, bce.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if code == "NoSuchBucket":
                return ColdConfigError(self._missing_bucket())
            if code in _NOT_FOUND:
                return ObjectNotFound(f"object '{key}' not found in {self.describe()}")
            if code == "InvalidObjectState":  # a 403 the credentials have no part in
                return ColdConfigError(
                    f"{what} failed: the object is archived (an archive storage class "
                    f"such as Glacier, set by a lifecycle rule of bucket '{self.bucket}'): "
                    f"restore it (aws s3api restore-object) and keep tierfs's objects out "
                    f"of that rule")
            skew = _clock_skew(e) if code == "RequestTimeTooSkewed" or status == 403 else None
            if code == "RequestTimeTooSkewed" or (skew and abs(skew) > MAX_CLOCK_SKEW_S):
                off = (f"{abs(skew) / 60:.0f} minutes {'ahead of' if skew > 0 else 'behind'}"
                       if skew else "more than 15 minutes off")
                return ColdConfigError(
                    f"{self.describe()} refused the request: this node's clock is {off} "
                    f"the bucket's (S3 allows 15 minutes): set the clock right (NTP, e.g. "
                    f"timedatectl set-ntp true)")
            if code in _DENIED or status == 403:
                return ColdConfigError(
                    f"access denied to bucket '{self.bucket}' ({code}): "
                    "check AWS credentials (AWS_ACCESS_KEY_ID/AWS_PROFILE)"
                )
            if code in _TRANSIENT or status >= 500 or status == 429:
                return ColdStoreError(f"{what} failed: {code} (HTTP {status})", transient=True)
            return ColdStoreError(f"{what} failed: {code} (HTTP {status})")
        return ColdStoreError(f"{what} failed: {e}")

    @contextlib.contextmanager
    def _bounded(self, op: str, key: str | None, nbytes: int = 0):
        """Bound each request sent inside the block to --cold-timeout plus
        MIN_PUT_RATE's time for the `nbytes` it sends; one that runs past that fails,
        transient (a GET's body has its own bound: _read_body)."""
        seconds = self.get_timeout + nbytes / MIN_PUT_RATE
        cause = None
        with _WATCHDOG.bound(seconds) as call:
            try:
                yield
            except (bce.BotoCoreError, bce.ClientError) as e:
                if not call.expired:
                    raise
                cause = e
        # Also when botocore took what came before the cut for a whole answer (headers
        # end at the end of the stream): it cannot be trusted.
        if call.expired:
            what = f"s3://{self.bucket}/{self._key(key)}" if key is not None \
                else self.describe()
            raise ColdStoreError(
                f"{op} {what} failed: no answer within {seconds:g}s: the bucket or the "
                f"network is too slow (raise --cold-timeout if it is expected)",
                transient=True) from cause

    def _read_body(self, body, size: int | None, key: str, started: float, into=None,
                   skip: int = 0):
        """A GET's whole body (botocore's or urllib3's answer, `size` bytes), as a
        bytearray, or a transient error once the GET runs past its deadline (a stalled
        server or network must not hold a thread and an S3 slot for ever). With `into`,
        a file: the body goes there in pieces (its first `skip` bytes dropped) and the
        count written is returned."""
        raw = getattr(body, "_raw_stream", body)  # urllib3's response (under botocore's body)
        # http.client's response under urllib3's: its readinto() receives into our
        # buffer with the interpreter lock released; urllib3's read() and read1()
        # make a bytes object of each piece, copied again into the buffer under the
        # lock (the lock the event loop waits for while a cold epoch streams in).
        fp = getattr(raw, "_fp", None)
        if size is None or not hasattr(fp, "readinto") or getattr(raw, "connection", None) is None:
            if into is None:
                return body.read()  # no length to read to (S3 always sends one), or no readinto
            data = body.read()[skip:]
            into.write(data)
            return len(data)
        limit = self.get_timeout + size / MIN_GET_RATE
        # One buffer of the body's size: gathering pieces and joining them touched every
        # page twice (a page fault each, above the daemon's mmap threshold).
        buf = _unfilled_bytearray(None, size) if into is None \
            else bytearray(min(size, GET_PIECE))
        view, got = memoryview(buf), 0
        # readinto() waits until its piece is full: a body that trickles in is cut by
        # the watchdog at its deadline (shut down, the read ends short).
        with _WATCHDOG.bound(limit) as call:
            _WATCHDOG.reading(_BodySocket(raw.connection, fp), started + limit)
            try:
                while got < size:
                    want = min(size - got, GET_PIECE)
                    piece = view[got:got + want] if into is None else view[:want]
                    n = fp.readinto(piece)
                    if not n:
                        break
                    if into is not None and got + n > skip:
                        into.write(piece[max(0, skip - got):n])
                    got += n
            except (OSError, http.client.HTTPException) as e:  # a read timeout, a reset
                if not call.expired:
                    body.close()
                    raise ColdStoreError(f"get s3://{self.bucket}/{self._key(key)} failed: "
                                         f"{e}", transient=True) from e
        if got < size:
            body.close()  # the connection is cut or broken: never back to the pool
            if call.expired:
                raise ColdStoreError(
                    f"get s3://{self.bucket}/{self._key(key)} failed: {got} of its "
                    f"{size} bytes arrived in {limit:.0f}s: the bucket or the network "
                    f"is too slow (raise --cold-timeout if it is expected)", transient=True)
            raise ColdStoreError(
                f"get s3://{self.bucket}/{self._key(key)} failed: the connection "
                f"closed after {got} of {size} bytes", transient=True)
        raw.release_conn()  # read to its end: the connection serves the next request
        return buf if into is None else max(0, size - skip)

    def _missing_bucket(self) -> str:
        return (
            f"bucket '{self.bucket}' does not exist at endpoint {self.endpoint}: "
            f"create it (aws s3 mb s3://{self.bucket}) or fix the URL"
        )

    # -- ObjectStore -----------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        try:
            # A single PutObject is atomic: readers see old or new, never part.
            body = data if isinstance(data, (bytes, bytearray)) else bytes(data)  # no copy of a pack
            with self._bounded("put", key, len(body)):
                self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body)
        except (bce.BotoCoreError, bce.ClientError) as e:
            raise self._error(e, "put", key) from e

    def put_file(self, key: str, f) -> None:
        start = f.tell()
        size = f.seek(0, os.SEEK_END) - start
        f.seek(start)
        if size > MULTIPART_THRESHOLD:
            return self._put_in_parts(key, f, size)
        try:
            # One PutObject streamed from the file (botocore reads it in pieces).
            with self._bounded("put", key, size):
                self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=f,
                                        ContentLength=size)
        except (bce.BotoCoreError, bce.ClientError) as e:
            raise self._error(e, "put", key) from e

    def _put_in_parts(self, key: str, f, size: int) -> None:
        """A multipart upload of `size` bytes from `f`, one part in memory at a time.
        One that fails is aborted, so that no parts are left (and billed); a retry
        starts over."""
        part = max(MULTIPART_PART, -(-size // MAX_PARTS))
        args = {"Bucket": self.bucket, "Key": self._key(key)}
        try:
            with self._bounded("put", key):
                upload = self._client.create_multipart_upload(**args)["UploadId"]
        except (bce.BotoCoreError, bce.ClientError) as e:
            raise self._error(e, "put", key) from e
        try:
            parts = []
            for number, offset in enumerate(range(0, size, part), start=1):
                body = f.read(min(part, size - offset))
                with self._bounded("put", key, len(body)):
                    etag = self._client.upload_part(**args, UploadId=upload, PartNumber=number,
                                                    Body=body)["ETag"]
                parts.append({"PartNumber": number, "ETag": etag})
            # S3 may take a while to join the parts: a second per part.
            with self._bounded("put", key, len(parts) * MIN_PUT_RATE):
                self._client.complete_multipart_upload(**args, UploadId=upload,
                                                       MultipartUpload={"Parts": parts})
        except BaseException as e:
            self._abort_upload(key, upload)
            if isinstance(e, (bce.BotoCoreError, bce.ClientError)):
                raise self._error(e, "put", key) from e
            raise

    def _abort_upload(self, key: str, upload: str) -> None:
        try:
            with self._bounded("put", key):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key),
                                                    UploadId=upload)
        except bce.ClientError as e:
            if e.response.get("Error", {}).get("Code") != "NoSuchUpload":  # else none left
                self._abort_failed(key, upload, self._error(e, "abort", key))
        except bce.BotoCoreError as e:
            self._abort_failed(key, upload, self._error(e, "abort", key))
        except ColdStoreError as e:
            self._abort_failed(key, upload, e)

    def _abort_failed(self, key: str, upload: str, e: ColdStoreError) -> None:
        log.warning("could not abort the failed multipart upload %s of s3://%s/%s (%s): its "
                    "parts stay billed until removed: add a lifecycle rule with "
                    "AbortIncompleteMultipartUpload to the bucket", upload, self.bucket,
                    self._key(key), e)

    def get_file(self, key: str, f, offset: int = 0) -> int:
        args = {"Bucket": self.bucket, "Key": self._key(key)}
        if offset:
            args["Range"] = f"bytes={offset}-"
        try:
            started = time.monotonic()
            with self._bounded("get", key):
                resp = self._client.get_object(**args)
            skip = offset if "Range" in args and \
                resp["ResponseMetadata"]["HTTPStatusCode"] == 200 else 0  # Range ignored
            return self._read_body(resp["Body"], resp.get("ContentLength"), key, started,
                                   into=f, skip=skip)
        except bce.ClientError as e:
            if e.response.get("Error", {}).get("Code") == "InvalidRange":
                return 0  # offset at or after the end
            raise self._error(e, "get", key) from e
        except bce.BotoCoreError as e:
            raise self._error(e, "get", key) from e

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        check_range(offset, length)
        if length == 0:  # an empty Range is not expressible; just confirm existence
            if self.size(key) is None:
                raise ObjectNotFound(f"object '{key}' not found in {self.describe()}")
            return b""
        args = {"Bucket": self.bucket, "Key": self._key(key)}
        if offset or length is not None:
            last = "" if length is None else str(offset + length - 1)
            args["Range"] = f"bytes={offset}-{last}"
        if self._presigning():
            body = self._get_presigned(key, args, offset, length)
            if body is not None:
                return body
        try:
            started = time.monotonic()
            with self._bounded("get", key):
                resp = self._client.get_object(**args)
            # Read inside the try: a dropped connection surfaces while streaming.
            body = self._read_body(resp["Body"], resp.get("ContentLength"), key, started)
            if "Range" in args and resp["ResponseMetadata"]["HTTPStatusCode"] == 200:
                body = _asked_range(body, offset, length)
            return body
        except bce.ClientError as e:
            if e.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""  # range starts at or after the end
            raise self._error(e, "get", key) from e
        except bce.BotoCoreError as e:
            raise self._error(e, "get", key) from e

    def _presigning(self) -> bool:
        """Whether get() sends a presigned URL now: unless turned off, or refused less
        than presigned_retry_s ago."""
        refused = self._presigned_refused_at
        return self.presigned_gets and (
            refused is None or time.monotonic() - refused >= self.presigned_retry_s)

    def _get_presigned(self, key: str, args: dict, offset: int, length: int | None):
        """get() as a presigned URL sent on the client's own connections (its pool,
        proxies, TLS settings and watchdog), without botocore's machinery for a request
        and its answer: that took most of a GET's CPU in the daemon, under the lock its
        event loop needs to answer FUSE requests (a cold epoch makes hundreds of GETs a
        second). The URL is signed for each GET, so refreshed credentials apply. None
        where the answer is not the data (an error, a redirect): get_object() then asks
        again and names what is wrong. An answer that says presigned URLs are refused
        here (a redirect, 400 or 403: a bucket policy may allow only signed headers)
        turns them off for this store for presigned_retry_s."""
        started = time.monotonic()
        try:
            url = self._client.generate_presigned_url(
                "get_object", Params={"Bucket": args["Bucket"], "Key": args["Key"]},
                ExpiresIn=PRESIGNED_GET_S)
            headers = {"Range": args["Range"]} if "Range" in args else {}
            request = AWSRequest(method="GET", url=url, headers=headers,
                                 stream_output=True).prepare()
            with self._bounded("get", key):
                answer = self._client._endpoint.http_session.send(request)
        except bce.BotoCoreError as e:
            raise self._error(e, "get", key) from e
        status, size = answer.status_code, answer.headers.get("Content-Length", "")
        if status not in (200, 206) or not size.isdigit():
            answer.raw.close()  # an error's answer: not worth keeping the connection for
            if 300 <= status < 400 or status in (400, 403):
                self._presigned_refused_at = time.monotonic()
                log.info("GETs from %s go through boto3 for %.0f s: a presigned GET was "
                         "answered HTTP %d", self.describe(), self.presigned_retry_s, status)
            return None
        body = self._read_body(answer.raw, int(size), key, started)
        if "Range" in args and status == 200:
            body = _asked_range(body, offset, length)
        return body

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        try:
            started = time.monotonic()
            with self._bounded("get", key):
                resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            return self._read_body(resp["Body"], resp.get("ContentLength"), key,
                                   started), resp["ETag"]
        except (bce.BotoCoreError, bce.ClientError) as e:
            raise self._error(e, "get", key) from e

    def put_if(self, key: str, data: bytes, version: str | None) -> None:
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        try:
            with self._bounded("put", key, len(data)):
                self._client.put_object(Bucket=self.bucket, Key=self._key(key),
                                        Body=bytes(data), **condition)
        except bce.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if code in _CHANGED or status in (409, 412) or (version and code in _NOT_FOUND):
                raise PreconditionFailed(f"object '{key}' in {self.describe()} changed") from e
            if code == "NotImplemented" or status == 501:
                raise ConditionalWritesUnsupported(
                    f"{self.describe()} does not support conditional writes ({code})") from e
            raise self._error(e, "put", key) from e
        except bce.BotoCoreError as e:
            raise self._error(e, "put", key) from e

    def delete(self, key: str) -> None:
        try:
            # DeleteObject succeeds for missing keys, which gives idempotence.
            with self._bounded("delete", key):
                self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (bce.BotoCoreError, bce.ClientError) as e:
            raise self._error(e, "delete", key) from e

    def list(self, prefix: str = "") -> list[str]:
        # The trailing "/" keeps prefix "a" from seeing keys of prefix "ab".
        base = f"{self.prefix}/" if self.prefix else ""
        keys = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base + prefix
            )
            with self._bounded("list", prefix):  # each page's request
                for page in pages:
                    keys.extend(obj["Key"][len(base):] for obj in page.get("Contents", []))
        except (bce.BotoCoreError, bce.ClientError) as e:
            raise self._error(e, "list", prefix) from e
        return sorted(keys)

    def size(self, key: str) -> int | None:
        try:
            with self._bounded("size", key):
                resp = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except (bce.BotoCoreError, bce.ClientError) as e:
            err = self._error(e, "size", key)
            if isinstance(err, ObjectNotFound):
                return None
            raise err from e
        return resp["ContentLength"]

    def check(self) -> None:
        try:
            with self._bounded("check", None):
                self._client.head_bucket(Bucket=self.bucket)
        except bce.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise ColdConfigError(self._missing_bucket()) from e
            raise self._check_error(e) from e
        except bce.BotoCoreError as e:
            raise self._check_error(e) from e
        # Bucket-level access can be allowed while object writes are not;
        # find that out now rather than at the first eviction.
        probe, key = b"tierfs probe", probe_key()
        try:
            self.put(key, probe)
            got = self.get(key)
            self.delete(key)
        except ColdConfigError:
            raise
        except ColdStoreError as e:
            if e.transient:  # throttling, 5xx: the caller retries the check
                raise
            raise ColdConfigError(f"cannot use {self.describe()}: {e}") from e
        if got != probe:
            raise ColdConfigError(
                f"{self.describe()} returned wrong data for probe key {key}: check the endpoint"
            )

    def _check_error(self, e: Exception) -> ColdStoreError:
        if isinstance(e, (bce.ConnectionError, bce.HTTPClientError)):
            return ColdConfigError(
                f"cannot reach S3 endpoint {self.endpoint}: check --s3-endpoint / AWS_ENDPOINT_URL"
            )
        err = self._error(e, "check")
        if isinstance(err, ColdConfigError) or err.transient:  # transient: retried
            return err
        return ColdConfigError(f"cannot use {self.describe()} at endpoint {self.endpoint}: {err}")

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
