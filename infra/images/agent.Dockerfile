# Keel on a training node: the node agent, the SDK, the example workload and the `keel` command line (`keel run`
# starts the agent and the ranks), with the CPU build of torch from the wheelhouse (`make images` →
# dist/wheels/agent). A GPU node's image takes a CUDA build of torch instead; nothing else changes.
#
#   make images
#   podman run --rm keel-agent:local keel run --help
#
# The agent needs what docs/deploy.md lists for a node: the host's PID namespace and SYS_PTRACE (py-spy reads
# the ranks' stacks), /dev/shm (the in-memory checkpoint tier), and on a GPU node the NVIDIA devices and NVML.
ARG BASE_IMAGE=python:3.11-slim

# As in the Dockerfile: the environment is built in a stage of its own and copied whole.
FROM ${BASE_IMAGE} AS install
COPY dist/wheels/agent /wheels
RUN python3 -m venv /opt/keel \
 && /opt/keel/bin/pip install --no-cache-dir --disable-pip-version-check --no-index --find-links /wheels keel-cli

FROM ${BASE_IMAGE}
COPY --from=install /opt/keel /opt/keel

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/keel/bin:$PATH \
    KEEL_HOME=/var/lib/keel/home

RUN useradd --system --uid 10001 --gid 0 --home-dir /home/keel --create-home --shell /usr/sbin/nologin keel \
 && install -d -m 0700 -o 10001 -g 0 /var/lib/keel/credentials /var/lib/keel/home \
 && install -d -m 0750 -o 10001 -g 0 /var/lib/keel/checkpoints

WORKDIR /home/keel
USER 10001

CMD ["keel", "run", "--help"]
