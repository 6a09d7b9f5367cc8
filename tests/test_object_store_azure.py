"""An Azure container as the mirror (az://), against Azure's own emulator (Azurite,
started here): sync, hydrate, loads, and a blob replaced after it was listed."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import loaderplug
from loaderplug.errors import TransferFailed
from loaderplug.testing.model import write_model
from loaderplug.testing.object_server import Azurite, azurite_binary
from tests.conftest import tree_bytes
from tests.s3server import OBJECT_FAST

CONTAINER = "models"

# Without npm there is no Azurite: skipped, said as a missing package is (scripts/test.sh
# installs it wherever npm is; a run that needs every package then fails).
pytestmark = pytest.mark.skipif(
    azurite_binary() is None, reason="could not import 'azurite-blob' (npm install -g azurite)"
)


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    pytest.importorskip("azure.storage.blob")
    server = Azurite(tmp_path_factory.mktemp("azurite")).start()
    try:
        server.make_container(CONTAINER)
        yield server
    finally:
        server.stop()


@pytest.fixture
def az(azurite: Azurite, monkeypatch: pytest.MonkeyPatch) -> Azurite:
    for name, value in azurite.env().items():
        monkeypatch.setenv(name, value)
    return azurite


def test_a_container_is_synced_to_hydrated_from_and_loaded_from(
    az: Azurite, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    folder = tmp_path / "model"
    write_model(folder, 4 << 20, 2)
    url = f"az://{CONTAINER}/org/m-{uuid.uuid4().hex[:8]}"
    assert loaderplug.sync(folder, url, **OBJECT_FAST).ok
    report = loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST)
    assert tree_bytes(tmp_path / "local") == tree_bytes(folder)
    assert len(report.restored) == 4
    shard = sorted(folder.glob("*.safetensors"))[0]
    got = loaderplug.load_file(f"{url}/{shard.name}")
    want = load_file(shard)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def test_a_blob_replaced_after_it_was_listed_fails_as_changed(
    az: Azurite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "model"
    write_model(folder, 2 << 20, 1)
    prefix = f"org/m-{uuid.uuid4().hex[:8]}"
    url = f"az://{CONTAINER}/{prefix}"
    loaderplug.sync(folder, url, **OBJECT_FAST)
    (shard,) = folder.glob("*.safetensors")
    from loaderplug.storage import object_source

    listed = object_source.ObjectFiles.list

    def list_then_replace(self: object, where: object) -> object:
        found = listed(self, where)  # type: ignore[arg-type]
        blob = az.client().get_blob_client(CONTAINER, f"{prefix}/{shard.name}")
        blob.upload_blob(os.urandom(shard.stat().st_size), overwrite=True)
        return found

    monkeypatch.setattr(object_source.ObjectFiles, "list", list_then_replace)
    with pytest.raises(TransferFailed) as failed:
        loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST)
    (result,) = failed.value.report.failed
    assert result.path == shard.name and "replaced while being read" in result.reason
    assert not (tmp_path / "local" / shard.name).exists()
