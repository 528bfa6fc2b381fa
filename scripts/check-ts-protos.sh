#!/usr/bin/env bash
# Fail when the committed TypeScript code in clients/typescript/src/gen differs from a fresh
# `buf generate` (needs clients/typescript/node_modules: `make ts-protos` installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
fresh="$(mktemp -d)"
trap 'rm -rf "$fresh"' EXIT
"${BUF:-.venv/bin/buf}" generate --output "$fresh"
if ! diff -r "$fresh/clients/typescript/src/gen" clients/typescript/src/gen >&2; then
    echo "clients/typescript/src/gen is stale; run \`make ts-protos\`" >&2
    exit 1
fi
echo "generated TypeScript is up to date"
