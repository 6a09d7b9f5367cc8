"""A real S3 server for the tests (SeaweedFS, one per test module and worker), the tests'
proxy in front of it, and the tests' own hands on its bucket."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from loaderplug.testing.object_proxy import ObjectProxy
from loaderplug.testing.object_server import STRANGERS_BUCKET, SeaweedS3
from tests.conftest import FAST

BUCKET = "models"
# Spans of 1 MiB (each a ranged GET), quick retries, a short answer timeout.
OBJECT_FAST = {**FAST, "span_bytes": "1M", "split_threshold_bytes": "2M", "object_timeout_s": 5}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    s3 = SeaweedS3(tmp_path_factory.mktemp("seaweed"), volume_size_mb=256).start()
    try:
        s3.make_bucket(BUCKET)
        s3.make_bucket(STRANGERS_BUCKET)
        yield s3
    finally:
        s3.stop()


@pytest.fixture
def s3(server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> SeaweedS3:
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    return server


@pytest.fixture
def proxy(s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[ObjectProxy]:
    front = ObjectProxy(s3.endpoint.removeprefix("http://")).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", front.endpoint)
    try:
        yield front
    finally:
        front.stop()


def upload(s3: SeaweedS3, folder: Path, prefix: str) -> str:
    """``folder``'s files under ``prefix`` (by the tests' own client); the URL."""
    client = s3.client()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder)}")
    return f"s3://{BUCKET}/{prefix}"


def key_of(url: str) -> str:
    return url.removeprefix(f"s3://{BUCKET}/")


def fresh_prefix() -> str:
    return f"org/m-{uuid.uuid4().hex[:8]}"
