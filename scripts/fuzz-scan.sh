#!/usr/bin/env bash
# The C frame scanner (trace_reducer/bundle/_scan.c), the agent's split of a provider read
# (agent_server/_sse_split.c) and the payloads' JSON encoding (trace_reducer/bundle/_canonical.c)
# built with AddressSanitizer and UndefinedBehaviorSanitizer, fed FUZZ_SCAN_SECONDS (default
# 120) each of mutated bundles (scripts/fuzz_scan.py), mutated reads (scripts/fuzz_sse_split.py)
# and mutated payloads (scripts/fuzz_canonical.py). Any out-of-bounds read or undefined
# behaviour aborts with its report.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d "${TMPDIR:-/tmp}/rollout-fuzz-scan.XXXXXX")
trap 'rm -rf "$work"' EXIT
include=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
gcc -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
    -fno-sanitize-recover=undefined -I"$include" trace_reducer/bundle/_scan.c -o "$work/_scan.so"
LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
    "$python" scripts/fuzz_scan.py "$work/_scan.so" "${FUZZ_SCAN_SECONDS:-120}" "${FUZZ_SEED:-0}"
gcc -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
    -fno-sanitize-recover=undefined -I"$include" agent_server/_sse_split.c -o "$work/_sse_split.so"
LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
    "$python" scripts/fuzz_sse_split.py "$work/_sse_split.so" "${FUZZ_SCAN_SECONDS:-120}" \
    "${FUZZ_SEED:-0}"
gcc -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
    -fno-sanitize-recover=undefined -I"$include" trace_reducer/bundle/_canonical.c \
    -o "$work/_canonical.so"
LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
    "$python" scripts/fuzz_canonical.py "$work/_canonical.so" "${FUZZ_SCAN_SECONDS:-120}" \
    "${FUZZ_SEED:-0}"
