"""PostgreSQL authentication and least privilege, against a real embedded server.

No connection gets in without the right password (TCP or unix socket); each role of ``keel.infra.dbroles`` can do
what its clients need and nothing more (the recorder appends but cannot change or drop history, deciders read and
snapshot, the auditor only reads, only the migrate role runs DDL); a service on a schema that is not at the latest
revision stops and says to run ``keel migrate``; passwords rotate by deleting their file.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import stat
import struct
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
import sqlalchemy as sa

from keel.events.envelope import Event, now_utc
from keel.events.types import NodeRegistered
from keel.infra.config import DatabaseUrls, Settings, credentials_path, load_settings, resolve_endpoints
from keel.infra.dbroles import AUDITOR, DECIDER, MIGRATE, RECORDER, ROLES
from keel.infra.embedded import EmbeddedRuntime, PostgresServer, free_port
from keel.infra.store import (
    DatabaseNotUsable,
    EventStore,
    Snapshot,
    append_events,
    create_engine,
    event_row,
    record_dead_letter,
    run_migrations,
    save_tracking,
)
from tests.conftest import _scratch_dir

pytestmark = pytest.mark.integration

PERMISSION_DENIED = "42501"


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    """One server for the module, with its secrets in the default folder next to its data directory."""
    root = _scratch_dir("keel-pgauth-")
    server = PostgresServer(root / "pg", free_port())
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A folder the server's account (``nobody`` when the tests run as root) can reach."""
    root = _scratch_dir("keel-pgauth-")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest_asyncio.fixture
async def schema(pg: PostgresServer) -> AsyncIterator[str]:
    """A fresh schema migrated as the migrate role (as `keel migrate` does); dropped afterwards."""
    name = f"a_{uuid.uuid4().hex[:10]}"
    await asyncio.to_thread(run_migrations, pg.role_dsn(MIGRATE), name)
    yield name
    conn = await asyncpg.connect(pg.dsn)
    try:
        await conn.execute(f'DROP SCHEMA "{name}" CASCADE')
    finally:
        await conn.close()


async def _connect(pg: PostgresServer, role: str, schema: str) -> asyncpg.Connection:
    return await asyncpg.connect(pg.role_dsn(role), server_settings={"search_path": schema})


async def _denied(conn: asyncpg.Connection, statement: str) -> str:
    """The SQLSTATE ``statement`` fails with (the test asserts which)."""
    with pytest.raises(asyncpg.PostgresError) as caught:
        await conn.execute(statement)
    return str(caught.value.sqlstate)


def _event(job: str = "job1") -> Event:
    return Event.create(NodeRegistered(node_id="n1", host="h1"), job_id=job, subject="node/n1", producer="node-agent",
                        occurred_at=now_utc())


# -- authentication -----------------------------------------------------------------------------------


async def test_no_password_or_a_wrong_one_is_refused_on_tcp_and_on_the_socket(pg: PostgresServer) -> None:
    for user in ("keel", "keel_recorder"):
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(host="127.0.0.1", port=pg.port, user=user, database="postgres", password="")
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(host="127.0.0.1", port=pg.port, user=user, database="postgres", password="wrong")
        with pytest.raises(asyncpg.InvalidPasswordError):  # the unix socket asks for a password too
            await asyncpg.connect(host=str(pg.run_dir), port=pg.port, user=user, database="postgres", password="x")
    # The right password gets in, on both.
    conn = await asyncpg.connect(pg.dsn)
    assert await conn.fetchval("SELECT current_user") == "keel"
    await conn.close()
    password = pg.dsn.split(":")[2].split("@")[0]
    conn = await asyncpg.connect(host=str(pg.run_dir), port=pg.port, user="keel", database="postgres", password=password)
    await conn.close()


