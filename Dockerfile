# Keel control-plane image: the control-plane distributions, installed as plain wheels (no editable
# install, no source tree), without torch. One console script per role:
#   keel-migrate, keel-recorder, keel-controller, keel-checkpoint-broker, keel-analyzer, keel-hot-update
# and keel-credentials (a deployment's NATS identities, signing keys and NATS TLS certificate).
#
#   docker build -t keel:dev .
#   docker run --rm keel:dev keel-controller --help
#
# The node agent, the SDK and the example workload (which need torch) are not in this image: they run on
# the training nodes. Pass --build-arg PIP_INDEX_URL=... / PIP_EXTRA_INDEX_URL=... to use a mirror.
FROM python:3.11-slim

ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KEEL_HOME=/tmp/keel

WORKDIR /src

# The distributions the control plane needs, bottom layer first (docs/architecture.md). Every keel-*
# requirement is satisfied by a folder on this one command line, never by the index (some keel-* names on
# PyPI are unrelated projects).
COPY libs/events libs/events
COPY libs/kernel libs/kernel
COPY libs/rules libs/rules
COPY libs/checkpoint libs/checkpoint
COPY migrations migrations
COPY libs/infra libs/infra
COPY services/recorder services/recorder
COPY services/controller services/controller
COPY services/checkpoint_broker services/checkpoint_broker
COPY services/analyzer services/analyzer
COPY services/hot_update services/hot_update
# Mount points, owned by the image's user: Docker gives an empty named volume the owner and mode of the folder it
# is first mounted on, so the volumes docker-compose.yml mounts here belong to uid 10001. Keel refuses secrets
# that are not private to the user reading them (0700 folders, 0600 files: keel.infra.secrets), which is why
# the credentials folders are 0700: /var/lib/keel/credentials (KEEL_CREDENTIALS_DIR) and the per-consumer
# exports the compose `credentials` step writes (keel-credentials, keel.infra.provision). The checkpoint
# broker writes the persistent tier's manifests to /var/lib/keel/checkpoints.
RUN pip install --no-cache-dir ./libs/events ./libs/kernel ./libs/rules ./libs/checkpoint ./migrations ./libs/infra \
        ./services/recorder ./services/controller ./services/checkpoint_broker ./services/analyzer ./services/hot_update \
 && rm -rf /src \
 && useradd --system --uid 10001 --gid 0 --home-dir /home/keel --create-home --shell /usr/sbin/nologin keel \
 && install -d -m 0700 -o 10001 -g 0 /var/lib/keel/credentials \
    /var/lib/keel/export/nats /var/lib/keel/export/migrate /var/lib/keel/export/recorder \
    /var/lib/keel/export/controller /var/lib/keel/export/checkpoint-broker /var/lib/keel/export/analyzer \
    /var/lib/keel/export/hot-update /var/lib/keel/export/operator \
 && install -d -m 0750 -o 10001 -g 0 /var/lib/keel/checkpoints

WORKDIR /home/keel
USER 10001

CMD ["keel-controller", "--help"]
