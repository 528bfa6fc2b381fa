# One entry point for set-up, codegen, checks and tests. `make test` is what CI runs.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TS := clients/typescript
TS_STAMP := $(TS)/node_modules/.installed
# npm's cache lives in a scratch directory, never in the user's home.
NPM_CACHE ?= $(or $(TMPDIR),/tmp)/rollout-trace-npm-cache

.PHONY: demo test check lint protos check-protos ts-protos check-ts-protos check-breaking \
	pytest ts-build ts-e2e test-ts test-backends engine vllm check-package fuzz bench clean

# The package with every extra, and the project's own tools (pyproject's dependency groups), at
# the exact versions of constraints.txt, installed by uv (its cache is uv's own, under
# $${XDG_CACHE_HOME:-~/.cache}/uv). Bytecode is compiled now: the suite starts hundreds of
# interpreters, and PYTHONDONTWRITEBYTECODE would otherwise make each compile its imports again.
$(STAMP): pyproject.toml constraints.txt setup.py trace_reducer/bundle/_scan.c \
		trace_reducer/bundle/_canonical.c trace_reducer/reduce/_describe.c agent_server/_sse_split.c
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt uv
	$(BIN)/uv pip install --quiet --python $(PY) --compile-bytecode -c constraints.txt \
		-e '.[otel,batch,ray,training]' --group dev
	touch $@

demo: $(STAMP)
	$(BIN)/agent-server demo

protos: $(STAMP)
	PATH="$(BIN):$$PATH" $(PY) scripts/gen_protos.py

check-protos: $(STAMP)
	PATH="$(BIN):$$PATH" $(PY) scripts/gen_protos.py --check

# The TypeScript client: its packages from package-lock.json, installed again only when the
# package files change.
$(TS_STAMP): $(TS)/package.json $(TS)/package-lock.json
	cd $(TS) && npm ci --cache "$(NPM_CACHE)" --no-audit --no-fund
	touch $@

# Regenerate clients/typescript/src/gen after a proto change (committed, like rollout/).
ts-protos: $(STAMP) $(TS_STAMP)
	$(BIN)/buf generate

check-ts-protos: $(STAMP) $(TS_STAMP)
	scripts/check-ts-protos.sh

# No breaking change to protos/ against main (from git, offline).
check-breaking: $(STAMP)
	scripts/check-breaking.sh

lint: $(STAMP)
	$(BIN)/buf lint
	$(BIN)/buf format --diff --exit-code
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The sdist and wheel built, the wheel installed into a clean venv and its two commands run.
check-package: $(STAMP)
	scripts/check-package.sh

check: check-protos check-ts-protos check-breaking lint check-package

# What the tests drive beyond Python packages (Chromium from the OS packages), where missing.
test-backends:
	scripts/test-backends.sh

# vLLM's CPU build in its own venv and SmolLM2-135M converted for it, once per machine, under
# $${XDG_CACHE_HOME:-~/.cache}/rollout-trace (the test session does it too, in the background,
# when it starts the engine).
engine:
	scripts/engine-setup.sh

# vLLM serving SmolLM2-135M on 127.0.0.1:8000 (VLLM_PORT to change it), in the foreground.
vllm:
	scripts/vllm-serve.sh $${VLLM_PORT:-8000}

pytest: $(STAMP) test-backends
	$(BIN)/pytest -q --durations=25

# The TypeScript client compiled (dist/). `make test` does it before pytest starts: pytest runs
# docs/clients.md's example on it, and skipped that test when the build beside it came late.
ts-build: $(TS_STAMP)
	cd $(TS) && npm run --silent build

# The compiled client's end-to-end test against `agent-server serve`.
ts-e2e: $(STAMP)
	cd $(TS) && AGENT_SERVER="$(abspath $(BIN))/agent-server" npm test --silent

# The TypeScript client compiled, then its end-to-end test.
test-ts: $(STAMP) ts-build
	$(MAKE) --no-print-directory ts-e2e

# Set-up first, then the checks and the TypeScript test beside pytest (scripts/test.sh says why).
test: $(STAMP) $(TS_STAMP) test-backends ts-build
	scripts/test.sh

# The long fuzz run: tens of thousands of mutated and crafted bundles through the reader,
# reducer and CLI, and thousands of hostile provider streams through the agent.
fuzz: $(STAMP)
	FUZZ_ITERATIONS=$${FUZZ_ITERATIONS:-20000} FUZZ_CLI_SAMPLES=$${FUZZ_CLI_SAMPLES:-200} \
	FUZZ_HOSTILE_ITERATIONS=$${FUZZ_HOSTILE_ITERATIONS:-20000} \
	FUZZ_BULK_ITERATIONS=$${FUZZ_BULK_ITERATIONS:-20000} \
	FUZZ_SIDECAR_ITERATIONS=$${FUZZ_SIDECAR_ITERATIONS:-2000} \
	FUZZ_PROVIDER_ITERATIONS=$${FUZZ_PROVIDER_ITERATIONS:-3000} \
		$(BIN)/pytest -q --timeout 3600 tests/trace_reducer/test_fuzz.py \
		tests/trace_reducer/test_bulk.py tests/agent_server/test_provider_fuzz.py
	PYTHON=$(PY) scripts/fuzz-scan.sh

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache $(TS)/node_modules $(TS)/dist
