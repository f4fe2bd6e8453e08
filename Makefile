# Two commands do everything on a fresh machine:
#   make demo   - a real stack (embedded NATS JetStream + PostgreSQL + services), faults injected, replay-verified
#                 (HOSTS=netns: every node and NATS server a host of its own; needs root / CAP_NET_ADMIN;
#                  DEMO_ARGS="--sharding fsdp2|zero2|zero1": also a job with sharded model state)
#   make test   - the whole test suite against real servers the tests start themselves
# Each installs what it needs into .venv first (pip; torch is the CPU wheel pinned by the SDK, agent and workload).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# Every distribution, bottom layer first (see docs/architecture.md). Installed together in one pip call
# from these folders: some keel-* names on PyPI are unrelated projects, so a keel-* requirement must
# always be satisfied by a path given here, never by the index.
DISTS := libs/events libs/kernel libs/rules libs/protocol libs/checkpoint migrations libs/infra libs/cluster \
         libs/sdk libs/workload services/recorder services/controller services/checkpoint_broker \
         services/analyzer services/hot_update services/actuator services/notifier services/agent libs/sim libs/reports \
         libs/cli services/api
PYPROJECTS := $(addsuffix /pyproject.toml,$(DISTS))
DEV_TOOLS := 'pytest>=8' 'pytest-asyncio>=0.24' 'pytest-timeout>=2.3' 'hypothesis>=6.100' 'torchdata==0.11.0' 'lightning==2.6.6' 'transformers==5.25.0' 'accelerate==1.16.0' 'grpcio-tools==1.85.1' 'schemathesis==4.32.5' \
             'import-linter>=2.1' 'ruff>=0.8' 'mypy>=1.13' 'types-PyYAML'

.PHONY: install system-deps test lint unit integration demo bench bench-quick bench-detection bench-checkpoint bench-recovery bench-analyzer bench-control-plane schema proto config-docs compose-secrets images clean

install: $(STAMP)

# Editable installs in compat mode put each distribution's folder on sys.path, so `keel` is a plain
# PEP 420 namespace over real folders: the interpreter, mypy and import-linter all resolve it the same way.
$(STAMP): $(PYPROJECTS) Makefile
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Keel needs Python >= 3.11"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools || true
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q $(DEV_TOOLS)
	$(BIN)/python -m pip install -q --config-settings editable_mode=compat $(addprefix -e ,$(DISTS))
	# The Kubernetes API's published contract, for the tests only (tests/k8s_contract.py): its JSON schemas
	# (kubernetes-validate) and the official client's generated operations, read as source (no dependencies).
	$(BIN)/python -m pip install -q 'kubernetes-validate==1.37.0'
	$(BIN)/python -m pip install -q --no-deps 'kubernetes==37.0.2'
	touch $(STAMP)

# The import layers (import-linter), the linter (ruff) and the type checker (mypy), then every test.
lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint system-deps
	$(BIN)/python -m pytest -q

# Debian's packages the tests run for real: Slurm (slurmctld, slurmd, munge) for the Slurm actuator; podman
# (with runc, netavark, aardvark-dns and the iptables netavark sets bridges up with) and debootstrap for the compose scenario's images and containers;
# prometheus, which scrapes `keel metrics --serve`; chromium-headless-shell, which renders the API's page. As root and only when missing (apt-get reaches Debian's registry); otherwise say what
# the tests will lack.
SYSTEM_PROGRAMS := slurmctld slurmd munged scontrol sbatch podman runc debootstrap iptables prometheus chromium-headless-shell
SYSTEM_PACKAGES := slurmctld slurmd slurm-client munge podman runc netavark aardvark-dns iptables debootstrap prometheus chromium-headless-shell
system-deps:
	@missing=""; for p in $(SYSTEM_PROGRAMS); do command -v $$p >/dev/null 2>&1 || [ -x /usr/sbin/$$p ] || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's $(SYSTEM_PACKAGES) (missing:$$missing)"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES) >/dev/null || \
		{ apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES) >/dev/null; }; \
	else echo "note: missing$$missing (Debian: apt-get install $(SYSTEM_PACKAGES), as root); the Slurm, compose and metrics tests will fail"; fi

unit: install
	$(BIN)/python -m pytest -q tests/unit

integration: install
	$(BIN)/python -m pytest -q tests/integration

