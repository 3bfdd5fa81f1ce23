"""Object stores (S3 and S3-compatible ones) as the project reads and writes them: ``s3://BUCKET/KEY`` URLs.

Credentials and endpoints come the way every AWS tool takes them (boto3 reads them; nothing here does):
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or ``AWS_PROFILE``, ``AWS_DEFAULT_REGION``, and
``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for an S3-compatible store (MinIO, Ceph, GCS's
interoperability endpoint, ...). botocore retries a request a few times; above that, a store that does not
answer (connection refused or reset, timeouts, 5xx) is retried with back-off for
``CONVBERT_DS_STORE_PATIENCE`` seconds (default ``DEFAULT_PATIENCE_S``), so a store that restarts mid-run
costs a pause, not the run. Every other failure is a ``StoreError`` whose one line names the URL, the
store's answer and the fix.

A client is made once per process (data-loader workers and forked ranks make their own: boto3 clients do
not survive a fork).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from convbert_ds.disk_full import is_disk_full
from convbert_ds.errors import UserError
from convbert_ds.log import EVERY_RANK, get_logger

logger = get_logger(__name__)

SCHEME = "s3://"
PATIENCE_VAR = "CONVBERT_DS_STORE_PATIENCE"
DEFAULT_PATIENCE_S = 300.0
READ_CHUNK = 8 << 20
T = TypeVar("T")
_BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}")  # what the S3 client accepts (AWS itself: 3-63, lower case)


class StoreError(UserError, OSError):
    """The store refused or failed a request in a way retrying does not fix (or did not answer in time)."""


class StoreNotFound(StoreError, FileNotFoundError):
    """No object at the URL (also a ``FileNotFoundError``)."""


class StoreChanged(StoreError):
    """The object was replaced since it was first read (its ETag changed)."""


def default_cache_dir() -> Path:
    """Where this machine keeps what it read from stores, unless told otherwise (``data.cache_dir``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "convbert_ds"


def is_url(path) -> bool:
    """Whether ``path`` names an object-store location rather than a local one."""
    return isinstance(path, str) and "://" in path


@dataclass(frozen=True)
class Url:
    bucket: str
    key: str  # no leading "/"; "" for the bucket itself

    @classmethod
    def parse(cls, url: str) -> Url:
        if not url.isprintable():  # a newline or tab pasted with it: refused here, shown escaped
            raise StoreError(f"{url!r}: a URL with a control character; write s3://BUCKET/PREFIX")
        if not url.startswith(SCHEME):
            raise StoreError(f"{url}: only s3:// URLs are supported (other S3-compatible stores: s3:// with "
                             f"AWS_ENDPOINT_URL set to the store's endpoint)")
        bucket, _, key = url[len(SCHEME):].partition("/")
        if not bucket:
            raise StoreError(f"{url}: no bucket; write s3://BUCKET/PREFIX")
        if not _BUCKET.fullmatch(bucket):
            raise StoreError(f"{url}: {bucket!r} is not a bucket name (letters, digits, '.', '-' and '_'); write "
                             "s3://BUCKET/PREFIX")
        return cls(bucket, key.strip("/"))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}" if self.key else f"{SCHEME}{self.bucket}"

    def join(self, *parts: str) -> Url:
        return Url(self.bucket, "/".join(p.strip("/") for p in (self.key, *parts) if p.strip("/")))


_clients: dict[tuple, object] = {}
_CLIENT_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_DEFAULT_REGION")


def client():
    """This process's S3 client (boto3's own configuration chain: variables, profile, endpoint)."""
    # A fork's inherited client must not be used (its connections are the parent's), nor one made before the
    # variables that choose the store changed.
    key = (os.getpid(), *(os.environ.get(name) for name in _CLIENT_VARS))
    if key not in _clients:
        import boto3  # slow import: only where a store is used
        from botocore.config import Config
        _clients.clear()
        _clients[key] = boto3.session.Session().client(
            "s3", config=Config(connect_timeout=10, read_timeout=60, retries={"mode": "standard"}))
    return _clients[key]


def endpoint() -> str:
    return client().meta.endpoint_url


