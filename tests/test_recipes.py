"""The recipes of ``integrations/``, run as their READMEs say, as far as this machine can:
each Hub client by repo id under ``loaderplug run`` (the first worker fills the mirror,
the second makes no file request), the worker image's handler, the Kubernetes init
container's command, fastsafetensors' script, vLLM's launcher's checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loaderplug.testing.hub import HubServer, client_env

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPES = REPO_ROOT / "integrations"


def sh(*command: str, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT) -> str:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=cwd,
        env={**os.environ, "LOADERPLUG_PROGRESS": "0", **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_every_recipe_has_a_readme_and_is_in_the_index() -> None:
    folders = sorted(p.name for p in RECIPES.iterdir() if p.is_dir())
    assert folders == [
        "diffusers", "fastsafetensors", "huggingface", "kubernetes", "vllm", "worker-image"
    ]  # fmt: skip
    index = (RECIPES / "README.md").read_text()
    for folder in folders:
        assert (RECIPES / folder / "README.md").is_file(), folder
        assert f"[{folder}]({folder}/)" in index, folder


# The Hub as each worker after the first finds it: answering, offline (HF_HUB_OFFLINE),
# accepting connections and never answering, gone (connections refused).
LATER = ("up", "offline", "hang", "stopped")


def workers(
    tmp_path: Path, files: dict[str, bytes], command: list[str], later: tuple[str, ...] = LATER
) -> list[str]:
    """``command`` (a client loading ``acme/model`` by repo id) under ``loaderplug run``,
    as a first worker (the Hub up, an empty mirror), then a fresh worker (an empty cache)
    for each state of the Hub in ``later``: each one's output. None after the first may
    make a file request."""
    volume = tmp_path / "volume"
    volume.mkdir()
    outputs = []
    with HubServer() as hub:
        hub.add_repo("acme/model", files)
        for worker, state in enumerate(("first", *later)):
            hub.reset_counts()
            env = {**client_env(hub.endpoint, tmp_path / f"home{worker}"),
                   "LOADERPLUG_MIRROR": str(volume), "LOADERPLUG_HUB_TIMEOUT_S": "2",
                   **hub.become("up" if state == "first" else state)}  # fmt: skip
            outputs.append(sh("loaderplug", "run", "--", *command, env=env))
            assert (hub.file_requests() > 0) == (state == "first"), (state, hub.requests)
    return outputs


@pytest.mark.slow("a transformers process per state of the Hub")
def test_the_huggingface_worker_loads_from_the_mirror(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from loaderplug.testing.tiny_llama import write_tiny_llama

    write_tiny_llama(tmp_path / "llama", shards=2)
    files = {p.name: p.read_bytes() for p in (tmp_path / "llama").iterdir()}
    worker = str(RECIPES / "huggingface" / "worker.py")
    # transformers with the Hub hung, failing or gone: tests/test_hub_outage.py.
    outputs = workers(tmp_path, files, [sys.executable, worker, "acme/model"], ("up",))
    assert {out.split(":")[0] for out in outputs} == {"loaded acme/model"}


@pytest.mark.slow("a diffusers process per state of the Hub")
def test_a_diffusers_pipeline_with_components_in_subfolders_loads_from_the_mirror(
    tmp_path: Path,
) -> None:
    pytest.importorskip("diffusers")
    from loaderplug.testing.tiny_pipelines import write_tiny_ddpm

    files = write_tiny_ddpm(tmp_path / "ddpm")
    assert {"unet/config.json", "scheduler/scheduler_config.json"} <= set(files)
    script = str(RECIPES / "diffusers" / "pipeline.py")
    outputs = workers(tmp_path, files, [sys.executable, script, "acme/model"], ("up", "hang"))
    for out in outputs:
        assert "loaded acme/model (scheduler, unet)" in out
        assert "one step gave an image of shape (1, 3, 8, 8)" in out


@pytest.mark.slow("a sentence-transformers process per state of the Hub")
def test_sentence_transformers_loads_from_the_mirror(tmp_path: Path) -> None:
    pytest.importorskip("sentence_transformers")
    from loaderplug.testing.tiny_pipelines import write_tiny_sentence_transformer

    files = write_tiny_sentence_transformer(tmp_path / "st")
    assert "1_Pooling/config.json" in files
    code = (
        "from sentence_transformers import SentenceTransformer\n"
        "vectors = SentenceTransformer('acme/model').encode(['hello world'])\n"
        "print(vectors.shape, round(float(vectors.sum()), 4))\n"
    )
    outputs = workers(tmp_path, files, [sys.executable, "-c", code], ("up", "offline"))
    assert len(set(outputs)) == 1 and outputs[0].startswith("(1, 64)")  # the same model


@pytest.mark.slow("the worker image's handler in a process, with a test Hub")
def test_the_worker_images_handler_hydrates_at_start_and_serves(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from loaderplug.testing.tiny_llama import write_tiny_llama

    write_tiny_llama(tmp_path / "volume" / "models" / "tiny", shards=2)
    handler = RECIPES / "worker-image" / "handler.py"
    env = {"MODEL_NAME": "tiny", "LOADERPLUG_MIRROR": str(tmp_path / "volume"),
           "LOADERPLUG_LOCAL_COPIES": str(tmp_path / "local"), "HF_HUB_OFFLINE": "1"}  # fmt: skip
    event = json.dumps({"input": {"prompt": "hello world", "max_new_tokens": 3}})
    out = sh(sys.executable, str(handler), "--test-input", event, env=env)
    assert "restored" in out and "worker ready" in out
    answer = json.loads(out.strip().splitlines()[-1])
    assert answer["tokens"] > 3 and isinstance(answer["output"], str)
    for f in (tmp_path / "volume" / "models" / "tiny").iterdir():
        assert (tmp_path / "local" / "tiny" / f.name).read_bytes() == f.read_bytes()


def test_the_worker_images_dockerfile_runs_the_handler() -> None:
    lines = (RECIPES / "worker-image" / "Dockerfile").read_text().splitlines()
    instructions = [line.split()[0] for line in lines if line and not line.startswith("#")]
    assert instructions[0] == "FROM" and "CMD" in instructions
    copied = next(line.split()[1:] for line in lines if line.startswith("COPY"))
    assert (RECIPES / "worker-image" / copied[0]).is_file()
    cmd = json.loads(next(line for line in lines if line.startswith("CMD"))[len("CMD") :])
    assert cmd[-1] == copied[1]
    assert any("loaderplug" in line for line in lines if line.startswith("RUN"))


def manifest() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return list(yaml.safe_load_all((RECIPES / "kubernetes" / "pod.yaml").read_text()))


def test_the_kubernetes_init_container_hydrates_the_pods_local_disk(tmp_path: Path) -> None:
    """The manifest names what it needs (the claim, the mounts the command's paths are
    on), and its init container's command, run here with its variables pointed at a
    test volume, hydrates the model."""
    claim, deployment = manifest()
    assert claim["kind"] == "PersistentVolumeClaim"
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (init,) = spec["initContainers"]
    env = {e["name"]: e["value"] for e in init["env"]}
    mounts = {m["mountPath"] for m in init["volumeMounts"]}
    for variable in ("MODEL_ON_VOLUME", "LOCAL_MODEL"):
        assert any(env[variable].startswith(m + "/") for m in mounts), variable
    served = spec["containers"][0]
    assert {e["name"]: e["value"] for e in served["env"]}["LOCAL_MODEL"] == env["LOCAL_MODEL"]

    from loaderplug.testing.model import write_model

    write_model(tmp_path / "volume", 1 << 20, shards=2)
    here = {**env, "MODEL_ON_VOLUME": str(tmp_path / "volume"),
            "LOCAL_MODEL": str(tmp_path / "local")}  # fmt: skip
    # As the kubelet expands $(VAR) from the container's environment.
    command = list(init["command"])
    for variable in ("MODEL_ON_VOLUME", "LOCAL_MODEL"):
        command = [part.replace(f"$({variable})", here[variable]) for part in command]
    assert command[:2] == ["loaderplug", "hydrate"]
    out = sh(*command, env=here)
    assert "0 failed" in out
    for f in (tmp_path / "volume").iterdir():
        assert (tmp_path / "local" / f.name).read_bytes() == f.read_bytes()


@pytest.mark.slow("a fastsafetensors process")
def test_the_fastsafetensors_recipe_loads_files_on_the_mirror(tmp_path: Path) -> None:
    pytest.importorskip("fastsafetensors")
    from loaderplug.testing.model import write_model

    files = write_model(tmp_path / "volume" / "models" / "m", 2 << 20, shards=2)
    env = {"LOADERPLUG_MIRROR": str(tmp_path / "volume"),
           "LOADERPLUG_LOCAL_COPIES": str(tmp_path / "local")}  # fmt: skip
    script = str(RECIPES / "fastsafetensors" / "load.py")
    out = sh(sys.executable, script, *map(str, files), env=env)
    assert out.startswith("loaded 8 tensors") and "from 2 file(s)" in out


def test_the_vllm_launcher_checks_its_arguments(tmp_path: Path) -> None:
    serve = str(RECIPES / "vllm" / "serve.sh")
    bash = shutil.which("bash") or "bash"
    with_mirror = {**os.environ, "LOADERPLUG_MIRROR": str(tmp_path)}
    done = subprocess.run(
        [bash, serve, "org/model", "sideways"], capture_output=True, text=True, env=with_mirror
    )
    assert done.returncode == 2 and "unknown way 'sideways'" in done.stderr
    without = {k: v for k, v in os.environ.items() if k != "LOADERPLUG_MIRROR"}
    done = subprocess.run([bash, serve, "org/model"], capture_output=True, text=True, env=without)
    assert done.returncode != 0 and "set LOADERPLUG_MIRROR" in done.stderr