def test_hba_has_no_trust_and_passwords_are_private_files(pg: PostgresServer) -> None:
    rules = [line.split() for line in (pg.data_dir / "pg_hba.conf").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert rules and all(rule[-1] == "scram-sha-256" for rule in rules), rules
    assert pg.secrets_dir is not None and stat.S_IMODE(pg.secrets_dir.stat().st_mode) == 0o700
    files = sorted(p.name for p in pg.secrets_dir.iterdir())
    assert files == sorted(["keel.password", *(f"keel_{role}.password" for role in ROLES)])
    for path in pg.secrets_dir.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.geteuid()
    assert len({p.read_text() for p in pg.secrets_dir.iterdir()}) == len(files)  # one password per role


async def test_login_roles_have_no_attributes_beyond_login(pg: PostgresServer) -> None:
    conn = await asyncpg.connect(pg.dsn)
    try:
        rows = await conn.fetch("SELECT rolname, rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls, "
                                "rolcanlogin FROM pg_roles WHERE rolname LIKE 'keel\\_%'")
    finally:
        await conn.close()
    assert sorted(r["rolname"] for r in rows) == sorted(f"keel_{role}" for role in ROLES)
    assert all(r["rolcanlogin"] and not any(r[k] for k in ("rolsuper", "rolcreaterole", "rolcreatedb",
                                                            "rolreplication", "rolbypassrls")) for r in rows)


# -- least privilege ------------------------------------------------------------------------------------


async def test_the_recorder_appends_but_cannot_change_history_or_the_schema(pg: PostgresServer, schema: str) -> None:
    engine = create_engine(pg.role_dsn(RECORDER), schema)
    try:
        event = _event()
        async with engine.begin() as conn:  # everything the recorder does in a batch
            positions = await append_events(conn, [event_row(event, 1)])
            await save_tracking(conn, "recorder", 1, positions[event.id])
            await record_dead_letter(conn, 2, "keel.x", "not an event", b"junk")
            await conn.execute(sa.text("INSERT INTO node_status (job_id, node_id, last_event_id, updated_at) "
                                       "VALUES ('job1', 'n1', :id, now()) ON CONFLICT (job_id, node_id) DO UPDATE "
                                       "SET health = 'ok'"), {"id": event.id})
        assert await EventStore(engine).count() == 1
    finally:
        await engine.dispose()
    conn = await _connect(pg, RECORDER, schema)
    try:
        assert await _denied(conn, "DELETE FROM events") == PERMISSION_DENIED
        assert await _denied(conn, "UPDATE events SET job_id = 'x'") == PERMISSION_DENIED
        assert await _denied(conn, "TRUNCATE events") == PERMISSION_DENIED
        assert await _denied(conn, "DROP TABLE events") == PERMISSION_DENIED
        assert await _denied(conn, "CREATE TABLE evil (id int)") == PERMISSION_DENIED
        assert await _denied(conn, "ALTER TABLE events DISABLE TRIGGER events_append_only") == PERMISSION_DENIED
        assert await _denied(conn, "DELETE FROM snapshots") == PERMISSION_DENIED
        assert await _denied(conn, "UPDATE alembic_version SET version_num = '0001'") == PERMISSION_DENIED
        assert await _denied(conn, "CREATE SCHEMA evil") == PERMISSION_DENIED
    finally:
        await conn.close()


async def test_a_decider_reads_and_snapshots_but_cannot_append(pg: PostgresServer, schema: str) -> None:
    conn = await _connect(pg, DECIDER, schema)
    try:
        assert await conn.fetchval("SELECT count(*) FROM events") == 0
        assert await _denied(conn, "INSERT INTO events (event_id, type, schema_version, job_id, subject, occurred_at, "
                                   "producer, payload) VALUES (gen_random_uuid(), 't', 1, 'j', 's', now(), 'p', "
                                   "'{}')") == PERMISSION_DENIED
        assert await _denied(conn, f"SELECT {'lock_events_for_append'}()") == PERMISSION_DENIED
        assert await _denied(conn, "INSERT INTO tracking VALUES ('x', 1, 1)") == PERMISSION_DENIED
        assert await _denied(conn, "CREATE TABLE evil (id int)") == PERMISSION_DENIED
    finally:
        await conn.close()
    engine = create_engine(pg.role_dsn(DECIDER), schema)
    try:
        store = EventStore(engine)
        for position in (1, 2):  # keep=1: the second save deletes the first
            await store.save_snapshot(Snapshot(decider="controller", scope="*", position=position, js_seq=position,
                                               event_id=None, fingerprint="f", digest="d", events_folded=position,
                                               state=b"{}"), keep=1)
        assert [s.position for s in await store.snapshots("controller")] == [2]
    finally:
        await engine.dispose()


async def test_the_auditor_only_reads(pg: PostgresServer, schema: str) -> None:
    conn = await _connect(pg, AUDITOR, schema)
    try:
        for table in ("events", "tracking", "dead_letters", "node_status", "snapshots", "alembic_version"):
            await conn.fetch(f"SELECT * FROM {table} LIMIT 1")
        assert await _denied(conn, "INSERT INTO snapshots (decider, scope, position, fingerprint, digest, "
                                   "events_folded, state) VALUES ('d', '*', 1, 'f', 'd', 1, '')") == PERMISSION_DENIED
        assert await _denied(conn, "DELETE FROM dead_letters") == PERMISSION_DENIED
    finally:
        await conn.close()


async def test_the_migrate_role_owns_the_tables_and_runs_ddl(pg: PostgresServer, schema: str) -> None:
    conn = await _connect(pg, MIGRATE, schema)
    try:
        owners = {r["tablename"]: r["tableowner"]
                  for r in await conn.fetch("SELECT tablename, tableowner FROM pg_tables WHERE schemaname = $1", schema)}
        assert set(owners.values()) == {"keel_migrate"} and "events" in owners
        await conn.execute("CREATE TABLE scratch (id int)")
        await conn.execute("DROP TABLE scratch")
        assert await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user") is False
    finally:
        await conn.close()
    # Migrating again (as every `keel up` does) is a no-op that re-applies the same grants.
    await asyncio.to_thread(run_migrations, pg.role_dsn(MIGRATE), schema)
    conn = await _connect(pg, RECORDER, schema)
    try:
        assert await _denied(conn, "DELETE FROM events") == PERMISSION_DENIED
        assert await conn.fetchval("SELECT count(*) FROM events") == 0
    finally:
        await conn.close()


def test_a_database_that_is_not_utf8_is_refused_before_anything_is_created(pg: PostgresServer) -> None:
    # SQL_ASCII (what initdb picks without a locale) cannot hold an event with a non-ASCII character: the
    # recorder would stop at the first one. The migration refuses it, saying how to make a usable one.
    database = f"ascii_{uuid.uuid4().hex[:8]}"

    async def create() -> None:
        conn = await asyncpg.connect(pg.dsn)
        try:
            await conn.execute(f"CREATE DATABASE {database} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' "
                               "TEMPLATE template0")
            await conn.execute(f"GRANT CONNECT, CREATE, TEMPORARY ON DATABASE {database} TO keel_migrate")
        finally:
            await conn.close()

    asyncio.run(create())
    with pytest.raises(DatabaseNotUsable, match=r"server encoding SQL_ASCII.*needs UTF8.*ENCODING 'UTF8'"):
        run_migrations(pg.role_dsn(MIGRATE, database), "public")

    async def tables() -> int:
        conn = await asyncpg.connect(pg.dsn_for(database))
        try:
            return int(await conn.fetchval("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"))
        finally:
            await conn.close()

    assert asyncio.run(tables()) == 0


# -- services do not migrate --------------------------------------------------------------------------


def _run_controller(pg: PostgresServer, schema: str, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env.update(KEEL_HOME=str(home), KEEL_NATS_URL=f"nats://127.0.0.1:{free_port()}", KEEL_DB_SCHEMA=schema,
               KEEL_DATABASE_URL=pg.role_dsn(DECIDER))
    return subprocess.run([sys.executable, "-m", "keel.controller.main"], env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_service_on_an_unmigrated_schema_stops_and_says_run_keel_migrate(pg: PostgresServer, tmp_path: Path) -> None:
    result = _run_controller(pg, f"u_{uuid.uuid4().hex[:10]}", tmp_path / "home")
    assert result.returncode == 2, result.stderr
    assert "not migrated" in result.stderr and "run `keel migrate`" in result.stderr
    assert "Traceback" not in result.stderr


async def test_a_service_on_an_older_revision_stops_and_names_both_revisions(pg: PostgresServer, tmp_path: Path) -> None:
    from alembic import command

    from keel.infra.store import _alembic_config, head_revision

    name = f"o_{uuid.uuid4().hex[:10]}"
    await asyncio.to_thread(command.upgrade, _alembic_config(pg.role_dsn(MIGRATE), name), "0002")
    try:
        result = await asyncio.to_thread(_run_controller, pg, name, tmp_path / "home")
        assert result.returncode == 2, result.stderr
        assert f"at revision 0002, this Keel needs {head_revision()}" in result.stderr
        assert "run `keel migrate`" in result.stderr and "Traceback" not in result.stderr
    finally:
        conn = await asyncpg.connect(pg.dsn)
        await conn.execute(f'DROP SCHEMA "{name}" CASCADE')
        await conn.close()


# -- rotation, legacy clusters, the embedded runtime's endpoints ----------------------------------------


async def test_deleting_a_password_file_rotates_that_password(pg: PostgresServer) -> None:
    old = pg.role_dsn(RECORDER)
    pg.password_file("keel_recorder").unlink()
    pg.start()  # idempotent on a running server; re-creates the roles' passwords
    new = pg.role_dsn(RECORDER)
    assert new != old
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(old)
    conn = await asyncpg.connect(new)
    await conn.close()


async def test_a_cluster_without_a_superuser_password_gets_one_at_its_next_start(scratch: Path) -> None:
    """A cluster made before passwords (its password file missing): the next start sets one offline."""
    server = PostgresServer(scratch / "pg", free_port())
    try:
        old = server.start()
        server.stop()
        server.password_file("keel").unlink()
        new = server.start()
        assert new != old
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(old)
        conn = await asyncpg.connect(new)
        assert await conn.fetchval("SELECT 1") == 1
        await conn.close()
    finally:
        server.stop()


async def test_the_embedded_runtime_hands_each_role_its_own_url_and_writes_no_password(scratch: Path) -> None:
    root = scratch
    settings = load_settings(environ={"KEEL_HOME": str(root / "home"), "KEEL_POSTGRES__PORT": str(free_port()),
                                      "KEEL_NATS__PORT": str(free_port()), "KEEL_NATS__MONITOR_PORT": str(free_port())})
    runtime = EmbeddedRuntime(settings.home, nats_port=settings.nats.port, nats_monitor_port=settings.nats.monitor_port,
                              postgres_port=settings.postgres.port, credentials_dir=credentials_path(settings))
    try:
        runtime.up()
        text = runtime.runtime_file.read_text()
        secrets = credentials_path(settings) / "postgres"
        assert sorted(p.name for p in secrets.iterdir())[0] == "keel.password"
        assert all(p.read_text().strip() not in text for p in secrets.iterdir())
        assert "@" not in json.loads(text)["postgres"]["dsn"]
        for role in ROLES:
            _, url = resolve_endpoints(settings, role)
            conn = await asyncpg.connect(url)
            assert await conn.fetchval("SELECT current_user") == f"keel_{role}"
            await conn.close()
        _, address = resolve_endpoints(settings, None)
        assert "@" not in address
        # A schema migrated as the superuser (before roles existed): the next `keel up` hands it to keel_migrate,
        # which can then migrate it.
        await asyncio.to_thread(run_migrations, runtime.postgres.dsn, "legacy")
        runtime.up()
        await asyncio.to_thread(run_migrations, resolve_endpoints(settings, MIGRATE)[1], "legacy")
        conn = await asyncpg.connect(runtime.postgres.dsn)
        try:
            owners = {r[0] for r in await conn.fetch("SELECT tableowner FROM pg_tables WHERE schemaname = 'legacy'")}
            owners |= {r[0] for r in await conn.fetch(
                "SELECT pg_get_userbyid(proowner) FROM pg_proc WHERE pronamespace = 'legacy'::regnamespace")}
            owners.add(await conn.fetchval("SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = 'legacy'"))
        finally:
            await conn.close()
        assert owners == {"keel_migrate"}
    finally:
        runtime.down()


def test_a_configured_database_url_takes_its_password_from_a_file_and_roles_override_it(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    settings = Settings(nats_url="nats://n:4222", database_url="postgresql://keel_recorder@db:5432/keel?sslmode=verify-full",
                        database_password_file=secret,
                        database_urls=DatabaseUrls(auditor="postgresql://reader:pw@db:5432/keel"))
    assert resolve_endpoints(settings, RECORDER)[1] == "postgresql://keel_recorder:s3cret@db:5432/keel?sslmode=verify-full"
    assert resolve_endpoints(settings, AUDITOR)[1] == "postgresql://reader:pw@db:5432/keel"
    missing = settings.model_copy(update={"database_password_file": tmp_path / "absent"})
    from keel.infra.config import ConfigError

    with pytest.raises(ConfigError, match="database_password_file .*absent"):
        resolve_endpoints(missing, RECORDER)


# -- TLS: libpq's sslmode through SQLAlchemy and asyncpg --------------------------------------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _make_ca_and_server_cert(folder: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate for 127.0.0.1, server key), made with openssl."""
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=keel-test-ca",
             "-keyout", str(ca_key), "-out", str(ca))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(csr))
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-days", "1",
             "-extfile", str(ext), "-out", str(cert))
    return ca, cert, key


class TlsFrontEnd:
    """A TLS front end for the embedded PostgreSQL (whose build has no TLS): it answers the client's SSLRequest
    with 'S', does the server side of the handshake with ``context`` and then relays the plain protocol to the
    server. ``handshakes`` counts the clients that completed TLS; ``plain`` those that asked for none."""

    SSL_REQUEST, GSSENC_REQUEST = 80877103, 80877104

    def __init__(self, backend_port: int, context: ssl.SSLContext) -> None:
        self.backend_port, self.context = backend_port, context
        self.handshakes = self.plain = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> TlsFrontEnd:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await reader.readexactly(8)
            while struct.unpack("!ii", first)[1] == self.GSSENC_REQUEST:
                writer.write(b"N")
                first = await reader.readexactly(8)
            if struct.unpack("!ii", first)[1] == self.SSL_REQUEST:
                writer.write(b"S")
                await writer.drain()
                await writer.start_tls(self.context)
                self.handshakes += 1
                first = b""
            else:
                self.plain += 1
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
            up_writer.write(first)

            async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
                dst.close()

            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer), return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            writer.close()


