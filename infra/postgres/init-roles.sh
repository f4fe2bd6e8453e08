#!/bin/sh
# Runs once, when the postgres container initialises its volume (/docker-entrypoint-initdb.d): creates Keel's
# least-privilege roles (keel.infra.dbroles) with the passwords compose mounts under /run/secrets. psql reads
# each password itself (\set with backquotes), so none appears on a command line. The grants on the tables
# come later, from `keel-migrate` (the migrate service), which owns them.
set -eu
export KEEL_PG_SECRETS="${KEEL_PG_SECRETS:-/run/secrets}"  # where compose mounts them (overridable for tests)
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" <<'SQL'
\set migrate `cat "$KEEL_PG_SECRETS/postgres_migrate"`
\set recorder `cat "$KEEL_PG_SECRETS/postgres_recorder"`
\set decider `cat "$KEEL_PG_SECRETS/postgres_decider"`
\set auditor `cat "$KEEL_PG_SECRETS/postgres_auditor"`
SET password_encryption = 'scram-sha-256';
CREATE ROLE keel_migrate LOGIN PASSWORD :'migrate';
CREATE ROLE keel_recorder LOGIN PASSWORD :'recorder';
CREATE ROLE keel_decider LOGIN PASSWORD :'decider';
CREATE ROLE keel_auditor LOGIN PASSWORD :'auditor';
SELECT format('GRANT CONNECT, CREATE, TEMPORARY ON DATABASE %I TO keel_migrate', current_database()) \gexec
GRANT USAGE, CREATE ON SCHEMA public TO keel_migrate;
SQL
