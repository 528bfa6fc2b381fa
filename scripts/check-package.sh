#!/usr/bin/env bash
# The package as a user gets it: builds the sdist and the wheel (the wheel from the sdist, so a
# file the sdist leaves out is caught too), installs the wheel into a clean venv (pinned by
# constraints.txt, nothing from the source tree on the path) and runs its two commands there:
# `agent-server demo` records and reduces a thread, `trace-reducer` reads the bundle it wrote.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d "${TMPDIR:-/tmp}/rollout-package.XXXXXX")
trap 'rm -rf "$work"' EXIT

"$python" -m build --quiet --outdir "$work/dist" . >"$work/build.log" 2>&1 || {
    cat "$work/build.log" >&2
    exit 1
}
wheel=$(ls "$work"/dist/rollout_trace-*.whl)
ls "$work"/dist/rollout_trace-*.tar.gz >/dev/null

python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt "$wheel"
cd "$work"
"$work/venv/bin/agent-server" --version
"$work/venv/bin/trace-reducer" --version
"$work/venv/bin/agent-server" demo --trace-root "$work/traces" --local-word-delay 0 >demo.log
bundle=$(ls -d "$work"/traces/*/)
"$work/venv/bin/trace-reducer" reduce "$bundle" >/dev/null
"$work/venv/bin/trace-reducer" view "$bundle" >/dev/null
# The C parts were built into the wheel (they are optional only where no compiler is).
for extension in trace_reducer.bundle._scan trace_reducer.bundle._canonical trace_reducer.reduce._describe \
    agent_server._sse_split; do
    "$work/venv/bin/python" -c "import $extension" ||
        { echo "check-package: the wheel has no $extension" >&2; exit 1; }
done
# Typed packages, for the projects that check their use of this one.
for package in agent_server trace_reducer grpc_common rollout_client rollout; do
    "$work/venv/bin/python" -c "
import importlib.resources, sys
sys.exit(0 if importlib.resources.files('$package').joinpath('py.typed').is_file() else 1)
" || { echo "check-package: $package has no py.typed in the wheel" >&2; exit 1; }
done
echo "check-package: $(basename "$wheel") installs and runs"