async def _tls_query(url: str) -> int:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return int((await conn.execute(sa.text("SELECT 1"))).scalar_one())
    finally:
        await engine.dispose()


async def test_sslmode_in_the_url_reaches_a_tls_server_and_verify_full_checks_the_name(pg: PostgresServer,
                                                                                        scratch: Path) -> None:
    ca, cert, key = _make_ca_and_server_cert(scratch)
    (scratch / "other").mkdir()
    other_ca, _, _ = _make_ca_and_server_cert(scratch / "other")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    async with TlsFrontEnd(pg.port, context) as front:
        base = pg.role_dsn(AUDITOR).replace(f":{pg.port}/", f":{front.port}/")
        assert await _tls_query(f"{base}?sslmode=require") == 1
        assert await _tls_query(f"{base}?sslmode=verify-full&sslrootcert={ca}") == 1
        assert front.handshakes == 2
        with pytest.raises(ssl.SSLCertVerificationError):  # signed by another CA
            await _tls_query(f"{base}?sslmode=verify-full&sslrootcert={other_ca}")
        by_name = base.replace("@127.0.0.1:", "@localhost:")  # the certificate names 127.0.0.1 only
        with pytest.raises(ssl.SSLCertVerificationError, match="match|mismatch"):
            await _tls_query(f"{by_name}?sslmode=verify-full&sslrootcert={ca}")
        assert await _tls_query(f"{by_name}?sslmode=verify-ca&sslrootcert={ca}") == 1  # verify-ca checks no name
        assert await _tls_query(f"{base}?sslmode=disable") == 1 and front.plain == 1


