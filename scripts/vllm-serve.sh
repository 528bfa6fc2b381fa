#!/usr/bin/env bash
# Serves SmolLM2-135M-Instruct with vLLM's CPU build on 127.0.0.1:PORT (default 8000), from
# what scripts/engine-setup.sh built (it runs first, and does nothing when all is in place).
# OpenAI-compatible: /v1/responses and /v1/chat/completions, tool calls parsed as Hermes'.
# Extra arguments go to vLLM.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
port="${1:-8000}"
shift || true
cache="$("$here/engine-setup.sh" | tail -n 1)"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# A KV cache of 2 GiB, and threads left to the OS: the machine is shared.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
exec "$cache/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$cache/smollm2-135m-instruct" --served-model-name smollm2-135m-instruct \
    --host 127.0.0.1 --port "$port" --dtype bfloat16 --max-model-len 4096 \
    --chat-template "$here/smollm2-tools.jinja" \
    --enable-auto-tool-choice --tool-call-parser hermes "$@"
