# Keel control-plane image: one image, one `keel` entrypoint; the command picks the role
# (`keel migrate`, `keel service recorder`, `keel service controller`).
#
#   docker build -t keel:dev .
#   docker run --rm keel:dev --help
#
# torch is a pinned dependency in pyproject.toml, so `pip install` fetches it from whatever index pip
# is pointed at. Pass --build-arg PIP_INDEX_URL=... / PIP_EXTRA_INDEX_URL=... to use a mirror or a
# CPU-only wheel index; the control plane itself never needs a GPU.
FROM python:3.11-slim

ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KEEL_HOME=/tmp/keel

WORKDIR /app

# Dependencies first, so that a source-only change reuses the (large) dependency layer: install the
# project from its metadata alone, then drop the placeholder tree.
COPY pyproject.toml ./
RUN mkdir -p libs/core libs/cli services/recorder services/controller \
 && touch libs/core/__init__.py libs/cli/__init__.py services/recorder/__init__.py services/controller/__init__.py \
 && pip install --no-cache-dir . \
 && pip uninstall -y keel \
 && rm -rf libs services build *.egg-info

# The source tree, not the build context as a whole (no .venv, .git or build outputs in the image).
COPY libs ./libs
COPY services ./services
COPY migrations ./migrations
COPY proto ./proto

# Editable on purpose: the store finds its Alembic migrations (and the event catalogue) relative to the
# source tree (libs/core/store.py: MIGRATIONS_DIR = <repo>/migrations). A regular wheel install puts the
# code in site-packages without migrations/, and `keel migrate` would find no scripts.
RUN pip install --no-cache-dir --no-deps -e . \
 && useradd --system --uid 10001 --gid 0 --home-dir /home/keel --create-home --shell /usr/sbin/nologin keel

USER 10001

ENTRYPOINT ["keel"]
CMD ["--help"]
