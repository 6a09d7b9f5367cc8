"""vLLM on the CPU with ``--load-format volcache``, the tiny Llama on the FUSE test volume.

vLLM runs in subprocesses (loaderplug/testing/vllm_runner.py): starting it changes the
calling process (threads, seeds, environment), and each start imports it afresh.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from loaderplug.testing.volume import TestVolume, VolumeProfile, mounted
from loaderplug.units import MiB

if TYPE_CHECKING:
    from loaderplug.testing.vllm_runner import Session

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.fuse,
    pytest.mark.vllm,
    pytest.mark.slow("starts vLLM"),
    # One vLLM start at a time per module under pytest-xdist: each wants the cores.
    pytest.mark.xdist_group("vllm"),
]
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Mirror:
    volume: TestVolume
    original: Path  # the model on local disk
    on_mount: Path  # the same model, read through the throttled FUSE mount
    root: Path  # a scratch folder for this module


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mirror]:
    from loaderplug.testing.tiny_llama import write_tiny_llama

    root = tmp_path_factory.mktemp("vllm")
    write_tiny_llama(root / "backing" / "tiny-llama", shards=3)
    profile = VolumeProfile(per_stream_bytes_per_s=16 * MiB, latency_s=0.001)
    with mounted(root / "backing", root / "mnt", profile) as vol:
        yield Mirror(vol, root / "backing" / "tiny-llama", root / "mnt" / "tiny-llama", root)


def vllm_env(mirror: Mirror, local_dir: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", str(mirror.root)),
        "PYTHONPATH": str(REPO),
        "TMPDIR": str(mirror.root),
        "LOADERPLUG_LOCAL_COPIES": str(local_dir),
        "LOADERPLUG_PROGRESS": "0",
    }


@pytest.fixture(scope="module")
def session(mirror: Mirror) -> Iterator[Session]:
    """One vLLM process for the module's cases, each with its own settings."""
    from loaderplug.testing.vllm_runner import Session

    env = vllm_env(mirror, mirror.root / "unused")
    del env["LOADERPLUG_LOCAL_COPIES"]  # each case says its own
    started = Session(env, REPO)
    yield started
    started.close()


def run_cases(
    session: Session, local_dir: Path, cases: list[dict[str, Any]], **env: str
) -> list[dict[str, Any]]:
    """``cases`` in the module's vLLM process, each with a local copy in ``local_dir``
    and ``env``."""
    settings = {"LOADERPLUG_LOCAL_COPIES": str(local_dir), "LOADERPLUG_PROGRESS": "0", **env}
    return session.run([{**case, "env": settings} for case in cases])


@pytest.fixture(scope="module")
def reference(mirror: Mirror, session: Session) -> dict[str, Any]:
    """vLLM's own loader on the model on local disk: what every load must generate."""
    (result,) = run_cases(
        session,
        mirror.root / "reference",
        [{"model": str(mirror.original), "load_format": "safetensors"}],
    )
    assert result["ok"], result
    return result


def test_volcache_generates_what_safetensors_does_and_leaves_a_local_copy(
    mirror: Mirror, session: Session, reference: dict[str, Any], tmp_path: Path
) -> None:
    local_dir = tmp_path / "local"
    mirror.volume.reset_stats()
    (volcache,) = run_cases(
        session, local_dir, [{"model": str(mirror.on_mount), "load_format": "volcache"}]
    )
    assert volcache["ok"], volcache
    assert volcache["token_ids"] == reference["token_ids"]
    assert volcache["text"] == reference["text"]
    (copy,) = local_dir.iterdir()
    shards = sorted(mirror.original.glob("*.safetensors"))
    assert sorted(p.name for p in copy.glob("*.safetensors")) == [p.name for p in shards]
    for shard in shards:
        assert (copy / shard.name).read_bytes() == shard.read_bytes()
    # Each weight byte came off the volume once (plus headers and the small files).
    weight_bytes = sum(p.stat().st_size for p in shards)
    assert mirror.volume.stats()["bytes_read"] < 2 * weight_bytes


def test_volcache_reading_through_fastsafetensors_generates_the_same(
    mirror: Mirror, session: Session, reference: dict[str, Any], tmp_path: Path
) -> None:
    pytest.importorskip("fastsafetensors")
    local_dir = tmp_path / "local"
    (through_fst,) = run_cases(
        session,
        local_dir,
        [{"model": str(mirror.on_mount), "load_format": "volcache"}],
        LOADERPLUG_WEIGHTS_READER="fastsafetensors",
    )
    assert through_fst["ok"], through_fst
    assert through_fst["token_ids"] == reference["token_ids"]
    (copy,) = local_dir.iterdir()
    assert len(list(copy.glob("*.safetensors"))) == 3


