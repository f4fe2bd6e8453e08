"""Shared fixtures: real NATS and PostgreSQL servers, started once per test session on free ports.

With ``KEEL_NATS_URL`` / ``KEEL_DATABASE_URL`` set, those servers are used instead. Every test gets its
own subject prefix, JetStream streams and Postgres schema (``keel_env``), so tests never see each
other's events. Tests that restart a server start their own (``own_nats`` / ``own_postgres``).

PostgreSQL is used as a user would: the schema is migrated as the ``migrate`` role, and the settings of a test
(``isolated_settings``) name each role's URL (``database_urls``), so services started by a test connect as
their own least-privilege role. ``database_url`` stays the superuser's, for the tests' own inspection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio

from keel.infra.bus import Bus
from keel.infra.config import BusSettings, DatabaseUrls, RecorderSettings, Settings
from keel.infra.dbroles import MIGRATE, ROLES
from keel.infra.embedded import NatsServer, PostgresServer, free_port
from keel.infra.nats_auth import ADMIN, NatsScope
from keel.infra.signing import CONTROL_PLANE, KeyringFile, Signing, ensure_signing_identity, keyring_path
from keel.infra.store import EventStore, create_engine, run_migrations
from keel.recorder.adapter import Recorder

# Tests count every event in the log. On a loaded machine a recorder catching up can lag past the 10 s
# default of recorder.lag_threshold, and its RecorderLagReported would be counted too: services started by
# the tests (they inherit this environment) and isolated_settings report lag only past an hour. The tests of
# lag reporting ask for their own threshold (tests/integration/test_recorder_faults.py).
os.environ.setdefault("KEEL_RECORDER__LAG_THRESHOLD", "1h")


def _scratch_dir(prefix: str) -> Path:
    # Not pytest's tmp_path: the embedded Postgres runs as an unprivileged user that must reach it.
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


@pytest.fixture
def scratch_dir() -> Iterator[Path]:
    path = _scratch_dir("keel-test-")
    yield path
    if os.environ.get("KEEL_KEEP_SCRATCH"):  # debugging: keep logs of a failed scenario
        print(f"scratch kept: {path}")
        return
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A folder on the RAM-backed filesystem (``/dev/shm``, else ``/tmp``), as a node agent's slots are: removed after."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    path = Path(tempfile.mkdtemp(prefix="keel-shm-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


TEST_CREDENTIALS = _scratch_dir("keel-test-credentials-")
"""The credentials folder of the tests' settings (``isolated_settings``): every control-plane service's
signing key and the test operator's, as ``keel up`` creates them (removed at exit)."""
TEST_CREDENTIALS.chmod(0o700)
TEST_OPERATOR = "test-operator"
"""The operator identity the harness signs operator events with (their ``by`` must name it)."""


def harness_signing(credentials_dir: Path = TEST_CREDENTIALS) -> Signing:
    """A harness bus's signing: it plays every producer of the control plane and an operator, so it signs
    each event with the key of the role that must sign it (as that producer's own bus would) and checks
    against the keyring."""
    keys = [ensure_signing_identity(credentials_dir, name, name) for name in CONTROL_PLANE]
    keys.append(ensure_signing_identity(credentials_dir, TEST_OPERATOR, "operator"))
    return Signing(keys=tuple(keys), keyring=KeyringFile(credentials_dir / "signing" / "keyring.json"))


@pytest.fixture(scope="session", autouse=True)
def _remove_test_credentials() -> Iterator[None]:
    yield
    shutil.rmtree(TEST_CREDENTIALS, ignore_errors=True)


@dataclass
class Servers:
    nats_url: str
    database_url: str
    role_urls: dict[str, str] = field(default_factory=dict)
    """Each ``keel.infra.dbroles`` role's URL on the session's own server (empty for an external database)."""
    nats: NatsServer | None = None
    """The NATS server started here (None with ``KEEL_NATS_URL``); its identities are in ``TEST_CREDENTIALS``
    (every server the tests start shares them, as the signing keys)."""

    def url(self, role: str) -> str:
        """``role``'s URL (the configured database URL when there are no per-role ones)."""
        return self.role_urls.get(role, self.database_url)


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    external_nats = os.environ.get("KEEL_NATS_URL")
    external_db = os.environ.get("KEEL_DATABASE_URL")
    root = _scratch_dir("keel-servers-")
    started = []
    try:
        nats = None
        if external_nats:
            nats_url = external_nats
        else:
            nats = NatsServer(store_dir=root / "nats", port=free_port(), monitor_port=free_port(), sync_always=True,
                              credentials_dir=TEST_CREDENTIALS)
            nats_url = nats.start()
            started.append(nats)
        role_urls: dict[str, str] = {}
        if external_db:
            database_url = external_db
        else:
            postgres = PostgresServer(data_dir=root / "pg", port=free_port())
            database_url = postgres.start()
            started.append(postgres)
            role_urls = {role: postgres.role_dsn(role) for role in ROLES}
        yield Servers(nats_url, database_url, role_urls, nats)
    finally:
        for server in reversed(started):
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