HOSTS ?= flat
DEMO_ARGS ?=
demo: install
	$(BIN)/keel demo --hosts $(HOSTS) $(DEMO_ARGS)

bench: install
	$(BIN)/python bench/bus.py --json bench/results/bus.json

bench-quick: install
	$(BIN)/python bench/bus.py --quick
	$(BIN)/python -m bench.detection --quick
	$(BIN)/python -m bench.checkpoint --quick --variants none,torch_save,dcp_async,keel_nobackup,keel
	$(BIN)/python -m bench.recovery --quick
	$(BIN)/python -m bench.analyzer --quick
	$(BIN)/python -m bench.control_plane --quick

# The ft_launcher peer is a benchmark-only dependency; it drags in the deprecated pynvml shim, which
# would print a warning in every rank, so the shim goes again (nvidia-ml-py provides pynvml).
bench-detection: install
	$(BIN)/python -m pip install -q nvidia-resiliency-ext && $(BIN)/python -m pip uninstall -y -q pynvml || true
	$(BIN)/python -m bench.detection --json bench/results/detection.json

# DLRover (the Flash Checkpoint peer) is a benchmark-only dependency, never a runtime one; torch stays
# pinned on the same command line. Its deprecated pynvml shim goes again, as for bench-detection.
bench-checkpoint: install
	$(BIN)/python -m pip install -q 'dlrover[torch]==0.6.1' grpcio torch==2.13.0 && $(BIN)/python -m pip uninstall -y -q pynvml || true
	$(BIN)/python -m bench.checkpoint --json bench/results/checkpoint.json

# Keel's recovery against torchrun restarts and a full requeue (torchrun comes with torch: no extra
# dependency). About 20 minutes on a 2-core machine; `python -m bench.recovery --quick` in under 5.
bench-recovery: install
	$(BIN)/python -m bench.recovery --json bench/results/recovery.json

# Stack capture with py-spy, aggregation from 1k to 64k ranks, and SDC localisation (under a minute).
bench-analyzer: install
	$(BIN)/python -m bench.analyzer --json bench/results/analyzer.json

# The control plane's steady-state cost (a real local cluster) and recorder lag (a simulated 1,000-node
# job): about 15 minutes; `python -m bench.control_plane --quick` in under 5.
bench-control-plane: install
	$(BIN)/python -m bench.control_plane --json bench/results/control_plane.json

schema: install
	$(BIN)/keel events schema --write

# docs/configuration.md is generated from the settings models (keel.infra.config); a unit test fails when stale.
config-docs: install
	$(BIN)/python -m keel.infra.config_docs --write docs/configuration.md

# docker-compose.yml's PostgreSQL passwords (one per role, random, never committed); kept if they exist.
# Its NATS identities and TLS certificate need no step here: the compose `credentials` service generates them
# inside the image, as the uid that reads them (docker-compose.yml explains why not on the host).
compose-secrets:
	sh infra/postgres/make-secrets.sh .secrets/postgres

# The control-plane image (keel:local, no torch) and the node agent's (keel-agent:local), from a wheelhouse built
# here (dist/wheels/); docker or podman (KEEL_ENGINE). IMAGES_FLAGS=--local-base builds on a Debian made with
# debootstrap, plus NATS and PostgreSQL images, where Docker Hub cannot be reached (infra/images/build.sh).
images: install
	PYTHON=$(BIN)/python infra/images/build.sh $(IMAGES_FLAGS)

proto: install
	$(BIN)/python -m grpc_tools.protoc -Iproto/keel/agent/v1 --python_out=libs/protocol/keel/protocol \
		--pyi_out=libs/protocol/keel/protocol proto/keel/agent/v1/node_local.proto
	$(BIN)/python -m grpc_tools.protoc -Iproto/keel/checkpoint/v1 --python_out=libs/protocol/keel/protocol \
		--pyi_out=libs/protocol/keel/protocol --grpc_python_out=libs/protocol/keel/protocol proto/keel/checkpoint/v1/shard_store.proto
	# grpc_tools writes a top-level `import shard_store_pb2`; the module lives in keel.protocol.
	sed -i 's/^import shard_store_pb2 as/from keel.protocol import shard_store_pb2 as/' \
		libs/protocol/keel/protocol/shard_store_pb2_grpc.py

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
	find libs services migrations \( -name "*.egg-info" -o -name build \) -prune -exec rm -rf {} +
