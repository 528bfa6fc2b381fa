#!/usr/bin/env bash
# `make test`: the checks and the TypeScript client's test (`make check ts-e2e`, on the client
# `make test` compiled before it ran this) run beside pytest, at a lower priority, their output
# held in a file and printed once pytest ends, so that pytest's progress stays readable. pytest
# keeps about one of two cores busy on average (its own process, and each test's servers while
# they answer); the checks, mostly mypy and the package's build and install, each use one and
# fill the other. Exits non-zero when either part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp "${TMPDIR:-/tmp}/rollout-checks.XXXXXX")

# In a session of their own, so that when pytest is stopped (Ctrl-C) the checks, mypy and pip
# included, stop with it instead of running on unseen.
setsid --wait nice -n 10 make --no-print-directory check ts-e2e >"$log" 2>&1 &
checks=$!
trap 'kill -- -"$checks" 2>/dev/null; rm -f "$log"' EXIT
make --no-print-directory pytest
pytest_status=$?
wait "$checks"
checks_status=$?

echo "--- make check ts-e2e (run beside pytest) ---"
cat "$log"
if [ "$checks_status" -ne 0 ]; then
    echo "make test: the checks failed (exit $checks_status)" >&2
fi
if [ "$pytest_status" -ne 0 ]; then
    echo "make test: pytest failed (exit $pytest_status)" >&2
fi
[ "$pytest_status" -eq 0 ] && [ "$checks_status" -eq 0 ]
