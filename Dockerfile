# Keel control-plane image: the control-plane distributions, installed as plain wheels (no editable
# install, no source tree), without torch. One console script per role:
#   keel-migrate, keel-recorder, keel-controller, keel-checkpoint-broker, keel-analyzer, keel-hot-update
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
RUN pip install --no-cache-dir ./libs/events ./libs/kernel ./libs/rules ./libs/checkpoint ./migrations ./libs/infra \
        ./services/recorder ./services/controller ./services/checkpoint_broker ./services/analyzer ./services/hot_update \
 && rm -rf /src \
 && useradd --system --uid 10001 --gid 0 --home-dir /home/keel --create-home --shell /usr/sbin/nologin keel

WORKDIR /home/keel
USER 10001

CMD ["keel-controller", "--help"]
