"""A file shrunk or rewritten under a load's tensors cannot turn them into a crash.

A tensor over a mapping of a file dies with the process (SIGBUS) when it is touched
after someone truncated the file. loaderplug maps only its own published local copies,
which nothing rewrites in place (docs/guarantees.md); any other file, wherever it is and
however warm, is read into memory of the load's own. Each trial runs in a child process:
a SIGBUS there is a return code of -7, not the end of the test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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


def trial(folder: Path, how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", TRIAL, str(folder), how],
        capture_output=True,
        text=True,
        timeout=120,
        env={"LOADERPLUG_PROGRESS": "0", "PATH": "/usr/bin:/bin", **_python_path()},
    )


def _python_path() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[1])
    return {"PYTHONPATH": root}


def model_in(folder: Path) -> Path:
    from loaderplug.testing.model import write_model

    write_model(folder, 4 << 20, shards=2)
    return folder


@pytest.fixture(params=["disk", "memory"])
def user_folder(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A user's own folder of safetensors: on the local disk, or on a tmpfs."""
    if request.param == "disk":
        return model_in(tmp_path / "model")
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm here")
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="loaderplug-truncation-", dir=shm))
    request.addfinalizer(lambda: __import__("shutil").rmtree(folder, ignore_errors=True))
    return model_in(folder)


# Each trial is a process that imports torch: the edit loop runs one.
SLOW_TRIAL = pytest.mark.slow("a process that imports torch per trial")


@pytest.mark.parametrize(
    "how",
    ["half", pytest.param("empty", marks=SLOW_TRIAL), pytest.param("rewritten", marks=SLOW_TRIAL)],
)
def test_tensors_of_a_users_file_survive_it_shrinking(user_folder: Path, how: str) -> None:
    done = trial(user_folder, how)
    assert done.returncode == 0, (
        f"the load's process died ({done.returncode}; -7 is SIGBUS): {done.stderr[-2000:]}"
    )
    assert "survived" in done.stdout
    assert "mapped" not in done.stdout, "a user's file was handed over as a mapping"
