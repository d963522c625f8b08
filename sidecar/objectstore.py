"""Object storage: one interface over a local directory (`file:///path`, or a plain path) and `s3://bucket/prefix`.

Keys are `/`-separated names under the store's root. A put is all-or-nothing (a file appears under its
final name only once complete and fsynced; an S3 object only once its checksum was accepted) and never
replaces an object holding other bytes: objects are immutable, two writers of the same bytes both succeed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from sidecar.durable import fsync_dir, synced_temp


class ObjectConflict(Exception):
    """A put found the key taken by different bytes; nothing was changed. Names the object and both SHA-256s
    (hex), so that whoever reports it can say which object differs and how."""

    def __init__(self, location: str, key: str, ours: bytes, theirs: bytes) -> None:
        super().__init__(f"{location}/{key} exists with different content (SHA-256 {theirs.hex()}, not "
                         f"{ours.hex()} as put); it is left as it is")
        self.key, self.ours, self.theirs = key, ours.hex(), theirs.hex()


class Storage(Protocol):
    """Where objects live. Must pickle: Spark tasks get a copy."""

    location: str

    def put(self, key: str, data: bytes) -> bool:
        """Store `data` at `key`: True if written, False if the same bytes were there; ObjectConflict if others."""
        ...

    def compare(self, key: str, data: bytes) -> None:
        """Nothing if the object at `key` holds exactly `data`; ObjectConflict if other bytes, FileNotFoundError
        if none. What put does with a taken key, without sending `data`."""
        ...

    def replace(self, key: str, data: bytes) -> None:
        """Store `data` at `key` whatever was there (reports, not WAL), as atomically as put."""
        ...

    def read(self, key: str) -> bytes:
        """A whole object (FileNotFoundError when it is absent)."""
        ...

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """Up to length bytes at start; fewer where the object ends, b"" when it is absent."""
        ...

    def head(self, key: str) -> int | None:
        """The object's size, or None when it is absent."""
        ...

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every key under `prefix` (a key prefix, not only a directory), with its size."""
        ...

    def delete(self, key: str) -> None:
        """Remove an object; one already absent is no error."""
        ...

    def list_files(self) -> dict[str, int]:
        """Names directly at the root (not in deeper "directories"), with their sizes."""
        ...

    def child(self, prefix: str) -> Storage:
        """The same store rooted at `prefix` below this one's root."""
        ...


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") for p in parts) or key.startswith("/"):
        raise ValueError(f"invalid object key {key!r}")
    return key