def patience_s() -> float:
    try:
        return float(os.environ.get(PATIENCE_VAR, DEFAULT_PATIENCE_S))
    except ValueError:
        raise StoreError(f"{PATIENCE_VAR}={os.environ[PATIENCE_VAR]!r}: expected seconds, e.g. 300") from None


def _transient(error: Exception) -> bool:
    """A failure that asking again may fix: no answer, a connection cut (botocore raises IncompleteReadError
    when a body ends short of its length, and boto3 RetriesExceededError when a download's own retries of
    such cuts ran out: s3transfer's, re-raised as boto3's), or the store saying it is busy or broken (5xx,
    SlowDown)."""
    from boto3.exceptions import RetriesExceededError
    from botocore.exceptions import (ClientError, ConnectionError, HTTPClientError, IncompleteReadError,
                                     ReadTimeoutError)
    from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceededError
    if isinstance(error, (ConnectionError, HTTPClientError, ReadTimeoutError, IncompleteReadError,
                          RetriesExceededError, TransferRetriesExceededError)):
        return True
    if isinstance(error, ClientError):
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or error.response.get("Error", {}).get("Code") in ("SlowDown", "RequestTimeout")
    return False


def _user_error(url: str, error: Exception) -> StoreError:
    """The one line for a failure that retrying does not fix."""
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError
    if isinstance(error, (NoCredentialsError, PartialCredentialsError)):
        return StoreError(f"{url}: no credentials for the store ({error}); set AWS_ACCESS_KEY_ID and "
                          f"AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
    if not isinstance(error, ClientError):  # the client's own text may run over lines: one line
        return StoreError(f"{url}: {type(error).__name__}: {' '.join(str(error).split())}")
    code = str(error.response.get("Error", {}).get("Code", ""))
    bucket = Url.parse(url).bucket
    if code == "NoSuchBucket":
        return StoreError(f"{url}: the store at {endpoint()} has no bucket {bucket!r}; create it or fix the URL "
                          f"(AWS_ENDPOINT_URL chooses the store)")
    if code in ("NoSuchKey", "404", "NotFound"):
        return StoreNotFound(f"{url} not found in the store at {endpoint()}")
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
        return StoreError(f"{url}: access denied ({code}); check the credentials (AWS_PROFILE, "
                          f"AWS_ACCESS_KEY_ID) and the bucket's policy")
    if code in ("PreconditionFailed", "412"):
        return StoreChanged(f"{url} was replaced while this run used it (its ETag changed); restart the run "
                            f"to read the new object, or restore the old one")
    return StoreError(f"{url}: the store answered {code}: {error}")


def call(url, request: Callable[[], T], what: str = "") -> T:
    """``request()``, retried while the store does not answer (up to ``patience_s()``); any other failure
    is a ``StoreError`` naming ``url``, but a full local disk (a download's), which the caller names: it knows
    the path and what is kept."""
    deadline, wait, warned = None, 1.0, False
    while True:
        try:
            return request()
        except Exception as error:  # noqa: BLE001 - every botocore error is sorted below
            if isinstance(error, StoreError) or is_disk_full(error):
                raise
            if not _transient(error):
                raise _user_error(str(url), error) from None
            now = time.monotonic()
            deadline = deadline or now + patience_s()
            if now >= deadline:
                raise StoreError(f"{url}: the store at {endpoint()} did not answer for {patience_s():.0f} s "
                                 f"({type(error).__name__}); check that it is up and AWS_ENDPOINT_URL") from None
            if not warned:
                logger.warning("%s%s: the store did not answer (%s); retrying for up to %.0f s", url,
                               f" ({what})" if what else "", type(error).__name__, deadline - now,
                               extra=EVERY_RANK)  # each rank's own requests wait
                warned = True
            time.sleep(min(wait, max(deadline - now, 0.0)))
            wait = min(wait * 2, 10.0)


def head(url: str) -> tuple[int, str]:
    """The object's size in bytes and its ETag."""
    u = Url.parse(url)
    answer = call(url, lambda: client().head_object(Bucket=u.bucket, Key=u.key), "head")
    return int(answer["ContentLength"]), answer["ETag"]


def exists(url: str) -> bool:
    try:
        head(url)
    except StoreNotFound:
        return False
    return True


def read_range(url: str, start: int, end: int, etag: str | None = None) -> bytes:
    """Bytes ``[start, end)`` of the object; with ``etag``, only of that version (else ``StoreChanged``)."""
    u = Url.parse(url)
    extra = {"IfMatch": etag} if etag else {}

    def request() -> bytes:
        body = client().get_object(Bucket=u.bucket, Key=u.key, Range=f"bytes={start}-{end - 1}", **extra)["Body"]
        data = body.read()
        if len(data) != end - start:  # a connection cut mid-body: botocore returns what came
            from botocore.exceptions import HTTPClientError
            raise HTTPClientError(error=f"{len(data)} of {end - start} bytes")
        return data
    return call(url, request, f"bytes {start}-{end - 1}")


def read_bytes(url: str) -> bytes:
    u = Url.parse(url)
    return call(url, lambda: client().get_object(Bucket=u.bucket, Key=u.key)["Body"].read(), "get")


def sha256(url: str, etag: str | None = None, progress: Callable[[int], None] | None = None) -> str:
    """The object's sha256, streamed (a failure mid-way starts over)."""
    u = Url.parse(url)
    extra = {"IfMatch": etag} if etag else {}

    def request() -> str:
        digest = hashlib.sha256()
        for chunk in client().get_object(Bucket=u.bucket, Key=u.key, **extra)["Body"].iter_chunks(READ_CHUNK):
            digest.update(chunk)
            if progress:
                progress(len(chunk))
        return digest.hexdigest()
    return call(url, request, "hash")


def download(url: str, path: Path) -> None:
    """The object into ``path``, whole or not at all (a temporary name beside it, renamed when complete)."""
    u = Url.parse(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        call(url, lambda: client().download_file(u.bucket, u.key, str(tmp)), "download")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def upload(path: Path, url: str) -> None:
    """A local file to ``url``; the object appears only once it is whole (S3 writes are atomic)."""
    u = Url.parse(url)
    call(url, lambda: client().upload_file(str(path), u.bucket, u.key), "upload")


def upload_tree(directory: Path, url: str, last: tuple[str, ...] = (),
                skip: Callable[[str], bool] = lambda name: False) -> list[str]:
    """Every file under ``directory`` to the same relative names under ``url``, those in ``last`` after all
    the others (a reader that looks for them first finds the rest whole); returns the names uploaded."""
    names = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    names = [n for n in names if not skip(n) and n not in last] + [n for n in last if (directory / n).is_file()]
    prefix = Url.parse(url)
    for name in names:
        upload(directory / name, str(prefix.join(name)))
    return names


def check_writable(url: str) -> None:
    """One small object written under the prefix ``url`` and deleted: a missing bucket or a store that refuses
    writes is one line now, not after the work whose output was to go there."""
    probe = Url.parse(url).join(f".write-check-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    # Errors name ``url``, the prefix the user gave, not the probe's key.
    call(url, lambda: client().put_object(Bucket=probe.bucket, Key=probe.key, Body=b""), "write check")
    call(url, lambda: client().delete_object(Bucket=probe.bucket, Key=probe.key), "write check")


def put_bytes(url: str, data: bytes) -> None:
    u = Url.parse(url)
    call(url, lambda: client().put_object(Bucket=u.bucket, Key=u.key, Body=data), "put")


def list_objects(url: str) -> Iterator[tuple[str, int]]:
    """``(key relative to url, size)`` of every object under the prefix ``url``."""
    u = Url.parse(url)
    prefix = f"{u.key}/" if u.key else ""

    def pages() -> list:
        paginator = client().get_paginator("list_objects_v2")
        return [obj for page in paginator.paginate(Bucket=u.bucket, Prefix=prefix) for obj in page.get("Contents", ())]
    for obj in call(url, pages, "list"):
        yield obj["Key"][len(prefix):], int(obj["Size"])


def delete(url: str) -> None:
    u = Url.parse(url)
    with contextlib.suppress(StoreNotFound):
        call(url, lambda: client().delete_object(Bucket=u.bucket, Key=u.key), "delete")
