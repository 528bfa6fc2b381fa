#!/usr/bin/env bash
# The C frame scanner (trace_reducer/bundle/_scan.c) built with AddressSanitizer and
# UndefinedBehaviorSanitizer, fed FUZZ_SCAN_SECONDS (default 120) of mutated bundles by
# scripts/fuzz_scan.py. Any out-of-bounds read or undefined behaviour aborts with its report.
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
