"""sidecar.objectstore on both backends: a directory and S3 (moto_server as a process)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.s3 import aws_env, make_bucket, moto_server
from sidecar.objectstore import LocalStorage, ObjectConflict, S3Storage, Storage, open_storage


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        aws_env(mp)
        with moto_server(tmp_path_factory.mktemp("moto")) as endpoint:
            make_bucket(endpoint, "archive")
            yield endpoint


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "file":
        return open_storage(f"file://{tmp_path}/archive")
    endpoint = request.getfixturevalue("s3")
    return open_storage(f"s3://archive/{tmp_path.name}", s3_endpoint=endpoint)


def test_put_get_head_list(store: Storage) -> None:
    assert store.head("wal/a") is None
    assert store.put("wal/a", b"one") is True
    assert store.put("wal/b", b"two!") is True
    assert store.read("wal/a") == b"one"
    assert store.read_range("wal/b", 1, 10) == b"wo!"
    assert store.read_range("wal/none", 0, 10) == b""
    assert store.head("wal/b") == 4
    assert store.list() == {"wal/a": 3, "wal/b": 4}
    assert store.list("wal/b") == {"wal/b": 4}
    assert store.child("wal").list_files() == {"a": 3, "b": 4}
    assert store.child("wal").read("a") == b"one"
    with pytest.raises(FileNotFoundError):
        store.read("wal/none")


def test_a_put_never_replaces_different_bytes(store: Storage) -> None:
    store.put("seg", b"x" * 1000)
    assert store.put("seg", b"x" * 1000) is False  # a racing uploader with the same bytes succeeds
    with pytest.raises(ObjectConflict, match="different content") as conflict:
        store.put("seg", b"y" * 1000)
    # Named, with both digests: whoever reports it says which object differs and how.
    assert (conflict.value.key, conflict.value.ours, conflict.value.theirs) == \
        ("seg", hashlib.sha256(b"y" * 1000).hexdigest(), hashlib.sha256(b"x" * 1000).hexdigest())
    with pytest.raises(ObjectConflict):
        store.put("seg", b"x" * 999)
    assert store.read("seg") == b"x" * 1000
    # The same comparison without a put (an object another safekeeper uploaded).
    assert store.compare("seg", b"x" * 1000) is None
    with pytest.raises(ObjectConflict):
        store.compare("seg", b"x" * 999 + b"y")
    with pytest.raises(FileNotFoundError):
        store.compare("none", b"x")
    store.replace("seg", b"z")  # reports, not WAL, may be replaced
    assert store.read("seg") == b"z"


def test_delete(store: Storage) -> None:
    store.put("wal/a", b"one")
    store.put("wal/a.partial", b"two")
    store.delete("wal/a.partial")
    store.delete("wal/a.partial")  # already gone: no error
    assert store.list() == {"wal/a": 3}


def test_keys_cannot_leave_the_store(store: Storage) -> None:
    for key in ("../x", "/abs", "a//b", "a/./b", ""):
        with pytest.raises(ValueError):
            store.put(key, b"1")
        with pytest.raises(ValueError):
            store.delete(key)


def test_s3_puts_carry_their_sha256(s3: str) -> None:
    store = open_storage("s3://archive/sums", s3_endpoint=s3)
    assert isinstance(store, S3Storage)
    store.put("seg", b"abc")
    head = store.client.head_object(Bucket="archive", Key="sums/seg", ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"] == "ungWv48Bz+pBQUDeXa4iI7ADYaOWF3qctBD/YfIAFa0="

    # A taken key is compared by the checksum S3 keeps; one put without it (another tool) by its bytes.
    store.client.put_object(Bucket="archive", Key="sums/other", Body=b"abd")
    assert store.put("other", b"abd") is False
    with pytest.raises(ObjectConflict) as conflict:
        store.put("other", b"abc")
    assert conflict.value.theirs == hashlib.sha256(b"abd").hexdigest()
    with pytest.raises(ObjectConflict):
        store.put("seg", b"abd")


def test_a_crashed_file_put_leaves_nothing_that_looks_complete(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    # What a put killed before its link() leaves: a dot-named temp file, which no listing shows.
    (tmp_path / "wal").mkdir()
    (tmp_path / "wal" / ".000000010000000000000001.1a2b3c4d.tmp").write_bytes(b"half")
    assert store.list() == {}
    assert store.head("wal/000000010000000000000001") is None
    store.put("wal/000000010000000000000001", b"whole")
    assert store.list() == {"wal/000000010000000000000001": 5}
    assert os.stat(tmp_path / "wal" / "000000010000000000000001").st_nlink == 1  # the temp file is gone


def test_open_storage_urls(tmp_path: Path) -> None:
    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert open_storage("s3://bucket/some/prefix").location == "s3://bucket/some/prefix"
    for bad in ("gs://bucket/x", "file://relative/path", "s3:///x"):
        with pytest.raises(ValueError):
            open_storage(bad)
