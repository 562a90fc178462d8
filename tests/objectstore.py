"""A real S3 HTTP endpoint in-process (moto's ThreadedMotoServer) for object-store tests.

Credentials, region and endpoint go through the standard AWS configuration (``AWS_*`` variables,
``AWS_ENDPOINT_URL_S3``), which s3fs/botocore read like any deployment would; processes started
by a test (ranks) inherit them.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

BUCKET = "trainyard-test"


def forget_filesystems() -> None:
    """Drop cached fsspec/s3fs instances (they hold the endpoint they were made with)."""
    from trainyard_contract import storage

    storage._FILESYSTEMS.clear()
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
    except ImportError:  # pragma: no cover
        pass


@contextmanager
def moto_s3() -> Iterator[str]:
    """Start an S3 endpoint on a free local port, point the AWS configuration at it, create
    :data:`BUCKET`; yields a fresh ``s3://`` prefix in it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    forget_filesystems()
    try:
        from trainyard_contract.storage import object_filesystem

        object_filesystem(f"s3://{BUCKET}").makedirs(BUCKET, exist_ok=True)  # moto's state is per process
        yield f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    finally:
        forget_filesystems()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
