"""How to run vLLM (CPU build) on the tiny Llama quickly, in this process or as a server.

Not a test: a script that writes the tiny model to a temporary folder, builds ``LLM``
twice in one process (two load formats would be compared the same way), generates
greedily with each, and prints the timings. ``--server`` also starts the OpenAI server
as a subprocess and asks it for one completion.

    python -m loaderplug.testing.vllm_runner [--server] [--load-format safetensors]
    python -m loaderplug.testing.vllm_runner --cases '[{"model": DIR, "load_format": F}]'

With ``--cases`` it builds ``LLM`` for each case in turn and prints the generations (or
the error) as JSON on a line starting with ``RESULT``; with ``--session`` it reads the
cases from stdin, a line each, and answers each as it is done (:class:`Session`, which
tests/test_vllm.py drives: vLLM imported once for a module of tests).

The recipe, in short:

* Before vLLM is imported: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine and worker in
  this process), ``HF_HUB_OFFLINE=1``, and ``VLLM_CONFIGURE_LOGGING=0`` where the
  caller wants vLLM's records through the root logger (pytest's ``caplog``).
  Otherwise vLLM gives its ``vllm`` logger a stdout handler of its own,
  ``propagate=False``, and its ``dictConfig`` strips handlers that were put on
  ``vllm.*`` loggers before ``LLM()`` ran.
* ``LLM(**LLM_KWARGS)``: ``enforce_eager=True`` (without it the CPU backend compiles
  with Inductor, 50 s), a KV cache of 16 MiB in bytes (the default takes
  ``gpu_memory_utilization`` = 0.92 of the RAM, less what the process uses, and fails
  when less is free; ``VLLM_CPU_KVCACHE_SPACE``, whole GiB, overrides the argument
  when set), and one sequence.
* ``gc.freeze()`` just before ``LLM()``. vLLM calls ``gc.collect()`` several times
  while it starts, and each call walks every object of torch, transformers and vLLM;
  freezing them first takes 1.5-2.5 s off each ``LLM()``. vLLM freezes the heap itself
  at the end of start-up, and the shutdown below undoes both.
* Closing: ``llm.llm_engine.engine_core.shutdown()``, then ``del llm`` and
  ``gc.collect()``. The shutdown unfreezes the heap and destroys the
  torch.distributed group, so the next ``LLM()`` starts clean.
* ``LLM()`` changes the process: ``torch.set_num_threads`` becomes a no-op that warns
  (for good), the global seeds (random, numpy, torch) are reset to ``seed``, and
  ``os.environ`` gains ``LD_PRELOAD`` (torch's libgomp), ``VLLM_WORKER_MULTIPROC_METHOD``
  and a few others that every later subprocess inherits. :func:`vllm_process_state`
  puts all of that back.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Must be set before vLLM is imported (its envs are read lazily, but some at import).
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CONFIGURE_LOGGING": "0",
}

LLM_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
    "max_num_seqs": 1,
    "max_num_batched_tokens": 256,
    "kv_cache_memory_bytes": 16 << 20,
    "seed": 0,
}

PROMPT = "hello world"
RESULT_PREFIX = "RESULT "  # the line of --cases output that holds the results
MAX_TOKENS = 8

# The same settings for `python -m vllm.entrypoints.openai.api_server` (the `vllm`
# console script fails in this environment).
SERVER_ARGS = [
    "--dtype", "float32",
    "--enforce-eager",
    "--max-model-len", "256",
    "--max-num-seqs", "1",
    "--max-num-batched-tokens", "256",
    "--kv-cache-memory-bytes", str(16 << 20),
    "--uvicorn-log-level", "warning",
]  # fmt: skip


class WeightLog(logging.Handler):
    """Collects vLLM's "Loading weights took" lines (vLLM logs them once per load)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Loading weights took"):
            self.lines.append(f"{record.name}: {message}")


