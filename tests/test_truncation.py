"""A file shrunk or rewritten under an owned load's tensors cannot turn them into a crash.

A tensor over a mapping of a file dies with the process (SIGBUS) when it is touched
after someone truncated the file. loaderplug maps only files that stay put (its own
published local copies, and a user's files on a local filesystem, as safetensors does;
docs/guarantees.md); a file that can change under the load (on a network or FUSE
volume, the mirror) is read into memory of the load's own, and so is every file with
``LOADERPLUG_OWNED=own``. Each trial runs in a child process: a SIGBUS there is a return
code of -7, not the end of the test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from loaderplug.testing.volume import VolumeProfile, mounted
from loaderplug.units import MiB

pytest.importorskip("torch")

# The child: load every tensor of the model, remember each one's bytes, shrink and
# rewrite the files as asked, then touch every tensor and compare it with what it held.
TRIAL = textwrap.dedent(
    """
    import hashlib, os, sys
    from pathlib import Path
    import torch
    from loaderplug import iter_tensors
    from loaderplug.testing.model import write_model

    folder, how = Path(sys.argv[1]), sys.argv[2]
    files = sorted(folder.glob("*.safetensors"))
    for f in files:  # warm: the page cache holds them, as after a download
        f.read_bytes()

    def digest(tensor):
        return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy()).hexdigest()

    load = iter_tensors(files, progress=False)
    tensors = dict(load)
    before = {name: digest(t) for name, t in tensors.items()}
    for f in files:
        size = f.stat().st_size
        os.truncate(f, 0 if how == "empty" else size // 2)
    if how == "rewritten":
        write_model(folder, 4 << 20, shards=len(files), seed=7)
    after = {name: digest(t) for name, t in tensors.items()}
    assert after == before, "a tensor changed under the consumer"
    print("survived", sorted(load.io_modes.values())[0])
    """
)

# The child: load the model, and once the first tensor is handed over truncate every
# file to half its size; then touch every tensor handed over and compare it with what
# safetensors read before. The load either fails (saying so) or ends whole.
DURING = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import torch
    from safetensors.torch import load_file
    from loaderplug import LoaderplugError, iter_tensors

    folder = Path(sys.argv[1])
    files = sorted(folder.glob("*.safetensors"))
    expected = {}
    for f in files:
        expected |= {k: v.clone() for k, v in load_file(str(f)).items()}
    got, outcome = {}, "whole"
    try:
        for name, tensor in iter_tensors(files, progress=False):
            if not got:
                for f in files:
                    os.truncate(f, f.stat().st_size // 2)
            got[name] = tensor
    except LoaderplugError as exc:
        outcome = f"failed: {exc}"
    for name, tensor in got.items():
        same = tensor.view(torch.uint8).equal(expected[name].view(torch.uint8))
        assert same, f"{name} is not what the file held"
    assert outcome != "whole" or sorted(got) == sorted(expected), "tensors went missing"
    print(len(got), "tensors kept;", outcome)
    """
)


def child(script: str, *args: str, owned: str) -> subprocess.CompletedProcess[str]:
    root = str(Path(__file__).resolve().parents[1])
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "LOADERPLUG_PROGRESS": "0",
            "LOADERPLUG_OWNED": owned,
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": root,
        },
    )


def model_in(folder: Path, size: int = 4 * MiB) -> Path:
    from loaderplug.testing.model import write_model

    write_model(folder, size, shards=2)
    return folder


@pytest.fixture
def on_volume(tmp_path: Path) -> Iterator[Path]:
    """A user's folder of safetensors on the FUSE test volume (as on a network volume)."""
    from loaderplug.testing.volume import fuse_unavailable_reason

    reason = fuse_unavailable_reason()
    if reason is not None:
        pytest.skip(f"FUSE: {reason}")
    backing = model_in(tmp_path / "backing")
    with mounted(backing, tmp_path / "mnt", VolumeProfile.unthrottled()) as vol:
        yield vol.mountpoint


@pytest.fixture(params=["disk, owned", "memory, owned", "volume, auto"])
def user_folder(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str]:
    """A user's own folder of safetensors and the LOADERPLUG_OWNED its load runs with:
    on the local disk or a tmpfs with ``own``, on the FUSE test volume with ``auto``."""
    where, owned = request.param.split(", ")
    owned = "own" if owned == "owned" else owned
    if where == "disk":
        return model_in(tmp_path / "model"), owned
    if where == "volume":
        return request.getfixturevalue("on_volume"), owned
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm here")
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="loaderplug-truncation-", dir=shm))
    request.addfinalizer(lambda: __import__("shutil").rmtree(folder, ignore_errors=True))
    return model_in(folder), owned


# Each trial is a process that imports torch: the edit loop runs one.
SLOW_TRIAL = pytest.mark.slow("a process that imports torch per trial")


@pytest.mark.parametrize(
    "how",
    ["half", pytest.param("empty", marks=SLOW_TRIAL), pytest.param("rewritten", marks=SLOW_TRIAL)],
)
def test_tensors_of_an_owned_load_survive_its_files_shrinking(
    user_folder: tuple[Path, str], how: str
) -> None:
    folder, owned = user_folder
    done = child(TRIAL, str(folder), how, owned=owned)
    assert done.returncode == 0, (
        f"the load's process died ({done.returncode}; -7 is SIGBUS): {done.stderr[-2000:]}"
    )
    assert "survived" in done.stdout
    assert "mapped" not in done.stdout, "a file that may change was handed over as a mapping"


@pytest.mark.slow("a process that imports torch, loading from a throttled FUSE volume")
@pytest.mark.fuse
def test_a_file_on_a_volume_truncated_during_the_load_fails_it_or_keeps_the_old_bytes(
    tmp_path: Path,
) -> None:
    backing = model_in(tmp_path / "backing", 24 * MiB)
    slow = VolumeProfile(per_stream_bytes_per_s=24 * MiB)
    with mounted(backing, tmp_path / "mnt", slow) as vol:
        done = child(DURING, str(vol.mountpoint), owned="auto")
    assert_failed_clearly_or_kept(done)


@pytest.mark.slow("a process that imports torch")
def test_a_local_file_truncated_during_an_owned_load_fails_it_or_keeps_the_old_bytes(
    tmp_path: Path,
) -> None:
    folder = model_in(tmp_path / "model", 48 * MiB)
    assert_failed_clearly_or_kept(child(DURING, str(folder), owned="own"))


def assert_failed_clearly_or_kept(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, (
        f"the load's process died ({done.returncode}; -7 is SIGBUS): {done.stderr[-2000:]}"
    )
    _kept, _, outcome = done.stdout.strip().partition("; ")
    if outcome.startswith("failed"):
        # What failed, which file, and why.
        assert ".safetensors" in outcome, outcome
        assert "changed" in outcome or "ended" in outcome, outcome
