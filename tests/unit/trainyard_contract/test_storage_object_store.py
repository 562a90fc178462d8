"""The object-store streaming helpers of ``trainyard_contract.storage`` against moto's S3 server: an upload
is hashed as it streams and appears whole or not at all (an error aborts it, multipart or not), a
create-only upload loses to an existing object, and downloads and chunked reads hash and return the
bytes stored; each helper takes a local path alike where it can."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.objectstore import moto_s3
from trainyard_contract.storage import (
    ObjectPath,
    download_file,
    is_file,
    iter_chunks,
    object_filesystem,
    read_bytes,
    upload,
    upload_file,
)


@pytest.fixture(scope="module")
def prefix() -> Iterator[ObjectPath]:
    with moto_s3() as root:
        yield ObjectPath.parse(root)


def test_an_upload_is_hashed_as_it_streams_and_a_create_only_one_loses_to_an_existing_object(
    prefix: ObjectPath,
) -> None:
    target = prefix / "a" / "x.bin"
    with upload(target) as stream:
        stream.write(b"hello ")
        stream.write(memoryview(b"world"))
    assert (stream.size, stream.hexdigest()) == (11, hashlib.sha256(b"hello world").hexdigest())
    assert read_bytes(target) == b"hello world" and is_file(target) and not is_file(prefix / "a")
    with pytest.raises(FileExistsError):
        with upload(target, exclusive=True) as stream:
            stream.write(b"another")
    assert read_bytes(target) == b"hello world"
    with upload(prefix / "a" / "new.bin", exclusive=True) as stream:
        stream.write(b"first")
    assert read_bytes(prefix / "a" / "new.bin") == b"first"


@pytest.mark.parametrize("size", [10, 51 * 2**20], ids=["one-put", "multipart"])  # s3fs sends 50 MiB parts
def test_an_upload_that_raises_leaves_no_object(prefix: ObjectPath, size: int) -> None:
    target = prefix / "aborted" / f"{size}.bin"
    with pytest.raises(RuntimeError, match="interrupted"):
        with upload(target) as stream:
            stream.write(b"x" * size)
            raise RuntimeError("interrupted")
    assert not is_file(target)
    bucket, key = target.path.split("/", 1)
    pending = object_filesystem(target).call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert [u for u in pending if u["Key"] == key] == []  # a started multipart upload was aborted


def test_files_go_up_and_down_with_their_digests_and_read_in_chunks(prefix: ObjectPath, tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000
    (tmp_path / "src.bin").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    assert upload_file(tmp_path / "src.bin", prefix / "f.bin") == (len(data), digest)
    assert download_file(prefix / "f.bin", tmp_path / "back.bin") == (len(data), digest)
    assert (tmp_path / "back.bin").read_bytes() == data
    assert [len(c) for c in iter_chunks(prefix / "f.bin", 100_000)] == [100_000, 100_000, 56_000]
    assert b"".join(iter_chunks(tmp_path / "src.bin", 7)) == data and is_file(tmp_path / "src.bin")
    with pytest.raises(FileNotFoundError):
        download_file(prefix / "missing.bin", tmp_path / "missing.bin")