# -- docker-compose's PostgreSQL set-up, without Docker ---------------------------------------------------


async def test_the_compose_role_script_makes_roles_the_migration_and_services_work_with(scratch: Path) -> None:
    """infra/postgres/make-secrets.sh and init-roles.sh (what the postgres container runs at its first start)
    against a real server whose Keel roles were dropped first: keel-migrate then migrates as keel_migrate and
    the recorder's role may append, with the generated passwords."""
    root = Path(__file__).resolve().parents[2]
    server = PostgresServer(scratch / "pg", free_port())
    try:
        server.start()
        conn = await asyncpg.connect(server.dsn)
        await conn.execute("CREATE DATABASE keel")
        for role in ROLES:
            await conn.execute(f"DROP OWNED BY keel_{role}")
            await conn.execute(f"DROP ROLE keel_{role}")
        await conn.close()
        secrets = scratch / "secrets" / "postgres"
        subprocess.run(["sh", str(root / "infra/postgres/make-secrets.sh"), str(secrets)], check=True, capture_output=True)
        assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
        mounted = scratch / "run-secrets"  # what compose's `secrets:` makes of them
        mounted.mkdir()
        for role in ROLES:
            shutil.copy(secrets / f"{role}.password", mounted / f"postgres_{role}")
        psql_dir = server._account_and_bin()[1]
        env = {**os.environ, "PATH": f"{psql_dir}:{os.environ['PATH']}", "PGHOST": "127.0.0.1", "PGPORT": str(server.port),
               "PGPASSWORD": server.dsn.split(":")[2].split("@")[0], "POSTGRES_USER": "keel", "POSTGRES_DB": "keel",
               "KEEL_PG_SECRETS": str(mounted)}
        result = subprocess.run(["sh", str(root / "infra/postgres/init-roles.sh")], env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr

        def url(role: str) -> str:
            return f"postgresql://keel_{role}:{(secrets / f'{role}.password').read_text()}@127.0.0.1:{server.port}/keel"

        await asyncio.to_thread(run_migrations, url(MIGRATE), "public")
        engine = create_engine(url(RECORDER))
        try:
            async with engine.begin() as c:
                await append_events(c, [event_row(_event(), 1)])
            assert await EventStore(engine).count() == 1
        finally:
            await engine.dispose()
        conn = await asyncpg.connect(url(DECIDER))
        try:
            assert await _denied(conn, "DELETE FROM events") == PERMISSION_DENIED
        finally:
            await conn.close()
    finally:
        server.stop()
