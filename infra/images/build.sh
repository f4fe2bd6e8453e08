#!/bin/sh
# Build Keel's images: the control plane (Dockerfile → $KEEL_IMAGE, default keel:local) and the node agent
# (infra/images/agent.Dockerfile → $KEEL_AGENT_IMAGE, default keel-agent:local), from a wheelhouse built here
# (dist/wheels/control without torch, dist/wheels/agent with the CPU build of torch 2.13.0), so no build step
# reaches an index.
#
#   infra/images/build.sh                 on python:3.11-slim ($KEEL_BASE_IMAGE), with docker or podman
#   infra/images/build.sh --local-base    on a Debian bookworm made here with debootstrap (infra/images/base.sh),
#                                         plus NATS and PostgreSQL images of its own (no Docker Hub needed)
#
# $KEEL_ENGINE picks the engine (default: podman when installed, else docker); $PYTHON the interpreter that
# builds the wheels (default: .venv/bin/python, which `make install` creates).
set -eu
cd "$(dirname "$0")/../.."
engine="${KEEL_ENGINE:-$(command -v podman >/dev/null 2>&1 && echo podman || echo docker)}"
python="${PYTHON:-.venv/bin/python}"
base="${KEEL_BASE_IMAGE:-python:3.11-slim}"
local_base=no
if [ "${1:-}" = "--local-base" ]; then
    local_base=yes
    base="${KEEL_BASE_IMAGE:-localhost/keel-base:bookworm}"
    KEEL_BASE_IMAGE="$base" infra/images/base.sh
fi

control="./libs/events ./libs/kernel ./libs/rules ./libs/checkpoint ./migrations ./libs/infra ./libs/protocol \
./libs/cluster ./services/recorder ./services/controller ./services/checkpoint_broker ./services/analyzer \
./services/hot_update ./services/actuator ./services/notifier ./libs/reports ./services/api"
node="$control ./services/agent ./libs/sdk ./libs/workload ./libs/sim ./libs/cli"
rm -f dist/wheels/control/keel_* dist/wheels/agent/keel_*  # Keel's own wheels are always built afresh
wheels() {  # wheels SET PACKAGES...: Keel's wheels and every dependency's into dist/wheels/SET
    set_name="$1"; shift
    log="dist/wheels/$set_name.log"
    mkdir -p dist/wheels
    "$python" -m pip wheel -q --disable-pip-version-check --wheel-dir "dist/wheels/$set_name" "$@" >"$log" 2>&1 \
        || { grep -v "is ignored" "$log" >&2; echo "pip wheel failed (dist/wheels/$set_name.log)" >&2; exit 1; }
}
# shellcheck disable=SC2086  # the folder lists are word lists
wheels control $control
# shellcheck disable=SC2086
wheels agent $node torch==2.13.0
rm -rf libs/*/build services/*/build migrations/build  # what setuptools leaves in the source folders

"$engine" build -q --build-arg BASE_IMAGE="$base" -t "${KEEL_IMAGE:-keel:local}" -f Dockerfile . >/dev/null
"$engine" build -q --build-arg BASE_IMAGE="$base" -t "${KEEL_AGENT_IMAGE:-keel-agent:local}" -f infra/images/agent.Dockerfile . >/dev/null
if [ $local_base = yes ]; then
    "$engine" build -q --build-arg BASE_IMAGE="$base" -t "${KEEL_NATS_IMAGE:-keel-nats:local}" -f infra/images/nats.Dockerfile . >/dev/null
    "$engine" build -q --build-arg BASE_IMAGE="$base" -t "${KEEL_POSTGRES_IMAGE:-keel-postgres:local}" -f infra/images/postgres.Dockerfile . >/dev/null
fi
echo "built ${KEEL_IMAGE:-keel:local} and ${KEEL_AGENT_IMAGE:-keel-agent:local} on $base with $engine" >&2
