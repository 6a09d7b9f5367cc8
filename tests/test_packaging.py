"""The package as users install it: wheel layout, entry points, a light core."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# One worker builds the wheel, once: builds in the checkout share its build/ folder.
pytestmark = pytest.mark.xdist_group("packaging")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("loaderplug-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_installs_integrations_inside_the_package(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert "loaderplug/integrations/__init__.py" in names
    assert "loaderplug/py.typed" in names
    assert not any(n.startswith("integrations/") for n in names)
    assert not any(n.startswith("tests/") for n in names)


def test_wheel_declares_the_console_script_and_extras(wheel: zipfile.ZipFile) -> None:
    info = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    assert "loaderplug = loaderplug.cli:main" in wheel.read(info).decode()
    meta = wheel.read(next(n for n in wheel.namelist() if n.endswith("METADATA"))).decode()
    for extra in ("hf", "vllm", "fastsafetensors", "test"):
        assert f"Provides-Extra: {extra}" in meta
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    assert sorted(r.split()[1].split(">")[0] for r in core) == ["pluggy", "tqdm"]


def test_hydrate_never_imports_heavy_frameworks(tmp_path: Path) -> None:
    code = f"""
import sys
for name in ("torch", "huggingface_hub", "vllm", "fastsafetensors", "safetensors"):
    sys.modules[name] = None  # importing any of them now raises ImportError
import loaderplug
from loaderplug.testing.model import write_model
write_model({str(tmp_path / "m")!r}, 1 << 20, 2)
loaderplug.hydrate({str(tmp_path / "m")!r}, {str(tmp_path / "l")!r}, progress=False)
loaderplug.sync({str(tmp_path / "l")!r}, {str(tmp_path / "v")!r}, progress=False)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.stdout.strip() == "ok", done.stderr


def test_python_dash_m_and_console_script_agree() -> None:
    for cmd in ([sys.executable, "-m", "loaderplug", "--help"], ["loaderplug", "--help"]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0 and "hydrate" in done.stdout