@contextmanager
def vllm_process_state() -> Iterator[None]:
    """Undo what ``LLM()`` changes in the calling process (see the module notes)."""
    import random

    import numpy
    import torch

    environ = dict(os.environ)
    set_num_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    rng = (random.getstate(), numpy.random.get_state(), torch.random.get_rng_state())
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        random.setstate(rng[0])
        numpy.random.set_state(rng[1])
        torch.random.set_rng_state(rng[2])


def generate(folder: Path, load_format: str, **extra: Any) -> dict[str, Any]:
    """Build ``LLM`` for ``folder``, generate greedily once, shut it down; timings in s."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    gc.freeze()
    llm = LLM(model=str(folder), load_format=load_format, **LLM_KWARGS, **extra)
    built = time.perf_counter()
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        (output,) = llm.generate([PROMPT], params, use_tqdm=False)
        generated = time.perf_counter()
        completion = output.outputs[0]
        return {
            "text": completion.text,
            "token_ids": list(completion.token_ids),
            "init_s": round(built - started, 2),
            "generate_s": round(generated - built, 2),
        }
    finally:
        closing = time.perf_counter()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        print(f"  shutdown took {time.perf_counter() - closing:.2f} s")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def serve_once(folder: Path, load_format: str, log_path: Path) -> dict[str, Any]:
    """Start the OpenAI server, wait for ``/health``, ask for one completion, stop it."""
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--load-format", load_format, *SERVER_ARGS,
    ]  # fmt: skip
    # In-process worker inside the engine-core process: 2 processes instead of 3.
    env = dict(os.environ, **VLLM_ENV)
    env.pop("VLLM_CONFIGURE_LOGGING")  # let the server log to its stdout
    # A killed server leaves its torch.distributed store file, $TMPDIR/vllm_dist_<hex>.
    env["TMPDIR"] = str(log_path.parent)
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"server exited with {server.returncode}; see {log_path}")
            if time.perf_counter() - started > 300:
                raise TimeoutError(f"server not healthy after 300 s; see {log_path}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(0.25)
        ready = time.perf_counter()
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        request = urllib.request.Request(
            base + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.load(reply)
        answered = time.perf_counter()
    finally:
        server.terminate()  # SIGTERM: clean exit 0 within ~1 s
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    weights = [line for line in log_path.read_text().splitlines() if "Loading weights" in line]
    return {
        "text": answer["choices"][0]["text"],
        "ready_s": round(ready - started, 2),
        "completion_s": round(answered - ready, 2),
        "weights_log": weights,
    }


def cases_in_subprocess(
    cases: list[dict[str, Any]], env: dict[str, str], cwd: Path, prefix: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Run ``cases`` with ``--cases`` in a fresh process with environment ``env`` (started
    through ``prefix``, say ``loaderplug run --``); each case's result, with the process's
    output tail as ``log``. A failed process fails the calling test with that output."""
    done = subprocess.run(
        [
            *prefix,
            sys.executable,
            "-m",
            "loaderplug.testing.vllm_runner",
            "--cases",
            json.dumps(cases),
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    results: list[dict[str, Any]] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    for result in results:
        result["log"] = done.stdout[-3000:] + done.stderr[-6000:]
    return results


def run_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Build and query ``LLM`` for each case in turn; a failure is recorded, not raised."""
    return [run_case(case) for case in cases]


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Build and query ``LLM`` for one case (``model``, ``load_format``, ``llm`` keyword
    arguments), with ``env`` set for it alone; a failure is recorded, not raised."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    with vllm_process_state():
        os.environ.update(case.get("env", {}))
        try:
            result = generate(Path(case["model"]), case["load_format"], **case.get("llm", {}))
        except Exception as exc:
            cleanup_dist_env_and_memory()  # a failed start leaves it initialised
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "failed_at": time.time()}
    return {"ok": True, **result}


class Session:
    """A process that imports vLLM once and runs the cases it is sent, one after
    another, each in an environment of its own (a module of tests shares one: each
    import of vLLM costs seconds of CPU). ``env`` is the process's environment."""

    def __init__(self, env: dict[str, str], cwd: Path, case_timeout_s: float = 900) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "loaderplug.testing.vllm_runner", "--session"],
            cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self._timeout_s = case_timeout_s
        self._log: collections.deque[str] = collections.deque(maxlen=300)

    def run(self, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each case's result (as :func:`run_case`'s), with the output tail as ``log``."""
        return [self._run(case) for case in cases]

    def _run(self, case: dict[str, Any]) -> dict[str, Any]:
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(case) + "\n")
        process.stdin.flush()
        watchdog = threading.Timer(self._timeout_s, process.kill)  # a hung start
        watchdog.start()
        try:
            for line in process.stdout:
                if line.startswith(RESULT_PREFIX):
                    result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
                    return {**result, "log": "".join(self._log)[-9000:]}
                self._log.append(line)
        finally:
            watchdog.cancel()
        raise AssertionError(f"vLLM's process ended: {''.join(self._log)[-9000:]}")

    def close(self) -> None:
        process = self._process
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _serve_cases() -> None:
    """``--session``: a case a line on stdin, its result a line on stdout, until EOF."""
    for line in sys.stdin:
        print(RESULT_PREFIX + json.dumps(run_case(json.loads(line))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load-format", default="safetensors")
    parser.add_argument("--server", action="store_true", help="also time the HTTP server")
    parser.add_argument(
        "--cases", help="a JSON list of {model, load_format, llm, env}: run them, print the results"
    )
    parser.add_argument("--session", action="store_true", help="cases from stdin, a line each")
    args = parser.parse_args()

    for name, value in VLLM_ENV.items():  # a caller's own choice wins (HF_HUB_OFFLINE=0)
        os.environ.setdefault(name, value)
    _fewer_hub_retries()
    if args.cases or args.session:
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("vllm").setLevel(logging.INFO)
    if args.session:
        _serve_cases()
        return
    if args.cases:
        print(RESULT_PREFIX + json.dumps(run_cases(json.loads(args.cases))))
        return
    _run_twice(args.load_format, args.server)


def _run_twice(load_format: str, server: bool) -> None:
    """Start vLLM twice on the tiny Llama (and with ``server`` its HTTP server once);
    both must generate the same tokens."""
    from loaderplug.testing.tiny_llama import write_tiny_llama

    # With VLLM_CONFIGURE_LOGGING=0 vLLM's records reach the root logger (as in caplog).
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    weight_log = WeightLog()
    logging.getLogger().addHandler(console)
    logging.getLogger().addHandler(weight_log)
    logging.getLogger("vllm").setLevel(logging.INFO)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-llama"
        started = time.perf_counter()
        shards = write_tiny_llama(folder)
        took = time.perf_counter() - started
        print(f"model: {folder} ({len(shards)} shards, {took:.2f} s with torch's import)")

        started = time.perf_counter()
        import vllm

        print(f"import vllm {vllm.__version__}: {time.perf_counter() - started:.2f} s")
        results = []
        with vllm_process_state():
            for run in range(2):
                result = generate(folder, load_format)
                results.append(result)
                print(f"run {run}: {json.dumps(result)}")
        print("weights log:", *weight_log.lines, sep="\n  ")
        if results[0]["token_ids"] != results[1]["token_ids"]:
            raise SystemExit("the two runs generated different tokens")
        print("both runs generated the same tokens")

        if server:
            served = serve_once(folder, load_format, Path(tmp) / "server.log")
            print(f"server: {json.dumps(served)}")
            if served["text"] != results[0]["text"]:
                raise SystemExit("the server generated different text")


def _fewer_hub_retries() -> None:
    """A test of a Hub that is down: huggingface_hub retries each refused request 5 times
    over some 23 s (vLLM lists a repo's files several times); TEST_HUB_MAX_RETRIES keeps
    fewer."""
    if not os.environ.get("TEST_HUB_MAX_RETRIES"):
        return
    from huggingface_hub.utils import _http

    for backoff in (_http._http_backoff_base, _http.http_backoff, _http.http_stream_backoff):
        defaults = backoff.__kwdefaults__
        if defaults is not None and "max_retries" in defaults:
            defaults["max_retries"] = int(os.environ["TEST_HUB_MAX_RETRIES"])


if __name__ == "__main__":
    main()
