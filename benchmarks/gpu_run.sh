#!/usr/bin/env bash
# The GPU leg's whole run on a lent GPU machine, in one command:
#
#   bash benchmarks/gpu_run.sh --fetch-wheels   # here, once: the wheels the GPU machine lacks
#   bash benchmarks/gpu_run.sh OUT              # there: equality, then the timed table
#
# The GPU machine has torch (CUDA), safetensors, transformers and huggingface_hub; what
# else the run needs travels as wheels in .gpu_wheels/ (ignored by git: carry it):
# loaderplug's own dependencies (pluggy, tqdm), fastsafetensors and runai-model-streamer,
# for the Python the machine runs (GPU_PYTHON_VERSION, 3.12 by default).
#
# On the machine it installs those wheels, says what the machine is (the GPU, the
# filesystem the model is written to and how loaderplug reads it), checks every tensor
# of a 1 GiB model loaded to the GPU against safetensors', alone and by two ranks sharing
# the page cache on the one GPU (benchmarks/gpu_check.py), then
# times the loaders in fresh processes (benchmarks/gpu_processes.py), writing gpu.json
# and gpu.md under OUT after each model, so a run cut short keeps what it measured.
# GPU_RUN_MODELS (MiB:shards,...), GPU_RUN_ROUNDS and GPU_RUN_DIR (where the models are
# written) change the run; each step has a time limit, so the whole stays under ten
# minutes with room left for a second try.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu_wheels

if [ "${1:-}" = "--fetch-wheels" ]; then
  version=${GPU_PYTHON_VERSION:-3.12}
  mkdir -p "$WHEELS"
  python -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
    --platform manylinux_2_28_x86_64 -d "$WHEELS" \
    'pluggy>=1.3' 'tqdm>=4.60' 'fastsafetensors>=0.5,<0.6' 'runai-model-streamer>=0.17,<0.18'
  ls -l "$WHEELS"
  exit 0
fi

OUT=${1:?usage: bash benchmarks/gpu_run.sh OUT   (or --fetch-wheels)}
mkdir -p "$OUT"
DIR=${GPU_RUN_DIR:-/tmp}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee "$OUT/log.txt") 2>&1

echo "== install"
for wheel in "$WHEELS"/*.whl; do  # one at a time: a wheel for another Python is skipped
  [ -e "$wheel" ] || continue
  python -m pip install -q --no-index --no-deps "$wheel" 2>/dev/null || echo "skipped $wheel"
done
python - <<'PY'
import importlib.util
for name in ("torch", "safetensors", "pluggy", "tqdm", "fastsafetensors", "runai_model_streamer"):
    print(name, "yes" if importlib.util.find_spec(name) else "MISSING")
PY

echo "== the machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "no nvidia-smi"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
df -hT "$DIR"
python -c "from loaderplug.cli import main; main(['doctor', '$DIR'])" || true

echo "== equality: every tensor to the GPU against safetensors' (1 GiB)"
timeout 180 python benchmarks/gpu_check.py --size-mib 1024 --dir "$DIR" --page-cache-ranks \
  | tee "$OUT/check.md"
echo "gpu_check exit: ${PIPESTATUS[0]}"

echo "== the timed table"
timeout 420 python benchmarks/gpu_processes.py --out "$OUT" --dir "$DIR" \
  --models "${GPU_RUN_MODELS:-4096:8,16384:32}" --rounds "${GPU_RUN_ROUNDS:-3}" \
  ${GPU_RUN_DEVICE:+--device "$GPU_RUN_DEVICE"}
echo "gpu_processes exit: $?"
ls -l "$OUT"