def isolated_settings(servers: Servers, **recorder: object) -> Settings:
    """Settings with a fresh subject prefix, stream names and schema."""
    tag = uuid.uuid4().hex[:10]
    # The test acts as the admin identity (it publishes what any role would); the services it starts get
    # their own role's identity from the credentials folder, with permissions for this test's prefix and
    # streams (added to the server's authorization, the newest few kept).
    credentials = None
    if servers.nats is not None:
        servers.nats.authority.add_scope(NatsScope(f"kt{tag}", f"KT{tag}", f"KT{tag}_DLQ"))
        credentials = servers.nats.identity_file(ADMIN)
    # Small streams: JetStream reserves max_bytes of disk per stream up front.
    bus = BusSettings(subject_prefix=f"kt{tag}", stream=f"KT{tag}", dlq_stream=f"KT{tag}_DLQ", max_bytes="256MiB",
                      credentials=credentials)
    return Settings(
        nats_url=servers.nats_url,
        database_url=servers.database_url,
        database_urls=DatabaseUrls(**servers.role_urls),
        db_schema=f"t_{tag}",
        credentials_dir=TEST_CREDENTIALS,
        bus=bus,
        recorder=RecorderSettings(**{"lag_threshold": "1h", **recorder}),  # type: ignore[arg-type]
    )


@dataclass
class KeelEnv:
    """One test's slice of the servers: its own prefix, streams and schema, and helpers."""

    settings: Settings
    bus: Bus
    store: EventStore
    tasks: list[asyncio.Task] = field(default_factory=list)
    stops: list[asyncio.Event] = field(default_factory=list)

    @property
    def engine(self):  # type: ignore[no-untyped-def]
        return self.store.engine

    async def start_recorder(self, settings: RecorderSettings | None = None) -> Recorder:
        recorder = Recorder(self.bus, self.engine, settings or self.settings.recorder)
        await recorder.start()
        stop = asyncio.Event()
        self.stops.append(stop)
        self.tasks.append(asyncio.create_task(recorder.run(stop)))
        return recorder

    async def wait_for_count(self, expected: int, timeout_s: float = 30.0) -> int:
        deadline = asyncio.get_running_loop().time() + timeout_s
        count = await self.store.count()
        while count < expected and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
            count = await self.store.count()
        for task in self.tasks:
            if task.done() and task.exception():
                raise task.exception()  # type: ignore[misc]
        return count

    async def shutdown(self) -> None:
        for stop in self.stops:
            stop.set()
        for task in self.tasks:
            try:
                await asyncio.wait_for(task, 10)
            except Exception:  # noqa: BLE001 - teardown: the test has already reported
                task.cancel()


@pytest_asyncio.fixture
async def keel_env(servers: Servers) -> AsyncIterator[KeelEnv]:
    async with keel_env_on(servers) as env:
        yield env


@contextlib.asynccontextmanager
async def keel_env_on(servers: Servers) -> AsyncIterator[KeelEnv]:
    """A test's slice (``keel_env``) of ``servers``: the session's, or a test's own (a NATS on a host network)."""
    settings = isolated_settings(servers)
    await asyncio.to_thread(run_migrations, servers.url(MIGRATE), settings.db_schema)
    bus = await Bus.connect(servers.nats_url, settings.bus, signing=harness_signing())
    assert keyring_path(settings) == TEST_CREDENTIALS / "signing" / "keyring.json"
    engine = create_engine(servers.database_url, settings.db_schema)
    env = KeelEnv(settings, bus, EventStore(engine))
    try:
        yield env
    finally:
        await env.shutdown()
        for stream in (settings.bus.stream, settings.bus.dlq_stream):
            try:
                await bus.js.delete_stream(stream)
            except Exception:  # noqa: BLE001 - best-effort cleanup on a shared server
                pass
        await bus.close()
        async with engine.begin() as conn:
            from sqlalchemy import text

            await conn.execute(text(f'DROP SCHEMA "{settings.db_schema}" CASCADE'))
        await engine.dispose()


@pytest.fixture
def own_nats(scratch_dir: Path) -> Iterator[NatsServer]:
    server = NatsServer(store_dir=scratch_dir / "nats", port=free_port(), monitor_port=free_port(), sync_always=True,
                        credentials_dir=TEST_CREDENTIALS)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_postgres(scratch_dir: Path) -> Iterator[PostgresServer]:
    server = PostgresServer(data_dir=scratch_dir / "pg", port=free_port())
    server.start()
    yield server
    server.stop()
