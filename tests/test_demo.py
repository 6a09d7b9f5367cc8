"""``loaderplug demo`` as a newcomer runs it: what ``pip install '.[demo]'`` brings, and
the demo's hydrate and one pass, with the first tensor's time against the whole load's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from loaderplug.cli.demo import _first_against_whole

REPO = Path(__file__).resolve().parent.parent
# "first tensor after 0.21 s, whole load 0.93 s: ..."
FIRST_AGAINST_WHOLE = re.compile(r"first tensor after (\d+\.\d+) s, whole load (\d+\.\d+) s")


def extra(name: str) -> set[str]:
    """The requirements of pyproject.toml's extra ``name`` (a one-line list; tomllib is
    not in every Python this project supports)."""
    text = (REPO / "pyproject.toml").read_text()
    line = re.search(rf"^{name} = \[(.*)\]$", text, re.MULTILINE)
    assert line, f"no one-line extra {name} in pyproject.toml"
    return set(re.findall(r'"([^"]+)"', line.group(1)))


def test_the_demo_extra_brings_the_cpu_torch_the_tests_install() -> None:
    (pin,) = [r for r in extra("demo") if re.match(r"torch\b", r)]
    (floor,) = [r for r in extra("torch") if re.match(r"torch\b", r)]
    version = pin.removeprefix("torch==")
    assert version != pin, f"the demo's torch is not one release: {pin}"
    assert f"torch=={version}" in (REPO / "scripts" / "test.sh").read_text()
    as_tuple = [tuple(int(x) for x in v.split(".")[:2]) for v in (version, floor[7:])]
    assert as_tuple[0] >= as_tuple[1], (pin, floor)


@pytest.mark.slow("runs the demo: a FUSE test volume, a one pass and a CLI process")
def test_the_demo_verifies_its_copies_and_times_the_first_tensor_against_the_load() -> None:
    pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, "-m", "loaderplug", "demo", "--size-mib", "16"],
        capture_output=True,
        text=True,
        cwd=REPO,
        # As in every test (see conftest): no measured IO policy decides the reads.
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LOADERPLUG_IO_PROBE": "0"},
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "restored files byte-identical to the mirror: yes" in done.stdout
    assert "nothing to do" in done.stdout
    # The one pass: tensors as they land, the second copy from the same reads.
    assert "4 files restored, 0 failed" in done.stdout
    assert "one-pass copy byte-identical to the mirror: yes" in done.stdout
    times = FIRST_AGAINST_WHOLE.search(done.stdout)
    assert times, done.stdout
    first, whole = map(float, times.groups())
    assert first <= whole


def test_a_load_without_a_tensor_says_so() -> None:
    assert _first_against_whole(None, 0.5) == "no tensor handed over; whole load 0.50 s"
    said = _first_against_whole(0.25, 1.0)
    assert FIRST_AGAINST_WHOLE.match(said) and "(the first 25% of the way into the load)" in said
