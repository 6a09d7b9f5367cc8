"""The test script's guard: where it installed every package the tests import, a test
skipped because one is missing fails the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import NEED_EVERY_PACKAGE

REPO = Path(__file__).resolve().parents[1]


def run(folder: Path, *options: str, **env: str) -> subprocess.CompletedProcess[str]:
    (folder / "test_needs_a_package.py").write_text(
        "import pytest\n\npytest.importorskip('no_such_package_anywhere')\n\n\n"
        "def test_it() -> None:\n    pass\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         *options, str(folder)],
        cwd=REPO, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env},
        check=False,
    )  # fmt: skip


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_test_skipped_for_a_missing_package_fails_the_test_scripts_run(
    tmp_path: Path, workers: list[str]
) -> None:
    guarded = run(tmp_path, *workers, **{NEED_EVERY_PACKAGE: "1"})
    assert guarded.returncode == 1, guarded.stdout
    assert "could not import 'no_such_package_anywhere'" in guarded.stdout
    assert "skipped for a package scripts/test.sh installs" in guarded.stdout


def test_elsewhere_it_is_only_skipped(tmp_path: Path) -> None:
    plain = run(tmp_path)
    assert plain.returncode == 5, plain.stdout  # pytest's "no tests ran": not a failure
    assert "1 skipped" in plain.stdout
