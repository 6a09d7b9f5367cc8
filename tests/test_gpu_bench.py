"""The GPU benchmark's script, tried on the CPU as far as it goes: loaderplug takes its
CUDA path on the stand-in device, the others load to the CPU, and gpu.json has every
key the GPU run reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("torch")


@pytest.mark.slow("runs the GPU benchmark's processes on the CPU")
def test_the_gpu_benchmark_runs_on_the_cpu_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_processes.py"), "--device", "cpu",
               "--fake-cuda", "--models", "16:2", "--rounds", "1", "--dir", str(tmp_path),
               "--out", str(out), "--loaders", "loaderplug,safetensors"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((out / "gpu.json").read_text())
    assert set(results) == {"device", "commit", "pinned_h2d_GBps", "disk_direct_GBps", "models"}
    model = results["models"]["16MiB"]
    assert model["bytes"] >= 16 * 2**20
    for state in ("cold", "warm"):
        assert all(isinstance(s, float) for s in model[state]["loaderplug"]), model[state]
        assert all(isinstance(s, float) for s in model[state]["safetensors"]), model[state]
    assert len(model["first_tensor_s"]["loaderplug"]) == 1
    assert model["host_copied_bytes"] == {"loaderplug": 0}  # read into pinned buffers
    assert "| 16MiB | cold | loaderplug |" in (out / "gpu.md").read_text()
