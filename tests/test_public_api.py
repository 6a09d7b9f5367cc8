"""The public API: what examples need is importable from ``loaderplug``, typed for a
user's ``mypy --strict``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

import loaderplug
from loaderplug.settings import BY_FIELD

REPO = Path(__file__).resolve().parent.parent


def test_every_public_name_is_importable() -> None:
    for name in loaderplug.__all__:
        assert getattr(loaderplug, name) is not None, name


def test_choice_settings_accept_exactly_their_literal_types() -> None:
    literals = {
        "direct_io": loaderplug.DirectIO,
        "weights_reader": loaderplug.WeightsReader,
        "weights_device": loaderplug.WeightsDevice,
        "distributed": loaderplug.Distributed,
        "rank_sharing": loaderplug.RankSharing,
        "host_split": loaderplug.HostSplit,
        "owned": loaderplug.Owned,
    }
    for field, literal in literals.items():
        assert BY_FIELD[field].choices == get_args(literal), field
    assert {v.field for v in BY_FIELD.values() if v.kind == "choice"} == set(literals)


def test_find_mirror_and_register_from_the_top(tmp_path: Path) -> None:
    (tmp_path / "models" / "acme").mkdir(parents=True)
    settings = loaderplug.from_env({}, mirror=str(tmp_path))
    assert loaderplug.find_mirror("folder", "acme", settings=settings) == tmp_path / "models/acme"
    assert loaderplug.find_mirror("folder", "other", settings=settings) is None

    class Elsewhere:
        @loaderplug.hookimpl
        def loaderplug_find_mirror(self, request: loaderplug.MirrorRequest) -> Path:
            return tmp_path / "elsewhere" / request.name

    plugin = Elsewhere()
    loaderplug.register(plugin)
    try:
        assert loaderplug.find_mirror("folder", "acme", settings=settings) == (
            tmp_path / "elsewhere" / "acme"
        )
    finally:
        loaderplug.unregister(plugin)


USER = """
from pathlib import Path

import loaderplug
import torch

load = loaderplug.iter_tensors([Path("model.safetensors")], local_dir="/tmp/copy")
tensors: dict[str, torch.Tensor] = dict(load)
report: loaderplug.TransferReport | None = load.report
mode: loaderplug.DirectIO = loaderplug.from_env().direct_io
mirror: Path | None = loaderplug.find_mirror("hub", "acme/llama")
"""


def mypy_cache(tmp_path: Path) -> Path:
    """A copy of the cache of the project's own ``mypy`` run (scripts/test.sh runs it
    first), where there is one: torch's types then take seconds, not minutes, to check.
    mypy checks again every module whose source changed since; a copy, so that the
    project's cache is never written by the test."""
    cache = tmp_path / "mypy-cache"
    if (REPO / ".mypy_cache").is_dir():
        shutil.copytree(REPO / ".mypy_cache", cache)
    return cache


@pytest.mark.slow("runs mypy over a user's code")
def test_a_users_code_type_checks_strictly(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    user = tmp_path / "user.py"
    user.write_text(USER)
    cache = ["--cache-dir", str(mypy_cache(tmp_path))]
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", *cache, str(user)],
        cwd=tmp_path,
        # An editable install is a path hook mypy cannot follow: point it at the tree.
        env={**os.environ, "MYPYPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_renamed_exception_is_importable_under_its_old_name_for_a_release() -> None:
    with pytest.warns(DeprecationWarning, match="HydrateError is now FileError"):
        from loaderplug.errors import HydrateError  # type: ignore[attr-defined]
    assert HydrateError is loaderplug.FileError
    with pytest.warns(DeprecationWarning):
        assert loaderplug.HydrateError is loaderplug.FileError  # type: ignore[attr-defined]
