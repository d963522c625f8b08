"""A real S3 API for tests: moto_server as a process on 127.0.0.1, stopped by its PID."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.helpers import free_port, wait_for

# Dummy credentials; no probe of the EC2 metadata address outside this machine.
AWS_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}


@contextlib.contextmanager
def moto_server(log_dir: Path) -> Iterator[str]:
    """Start moto_server on a free port; yields its endpoint URL; kills it by PID on exit."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"moto-{port}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def accepting() -> bool:
        assert proc.poll() is None, "moto_server exited"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(accepting, timeout=60, what="moto_server to listen")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def aws_env(mp: pytest.MonkeyPatch) -> None:
    """Set the dummy credentials for this process and the processes it starts."""
    for k, v in AWS_ENV.items():
        mp.setenv(k, v)
    mp.delenv("AWS_ENDPOINT_URL", raising=False)


def make_bucket(endpoint: str, name: str) -> None:
    import boto3
    boto3.client("s3", endpoint_url=endpoint, **_credentials()).create_bucket(Bucket=name)


def _credentials() -> dict[str, str]:
    return {"aws_access_key_id": AWS_ENV["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            "region_name": AWS_ENV["AWS_DEFAULT_REGION"]}
