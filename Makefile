# One entry point for set-up, codegen, checks and tests. `make test` is what CI runs.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check lint protos check-protos pytest test-backends fuzz bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,otel,viewer-tests,bench]'
	touch $@

demo: $(STAMP)
	$(BIN)/agent-server demo

protos: $(STAMP)
	PATH="$(BIN):$$PATH" $(PY) scripts/gen_protos.py

check-protos: $(STAMP)
	PATH="$(BIN):$$PATH" $(PY) scripts/gen_protos.py --check

lint: $(STAMP)
	$(BIN)/buf lint
	$(BIN)/buf format --diff --exit-code
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

check: check-protos lint

# What the tests drive beyond Python packages (Chromium from the OS packages), where missing.
test-backends:
	scripts/test-backends.sh

pytest: $(STAMP) test-backends
	$(BIN)/pytest -q

test: check pytest

# The long fuzz run: tens of thousands of mutated and crafted bundles through the reader,
# reducer and CLI, and thousands of hostile provider streams through the agent.
fuzz: $(STAMP)
	FUZZ_ITERATIONS=$${FUZZ_ITERATIONS:-20000} FUZZ_CLI_SAMPLES=$${FUZZ_CLI_SAMPLES:-200} \
	FUZZ_HOSTILE_ITERATIONS=$${FUZZ_HOSTILE_ITERATIONS:-20000} \
	FUZZ_BULK_ITERATIONS=$${FUZZ_BULK_ITERATIONS:-20000} \
	FUZZ_PROVIDER_ITERATIONS=$${FUZZ_PROVIDER_ITERATIONS:-3000} \
		$(BIN)/pytest -q --timeout 3600 tests/trace_reducer/test_fuzz.py \
		tests/trace_reducer/test_bulk.py tests/agent_server/test_provider_fuzz.py

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
