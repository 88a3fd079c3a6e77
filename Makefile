# kdamesh: two commands on a fresh machine.
#   make serve   — the whole mesh on localhost with the embedded defaults (flags: make serve ARGS="...")
#   make test    — ruff (make lint), then the test suite; the suite starts the Redis and the 3-master Redis Cluster
#                  it needs when none runs and stops them after (tests/conftest.py), so no Redis has to be running
# Both install into .venv first (torch pinned to the CPU wheel 2.13.0, installed before the project); make test also
# installs redis-server >= 7 from the system's packages when it is not on PATH (make redis-tools).

PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LLMC_VERSION ?= 0.14.0.1

.PHONY: install lint test test-fast serve bench clean protos redis-tools

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The official Kimi K3 reference code (test-only). It pins an older transformers: no deps.
	$(BIN)/python -m pip install -q --no-deps llmcompressor==$(LLMC_VERSION)
	touch $(STAMP)

# Pyflakes, syntax errors and the size limits; the rule set lives in pyproject.toml's [tool.ruff].
lint: install
	$(BIN)/ruff check .

# redis-server >= 7 and redis-cli on PATH (the cache service uses PEXPIRE ... GT); apt-get as root or through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
redis-tools:
	@if ! redis-server --version 2>/dev/null | grep -Eq 'v=([7-9]|[1-9][0-9])\.' || ! command -v redis-cli >/dev/null; then \
	  command -v apt-get >/dev/null || { echo "make test needs redis-server >= 7 and redis-cli on PATH"; exit 1; }; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server >/dev/null; \
	fi
	@redis-server --version

test: install redis-tools
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests --durations=25

test-fast: install
	$(BIN)/python -m pytest tests/unit -x

# make serve ARGS="--model DIR --port 8001 ..." — any `kdamesh up` flag (`kdamesh serve MODEL` takes the same ones)
ARGS ?=
serve: install
	$(BIN)/kdamesh up $(ARGS)

bench: install
	$(BIN)/python -m bench.run_all

protos: install
	$(BIN)/python -m protos.build

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
