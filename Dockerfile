# Keel control-plane image: the control-plane distributions as plain wheels in a virtual environment (no
# editable install, no source tree), without torch. One console script per role:
#   keel-migrate, keel-recorder, keel-controller, keel-checkpoint-broker, keel-actuator, keel-analyzer,
#   keel-hot-update, keel-notifier, keel-api (the HTTP API and its page), and keel-credentials (a deployment's NATS
#   identities, signing keys and NATS TLS certificate).
#
#   make images                               wheels, then this image and the node agent's (infra/images/)
#   docker run --rm keel:local keel-controller --help
#
# It installs from a wheelhouse built on the host (`make images` → dist/wheels/control: Keel's wheels and every
# dependency's), never from an index: the build needs no network, and the image holds exactly what was tested.
# BASE_IMAGE is any Debian-like image with Python >= 3.11 and its venv module: python:3.11-slim by default;
# `make images IMAGES_FLAGS=--local-base` (no Docker Hub) passes a Debian bookworm made with debootstrap
# (infra/images/base.sh). The node agent, the SDK and the example workload (which need torch) have their own
# image: infra/images/agent.Dockerfile.
ARG BASE_IMAGE=python:3.11-slim

# The virtual environment is made in a stage of its own and copied whole: the wheelhouse never becomes a layer
# of the image, and a changed wheel changes the COPY's checksum, so no engine reuses a stale install from cache.
FROM ${BASE_IMAGE} AS install
COPY dist/wheels/control /wheels
RUN python3 -m venv /opt/keel \
 && /opt/keel/bin/pip install --no-cache-dir --disable-pip-version-check --no-index --find-links /wheels \
        keel-recorder keel-controller keel-checkpoint-broker keel-actuator keel-analyzer keel-hot-update keel-notifier \
        keel-api

FROM ${BASE_IMAGE}
COPY --from=install /opt/keel /opt/keel

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/keel/bin:$PATH \
    KEEL_HOME=/tmp/keel

# Mount points, owned by the image's user: an empty named volume takes the owner and mode of the folder it is
# first mounted on, so the volumes docker-compose.yml mounts here belong to uid 10001. Keel refuses secrets
# that are not private to the user reading them (0700 folders, 0600 files: keel.infra.secrets), which is why
# the credentials folders are 0700: /var/lib/keel/credentials (KEEL_CREDENTIALS_DIR) and the per-consumer
# exports the compose `credentials` step writes (keel-credentials, keel.infra.provision). The checkpoint
# broker writes the persistent tier's manifests to /var/lib/keel/checkpoints.
RUN useradd --system --uid 10001 --gid 0 --home-dir /home/keel --create-home --shell /usr/sbin/nologin keel \
 && install -d -m 0700 -o 10001 -g 0 /var/lib/keel/credentials \
    /var/lib/keel/export/nats /var/lib/keel/export/migrate /var/lib/keel/export/recorder \
    /var/lib/keel/export/controller /var/lib/keel/export/checkpoint-broker /var/lib/keel/export/actuator \
    /var/lib/keel/export/analyzer /var/lib/keel/export/hot-update /var/lib/keel/export/notifier \
    /var/lib/keel/export/operator /var/lib/keel/export/api \
    /var/lib/keel/export/agent \
 && install -d -m 0750 -o 10001 -g 0 /var/lib/keel/checkpoints

WORKDIR /home/keel
USER 10001

CMD ["keel-controller", "--help"]