def test_the_openai_server_answers_with_volcache(mirror: Mirror, tmp_path: Path) -> None:
    from loaderplug.testing import vllm_runner

    env_before = dict(os.environ)
    os.environ.update(vllm_env(mirror, tmp_path / "local"))
    try:
        served = vllm_runner.serve_once(mirror.on_mount, "volcache", tmp_path / "server.log")
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    assert served["text"].strip(), served
    assert any("Loading weights took" in line for line in served["weights_log"]), served
    assert any((tmp_path / "local").iterdir())


def broken_copy(mirror: Mirror, tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    for item in mirror.original.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    return folder


def drop_tensor(folder: Path, name: str) -> None:
    """Remove one tensor from the shard holding it, and from the index."""
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / index["weight_map"].pop(name)
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def test_bad_input_fails_with_a_clear_message(
    mirror: Mirror, session: Session, tmp_path: Path
) -> None:
    missing = broken_copy(mirror, tmp_path, "missing")
    (missing / "model-00002-of-00003.safetensors").unlink()
    incomplete = broken_copy(mirror, tmp_path, "incomplete")
    drop_tensor(incomplete, "model.norm.weight")
    corrupt = broken_copy(mirror, tmp_path, "corrupt")
    shard = corrupt / "model-00003-of-00003.safetensors"
    shard.write_bytes((2**40).to_bytes(8, "little") + shard.read_bytes()[8:])
    results = run_cases(
        session,
        tmp_path / "local",
        [
            {"model": str(missing), "load_format": "volcache"},
            {"model": str(incomplete), "load_format": "volcache"},
            {"model": str(corrupt), "load_format": "volcache"},
            {
                "model": str(mirror.original),
                "load_format": "volcache",
                "llm": {"model_loader_extra_config": {"workerz": 4}},
            },
            {
                "model": str(mirror.original),
                "load_format": "volcache",
                "llm": {"model_loader_extra_config": {"span_bytes": "huge"}},
            },
        ],
    )
    assert not any(r["ok"] for r in results), results
    missing_error, unloaded_error, corrupt_error, key_error, value_error = (
        r["error"] for r in results
    )
    assert "missing: model-00002-of-00003.safetensors" in missing_error
    assert "not in the checkpoint: model.norm.weight" in unloaded_error
    assert "model-00003-of-00003.safetensors" in corrupt_error
    assert "header" in corrupt_error
    assert "unknown --model-loader-extra-config key(s) 'workerz'" in key_error
    assert (
        "valid keys: bytes_in_flight, device_bytes, direct_io, local_copies, mirror, readers, "
        "span_bytes"
    ) in key_error
    assert "span_bytes='huge' is invalid" in value_error


TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


@pytest.fixture(scope="module")
def reference_tp2(mirror: Mirror, session: Session) -> dict[str, Any]:
    (result,) = run_cases(
        session,
        mirror.root / "reference-tp2",
        [{"model": str(mirror.original), "load_format": "safetensors", "llm": TP2}],
        VLLM_CPU_OMP_THREADS_BIND="0|1",
    )
    assert result["ok"], result
    return result


@pytest.mark.parametrize("sharing", ["auto", "stream"])
def test_volcache_at_tensor_parallel_two_generates_what_safetensors_does(
    mirror: Mirror,
    session: Session,
    reference: dict[str, Any],
    reference_tp2: dict[str, Any],
    tmp_path: Path,
    sharing: str,
) -> None:
    local_dir = tmp_path / "local"
    shards = sorted(mirror.original.glob("*.safetensors"))
    weight_bytes = sum(p.stat().st_size for p in shards)
    other_bytes = sum(p.stat().st_size for p in mirror.original.iterdir() if p not in shards)
    mirror.volume.reset_stats()
    from_mirror, from_local = run_cases(
        session,
        local_dir,
        [
            {"model": str(mirror.on_mount), "load_format": "volcache", "llm": TP2},
            {"model": str(mirror.original), "load_format": "volcache", "llm": TP2},
        ],
        # One core per worker: without it vLLM's CPU backend refuses (no NUMA nodes).
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        LOADERPLUG_RANK_SHARING=sharing,
    )
    served = mirror.volume.stats()["bytes_read"]
    for result in (from_mirror, from_local):
        assert result["ok"], result
    assert from_mirror["token_ids"] == from_local["token_ids"] == reference_tp2["token_ids"]
    assert reference_tp2["token_ids"] == reference["token_ids"]
    # The two workers split the shards: each weight byte came off the volume once (the
    # config and tokenizer files are read by vLLM itself, by each process).
    assert served <= 1.05 * weight_bytes + 4 * other_bytes, (served, weight_bytes, other_bytes)
    (copy,) = local_dir.iterdir()
    for shard in shards:
        assert (copy / shard.name).read_bytes() == shard.read_bytes()
        # Published under a lock of its own: the workers split the shards between them
        # (alone, a worker locks the whole copy and the other then reads it locally).
        assert (copy / f".{shard.name}.loaderplug-lock").exists()


def test_a_worker_killed_during_a_tensor_parallel_load_ends_the_start_in_seconds(
    tmp_path: Path,
) -> None:
    """vLLM at TP=2 on volcache, the model on a slow mirror; worker TP1 is killed with
    SIGKILL while the shards are being read. The engine's start fails at once (vLLM's
    own worker monitor or loaderplug in the other worker, whichever is first: the test
    prints which), not after ``LOADERPLUG_DISTRIBUTED_TIMEOUT_S``."""
    import subprocess
    import sys
    import threading

    from loaderplug.testing.tiny_llama import write_tiny_llama
    from loaderplug.testing.vllm_runner import RESULT_PREFIX

    write_tiny_llama(
        tmp_path / "backing" / "llama", shards=3, hidden_size=256, num_layers=8,
        intermediate_size=1024,
    )  # fmt: skip
    local_dir = tmp_path / "local"
    profile = VolumeProfile(per_stream_bytes_per_s=4 * MiB, latency_s=0.001)
    with mounted(tmp_path / "backing", tmp_path / "mnt", profile) as vol:
        case = {"model": str(vol.mountpoint / "llama"), "load_format": "volcache", "llm": TP2}
        env = {
            **vllm_env(Mirror(vol, tmp_path, tmp_path, tmp_path), local_dir),
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        }
        runner = subprocess.Popen(
            [sys.executable, "-m", "loaderplug.testing.vllm_runner", "--cases", json.dumps([case])],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(runner.stdout or []), daemon=True)
        reader.start()
        try:
            killed_at = kill_worker_once_reading(runner.pid, local_dir, "Worker_TP1")
            runner.wait(timeout=600)
        finally:
            if runner.poll() is None:
                runner.kill()
        reader.join(10)
    log = "".join(lines)
    results = [line for line in lines if line.startswith(RESULT_PREFIX)]
    assert results, log[-5000:]
    (result,) = json.loads(results[-1][len(RESULT_PREFIX) :])
    assert not result["ok"], result
    delay = result["failed_at"] - killed_at
    noticed_by = [
        who
        for who, said in (
            ("vLLM's worker monitor", "died unexpectedly"),
            ("loaderplug", "rank 1 of the shared load died"),
        )
        if said in log
    ]
    print(f"start failed {delay:.2f} s after the kill; said by {noticed_by}: {result['error']}")
    assert noticed_by, log[-5000:]
    assert delay < 60, (delay, log[-5000:])  # a tenth of the collective timeout


def kill_worker_once_reading(runner_pid: int, local_dir: Path, title: str) -> float:
    """SIGKILL the runner's worker process whose title holds ``title`` once a partial
    copy shows up in ``local_dir`` (the load is under way); when it was killed."""
    import signal
    import time

    import psutil

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if local_dir.exists() and any(local_dir.rglob(".*.loaderplug-partial")):
            break
        time.sleep(0.02)
    else:
        raise AssertionError("the load never started")
    for proc in psutil.Process(runner_pid).children(recursive=True):
        try:
            if title in " ".join(proc.cmdline()):
                proc.send_signal(signal.SIGKILL)
                return time.time()
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker process titled {title}")


@pytest.mark.parametrize(
    ("setting", "where", "parallel", "want"),
    [
        ("auto", "cuda:1", False, "cuda:1"),  # one worker: straight to the GPU
        ("auto", "cuda:1", True, "cpu"),  # each worker keeps a slice: on the CPU
        ("auto", "cpu", False, "cpu"),
        ("cpu", "cuda:1", False, "cpu"),
        ("model", "cuda:1", True, "cuda:1"),
        ("model", "cpu", False, "cpu"),
    ],
)
def test_volcache_hands_weights_over_on_the_device_that_saves_a_copy(
    setting: str, where: str, parallel: bool, want: str
) -> None:
    """The choice itself (a GPU is not at hand here): the parameters' device at one
    worker, the CPU under parallelism unless LOADERPLUG_WEIGHTS_DEVICE says otherwise."""
    import torch

    from loaderplug.integrations.vllm import weights_device
    from loaderplug.settings import from_env

    @dataclass
    class Parameter:
        device: torch.device

    class Model:  # what the choice asks of vLLM's model: its parameters' device
        def parameters(self) -> Iterator[Parameter]:
            yield Parameter(torch.device(where))

    model = Model()
    settings = from_env({"LOADERPLUG_WEIGHTS_DEVICE": setting})
    assert weights_device(model, parallel, settings) == want
