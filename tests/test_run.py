"""``loaderplug run``: a program and its children get the Hub hook with no change to
them, and otherwise run exactly as they would without loaderplug."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loaderplug.cli.run import BOOTSTRAP, hook_unavailable
from loaderplug.testing.hub import HubServer, client_env
from tests.hubserver import hub as hub

REPO = "acme/tiny"
FILES = {
    "config.json": b'{"model_type": "tiny"}',
    ".gitattributes": b"*.safetensors filter=lfs\n",
    "empty.txt": b"",
    "sub/tokenizer.json": b'{"v": 1}',
    "model.safetensors": b"w" * 300_000,
}
# In the program: whether the hook is on, once huggingface_hub is imported.
HOOKED = (
    "import huggingface_hub; from loaderplug.integrations import huggingface_hub as h; "
    "print('hooked', h.is_installed())"
)


def run(
    *command: str, env: dict[str, str] | None = None, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    """``loaderplug run COMMAND...`` as a user types it."""
    return subprocess.run(
        ["loaderplug", "run", *command],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
        **kwargs,  # type: ignore[call-overload]
    )


@pytest.fixture
def mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    volume = tmp_path / "volume"
    volume.mkdir()
    monkeypatch.setenv("LOADERPLUG_MIRROR", str(volume))
    return volume


def test_a_python_program_and_its_children_get_the_hook(mirror: Path) -> None:
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {HOOKED!r}])"
    done = run("--", sys.executable, "-c", f"{HOOKED}; {child}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["hooked True", "hooked True"], done.stdout
    assert done.stderr == ""


def test_a_process_that_never_imports_huggingface_hub_imports_nothing_of_loaderplug(
    mirror: Path,
) -> None:
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith('loaderplug')))"
    done = run(sys.executable, "-c", code)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)


def test_exit_status_streams_and_the_process_are_the_programs(mirror: Path) -> None:
    code = "import os, sys; print(os.getpid()); print(input().upper()); sys.exit(7)"
    proc = subprocess.Popen(
        ["loaderplug", "run", sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate("hello\n", timeout=60)
    assert proc.returncode == 7, err
    pid, echoed = out.split()
    assert int(pid) == proc.pid  # exec: the program is the process loaderplug started as
    assert echoed == "HELLO"


def test_a_signal_reaches_the_program(mirror: Path) -> None:
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('got TERM', flush=True), sys.exit(3)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        ["loaderplug", "run", sys.executable, "-c", code], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 3
    assert proc.stdout.read() == "got TERM\n"


def test_the_programs_own_sitecustomize_and_pythonpath_keep_working(
    mirror: Path, tmp_path: Path
) -> None:
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITE'] = 'ran'\n")
    (own / "helper_module.py").write_text("VALUE = 42\n")
    code = f"import os, helper_module; print(os.environ['OWN_SITE'], helper_module.VALUE); {HOOKED}"
    done = run(sys.executable, "-c", code, env={"PYTHONPATH": str(own)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["ran 42", "hooked True"]


def test_a_command_that_does_not_exist_gets_one_line_and_127(mirror: Path) -> None:
    done = run("no-such-command-here", "--flag")
    assert done.returncode == 127
    assert done.stderr == "loaderplug run: no-such-command-here: command not found\n"


def test_a_non_python_command_runs_as_is(mirror: Path) -> None:
    done = run("sh", "-c", "echo $0 $1; exit 4", "a", "b")
    assert (done.returncode, done.stdout) == (4, "a b\n")


@pytest.mark.parametrize(
    ("env", "why"),
    [
        ({"LOADERPLUG_READERS": "banana"}, "LOADERPLUG_READERS='banana' is invalid"),
        ({"LOADERPLUG_MIRROR": ""}, "set LOADERPLUG_MIRROR"),
        ({"LOADERPLUG_MIRROR": "/no/such/volume"}, "/no/such/volume is not a folder"),
    ],
)
def test_where_the_hook_cannot_be_on_one_line_says_why_and_the_program_runs_as_is(
    mirror: Path, env: dict[str, str], why: str
) -> None:
    code = "import os, sys; print(os.environ.get('PYTHONPATH', '')); sys.exit(5)"
    done = run(sys.executable, "-c", code, env=env)
    assert done.returncode == 5
    assert str(BOOTSTRAP) not in done.stdout  # no trace of loaderplug in the program
    (line,) = done.stderr.splitlines()
    assert line.startswith("loaderplug run: the Hub hook is off (") and why in line, line
    assert line.endswith(f"running {sys.executable} without it")


def test_without_huggingface_hub_the_hook_is_off_and_says_so(
    mirror: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "huggingface_hub" else real(n, *a)
    )
    assert "huggingface_hub is not installed" in (hook_unavailable() or "")


@pytest.mark.slow("hf CLI processes, worker after worker")
@pytest.mark.parametrize("into", ["cache", "local-dir"])
def test_hf_download_worker_two_is_served_from_the_mirror(
    hub: HubServer, mirror: Path, tmp_path: Path, into: str
) -> None:
    """The huggingface_hub CLI, unchanged: the first worker downloads and fills the
    mirror, the second (a fresh cache) makes no file request; every file, empty ones,
    dotfiles and subfolders included, as the Hub has it."""
    hub.add_repo(REPO, FILES)
    # The Hub as each worker finds it: up for the first, then up, offline, hung, gone.
    for worker, state in enumerate(("first", "up", "offline", "hang", "stopped")):
        hub_state = hub.become("up" if state == "first" else state)
        env = {**client_env(hub.endpoint, tmp_path / f"home{worker}"),
               "LOADERPLUG_HUB_TIMEOUT_S": "2", **hub_state}  # fmt: skip
        out = tmp_path / f"out{worker}"
        where = ["--local-dir", str(out)] if into == "local-dir" else []
        hub.reset_counts()
        done = run("hf", "download", REPO, *where, env=env)
        assert done.returncode == 0, done.stderr
        said = done.stdout.strip().splitlines()[-1]  # "  path: <the snapshot>"
        folder = out if into == "local-dir" else Path(said.split("path:")[-1].strip())
        got = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*")
               if p.is_file() and ".cache" not in p.parts}  # fmt: skip
        assert got == FILES
        assert (hub.file_requests() > 0) == (state == "first"), (state, hub.requests, done.stderr)
        if state == "up":
            assert "loaderplug" not in done.stderr, done.stderr
