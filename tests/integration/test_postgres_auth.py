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
import stat
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