class LocalStorage:
    """Objects as files under a directory (an archive, pg_wal or a safekeeper's wal/)."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.location = str(self.directory)

    def child(self, prefix: str) -> LocalStorage:
        return LocalStorage(self.directory / _check_key(prefix.strip("/")))

    def _path(self, key: str) -> Path:
        return self.directory / _check_key(key)

    def put(self, key: str, data: bytes) -> bool:
        """Temp file, fsync, read back and compare, then link() to the final name: link never replaces."""
        path = self._path(key)
        if path.exists():
            return self._same(key, path, data)
        with self._written(path, data) as tmp:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return self._same(key, path, data)
        fsync_dir(path.parent)
        return True

    def replace(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with self._written(path, data) as tmp:
            os.replace(tmp, path)
        fsync_dir(path.parent)

    @contextlib.contextmanager
    def _written(self, path: Path, data: bytes) -> Iterator[Path]:
        """A temp file beside `path` holding `data`, fsynced and checked; removed afterwards."""
        with synced_temp(path, data) as tmp:
            if sha256(tmp.read_bytes()) != sha256(data):
                raise OSError(f"{tmp}: the bytes read back differ from those written")
            yield tmp

    def _same(self, key: str, path: Path, data: bytes) -> bool:
        self.compare(key, data)
        return False

    def compare(self, key: str, data: bytes) -> None:
        ours, theirs = sha256(data), sha256(self._path(key).read_bytes())
        if theirs != ours:
            raise ObjectConflict(self.location, key, ours, theirs)

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        fsync_dir(path.parent)

    def read(self, key: str) -> bytes:
        """The whole file."""
        return self._path(key).read_bytes()

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """A byte range by pread."""
        try:
            with open(self._path(key), "rb") as f:
                return os.pread(f.fileno(), length, start)
        except FileNotFoundError:
            return b""

    def head(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "") -> dict[str, int]:
        """Keys under the directory starting with `prefix`; a missing directory lists nothing."""
        found: dict[str, int] = {}
        for root, dirs, files in os.walk(self.directory):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            rel = Path(root).relative_to(self.directory)
            for name in files:
                if name.startswith("."):
                    continue
                key = (rel / name).as_posix() if rel != Path(".") else name
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        found[key] = os.stat(os.path.join(root, name)).st_size
        return found

    def list_files(self) -> dict[str, int]:
        """File names and sizes; a missing directory is an error."""
        if not self.directory.is_dir():
            raise FileNotFoundError(f"{self.directory} is not a directory")
        return {e.name: e.stat().st_size for e in os.scandir(self.directory)
                if e.is_file() and not e.name.startswith(".")}


class S3Storage:
    """Objects under s3://bucket/prefix, with boto3 (credentials and AWS_ENDPOINT_URL from the environment,
    endpoint_url overrides the latter). Every put carries its SHA-256, which S3 checks on receipt and which
    is compared again after the upload."""

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.location = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # A boto3 client does not pickle; each task makes its own.
        return {**self.__dict__, "_client": None}

    def child(self, prefix: str) -> S3Storage:
        return S3Storage(self.bucket, self._key(_check_key(prefix.strip("/"))), self.endpoint_url)

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            # Our own checksum on puts; boto3's default extra CRC breaks many S3-compatible stores.
            config = Config(request_checksum_calculation="when_required",
                            response_checksum_validation="when_required", retries={"mode": "standard"})
            self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint_url, config=config)
        return self._client

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def put(self, key: str, data: bytes) -> bool:
        """A conditional PUT (If-None-Match: *) with its SHA-256; on a taken key, compare the bytes there."""
        digest = base64.b64encode(sha256(data)).decode()
        full = self._key(_check_key(key))
        try:
            self.client.put_object(Bucket=self.bucket, Key=full, Body=data, ChecksumAlgorithm="SHA256",
                                   ChecksumSHA256=digest, IfNoneMatch="*")
        except self.client.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code not in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                raise
            self.compare(key, data)
            return False
        self._verify(key, data, digest)
        return True

    def compare(self, key: str, data: bytes) -> None:
        """By the SHA-256 S3 checked when the object was put, when it has one: S3 verified it on receipt, so
        nothing is downloaded. An object put without it (by another tool) is read and compared."""
        try:
            got = self.client.head_object(Bucket=self.bucket, Key=self._key(_check_key(key)), ChecksumMode="ENABLED")
        except self.client.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(f"{self.location}/{key}") from None
            raise
        stored = got.get("ChecksumSHA256")
        if int(got["ContentLength"]) == len(data) and stored and "-" not in stored:  # "-": a multipart checksum
            theirs = base64.b64decode(stored)
        else:
            theirs = sha256(self.read(key))
        if theirs != sha256(data):
            raise ObjectConflict(self.location, key, sha256(data), theirs)

    def replace(self, key: str, data: bytes) -> None:
        digest = base64.b64encode(sha256(data)).decode()
        self.client.put_object(Bucket=self.bucket, Key=self._key(_check_key(key)), Body=data,
                               ChecksumAlgorithm="SHA256", ChecksumSHA256=digest)
        self._verify(key, data, digest)

    def _verify(self, key: str, data: bytes, digest: str) -> None:
        """After an upload: the stored object's SHA-256 and size are those sent."""
        got = self.client.head_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")
        if got.get("ChecksumSHA256") != digest or got["ContentLength"] != len(data):
            raise OSError(f"{self.location}/{key}: the stored object's checksum or size differs from the upload")

    def head(self, key: str) -> int | None:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except self.client.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def list(self, prefix: str = "") -> dict[str, int]:
        base = f"{self.prefix}/" if self.prefix else ""
        found: dict[str, int] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix):
            for obj in page.get("Contents", []):
                found[obj["Key"][len(base):]] = int(obj["Size"])
        return found

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(_check_key(key)))

    def list_files(self) -> dict[str, int]:
        """Objects directly under the prefix (not in deeper "directories")."""
        return {k: n for k, n in self.list().items() if k and "/" not in k}

    def read(self, key: str) -> bytes:
        """GET the whole object."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey as exc:
            raise FileNotFoundError(f"{self.location}/{key}") from exc

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """A ranged GET; b"" for a missing object or a range past its end."""
        if length <= 0:
            return b""
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key),
                                          Range=f"bytes={start}-{start + length - 1}")
        except self.client.exceptions.NoSuchKey:
            return b""
        except self.client.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""
            raise
        return resp["Body"].read()


def open_storage(url: str, *, s3_endpoint: str | None = None) -> LocalStorage | S3Storage:
    """A store for `file:///path`, a plain directory path, or `s3://bucket/prefix`."""
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {url!r}")
        return S3Storage(bucket, prefix, s3_endpoint)
    if url.startswith("file://"):
        path = url[len("file://"):]
        if not path.startswith("/"):
            raise ValueError(f"{url!r}: a file URL needs an absolute path (file:///var/lib/walsidecar/archive)")
        return LocalStorage(path)
    if "://" in url:
        raise ValueError(f"unsupported storage {url!r}: use a directory, file:///path or s3://bucket/prefix")
    return LocalStorage(url)


def upload_dir(local: Path, store: Storage) -> None:
    """Copy a local directory tree into `store` (replacing what is there), keeping relative paths as keys."""
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        store.replace(path.relative_to(local).as_posix(), path.read_bytes())
