"""The Postgres event store: table definitions, migrations, reads, and the batched append.

Tables (created by the Alembic migrations under ``migrations/``):

- ``events``: append-only (a trigger refuses UPDATE and DELETE). ``position`` is the global position
  *in commit order*: appends take an exclusive lock on the table for the length of their transaction,
  so a reader tailing by position never skips a row that commits late. ``event_id`` is unique, which
  makes every append idempotent. ``js_seq`` is the JetStream stream sequence the event arrived with.
  Payloads are stored as recorded (their original ``schema_version``) and upcast on read.
- ``tracking``: per consumer, the last JetStream sequence and position it made durable, written in the
  same transaction as the events and projections.
- ``dead_letters``: what the recorder could not accept, with the raw bytes and the reason.
- ``node_status``: a projection (read model) of every node's latest health and eviction state.
- ``snapshots``: deciders' states folded through a position (``keel.kernel.snapshot``), compressed, with
  the digest of the uncompressed state and the fingerprint of the code that folded it.

SQLAlchemy 2 (async, asyncpg) for everything except the bulk append, which uses asyncpg's binary COPY
(``bench/bus.py`` measures why).

Roles (``keel.infra.dbroles``): only the migrating role runs DDL. ``run_migrations`` brings a schema to the
latest revision and then grants every other role exactly its privileges in it; a service only checks at start
that the schema is at that revision (``check_schema_current``) and stops with "run `keel migrate`" otherwise.
A URL's libpq TLS parameters (``sslmode``, ``sslrootcert``, ...) become asyncpg's ``ssl=`` (``keel.infra.dburl``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib.resources import files
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pydantic import TypeAdapter
from sqlalchemy.dialects.postgresql import ARRAY, BYTEA, JSONB, UUID, insert
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from keel.events.envelope import REGISTRY, Event, EventRegistry, InvalidEvent
from keel.infra.dbroles import AUDITOR, DECIDER, LOCK_FUNCTION, RECORDER, grant_statements, pg_role, quote_ident
from keel.infra.dburl import split_tls, sqlalchemy_url

metadata = sa.MetaData()

events_table = sa.Table(
    "events",
    metadata,
    sa.Column("position", sa.BigInteger, sa.Identity(always=False), primary_key=True),
    sa.Column("event_id", UUID(as_uuid=True), nullable=False, unique=True),
    sa.Column("js_seq", sa.BigInteger, nullable=True),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("schema_version", sa.Integer, nullable=False),
    sa.Column("job_id", sa.Text, nullable=False),
    sa.Column("subject", sa.Text, nullable=False),
    sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.Column("producer", sa.Text, nullable=False),
    sa.Column("causation_id", UUID(as_uuid=True), nullable=True),
    sa.Column("correlation_id", UUID(as_uuid=True), nullable=True),
    sa.Column("payload", JSONB, nullable=False),
    # A signed event's signer and signature (keel.events.signing); null on unsigned ones.
    sa.Column("signed_by", sa.Text, nullable=True),
    sa.Column("signature", sa.Text, nullable=True),
)

tracking_table = sa.Table(
    "tracking",
    metadata,
    sa.Column("consumer", sa.Text, primary_key=True),
    sa.Column("last_js_seq", sa.BigInteger, nullable=False),
    sa.Column("last_position", sa.BigInteger, nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
)

dead_letters_table = sa.Table(
    "dead_letters",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
    sa.Column("js_seq", sa.BigInteger, nullable=False, unique=True),
    sa.Column("subject", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("raw", BYTEA, nullable=False),
    sa.Column("received_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
)

node_status_table = sa.Table(
    "node_status",
    metadata,
    sa.Column("job_id", sa.Text, primary_key=True),
    sa.Column("node_id", sa.Text, primary_key=True),
    sa.Column("health", sa.Text, nullable=False, server_default="unknown"),
    sa.Column("detail", sa.Text, nullable=False, server_default=""),
    sa.Column("evicted", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("last_event_id", UUID(as_uuid=True), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)

snapshots_table = sa.Table(
    "snapshots",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
    sa.Column("decider", sa.Text, nullable=False),
    sa.Column("scope", sa.Text, nullable=False),
    sa.Column("position", sa.BigInteger, nullable=False),
    sa.Column("js_seq", sa.BigInteger, nullable=True),
    sa.Column("event_id", UUID(as_uuid=True), nullable=True),
    sa.Column("fingerprint", sa.Text, nullable=False),
    sa.Column("digest", sa.Text, nullable=False),
    sa.Column("events_folded", sa.BigInteger, nullable=False),
    sa.Column("state", BYTEA, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.UniqueConstraint("decider", "scope", "position", "fingerprint", name="snapshots_unique"),
)


@dataclass(frozen=True)
class Snapshot:
    """A decider's state folded through ``position`` (every event at or before it, in log order).
    ``state`` is the typed JSON of ``keel.kernel.snapshot`` (uncompressed here); ``digest`` its SHA-256."""

    decider: str
    scope: str
    """The job the decider folded (``*``: every job)."""
    position: int
    js_seq: int | None
    event_id: uuid.UUID | None
    """The event at ``position``, and its stream sequence: where the snapshot's log ends."""
    fingerprint: str
    digest: str
    events_folded: int
    state: bytes
    created_at: datetime | None = None


EVENT_COLUMNS = (
    "event_id",
    "js_seq",
    "type",
    "schema_version",
    "job_id",
    "subject",
    "occurred_at",
    "producer",
    "causation_id",
    "correlation_id",
    "payload",
    "signed_by",
    "signature",
)

# The migrations ship as package data of keel-migrations; Alembic wants a folder on disk, which an
# installed (non-zip) package is.
MIGRATIONS_DIR = Path(str(files("keel.migrations")))


class SchemaNotCurrent(RuntimeError):
    """The event store's schema is not at the revision this Keel needs; the message says to run ``keel migrate``."""


class DatabaseNotUsable(RuntimeError):
    """The database cannot hold Keel's event store as it is; the message says why and what to do."""


class MissingRoles(DatabaseNotUsable):
    """The roles the migration grants to do not exist and the migrating role may not create them."""


def check_database(connection: Connection) -> None:
    """Refuse a database the event store cannot live in, before anything is created there: one whose server
    encoding is not UTF-8 (SQL_ASCII, what initdb picks without a locale) rejects every event with a character
    outside ASCII, so the recorder would stop at the first one."""
    encoding = connection.execute(sa.text("SHOW server_encoding")).scalar_one()
    if str(encoding).upper().replace("-", "") != "UTF8":
        database = connection.execute(sa.text("SELECT current_database()")).scalar_one()
        raise DatabaseNotUsable(
            f"database {database!r} has server encoding {encoding}, and the event store needs UTF8: create it with "
            f"CREATE DATABASE {quote_ident(str(database))} ENCODING 'UTF8' TEMPLATE template0 (or initdb --encoding=UTF8)")


def async_dsn(dsn: str) -> str:
    """``postgresql://...`` as SQLAlchemy's asyncpg URL (TLS parameters left as they are: see ``engine_options``)."""
    return sqlalchemy_url(dsn)


def engine_options(dsn: str) -> tuple[str, dict[str, Any]]:
    """(SQLAlchemy URL, ``connect_args``) for ``dsn``: libpq's ``sslmode``/``sslrootcert``/... taken out of the
    URL and given to asyncpg as ``ssl=`` (asyncpg has no ``sslmode`` keyword). ``ValueError`` on a bad one."""
    url, tls = split_tls(dsn)
    return sqlalchemy_url(url), ({} if tls is None else {"ssl": tls})


def create_engine(dsn: str, schema: str = "public", *, pool_size: int = 5, pre_ping: bool = True) -> AsyncEngine:
    """An async engine whose connections use ``schema`` (tests give each test its own schema).

    ``pre_ping``: test each pooled connection as it is checked out (three round trips with asyncpg: a transaction
    begun, ``;``, rolled back). An ``EventStore``'s ``fetch_engine`` can do without: its listing reads drop a
    connection the server closed and take another."""
    url, connect_args = engine_options(dsn)
    return create_async_engine(
        url,
        pool_size=pool_size,
        pool_pre_ping=pre_ping,
        connect_args={**connect_args, "server_settings": {"search_path": schema, "synchronous_commit": "on"}},
    )


def _alembic_config(dsn: str | None = None, schema: str = "public") -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["keel_dsn"] = dsn
    config.attributes["keel_schema"] = schema
    return config


def run_migrations(dsn: str, schema: str = "public") -> None:
    """Bring ``schema`` to the latest Alembic revision (creating the schema if needed), then grant the
    recorder, decider and auditor roles exactly their privileges in it (``grant_privileges``). ``dsn`` is
    the migrating role's (it owns the tables). Synchronous."""
    from alembic import command

    command.upgrade(_alembic_config(dsn, schema), "head")


def head_revision() -> str:
    """The latest revision of the migrations this Keel ships."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None
    return head


def grant_privileges(connection: Connection, schema: str) -> None:
    """Give every non-owner role exactly ``keel.infra.dbroles.TABLE_PRIVILEGES`` in ``schema`` (run by the
    migrations, in their connection). A missing role is created NOLOGIN when the migrating role may create
    roles (an external database: an administrator then lets a login user in, ``GRANT keel_recorder TO ...``
    or ``ALTER ROLE keel_recorder LOGIN PASSWORD ...``); otherwise ``MissingRoles`` says what to create."""
    names = [pg_role(role) for role in (RECORDER, DECIDER, AUDITOR)]
    existing = set(connection.execute(sa.text("SELECT rolname FROM pg_roles WHERE rolname = ANY(:names)"),
                                      {"names": names}).scalars())
    missing = [name for name in names if name not in existing]
    if missing:
        user, may = connection.execute(sa.text(
            "SELECT current_user, rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user")).one()
        if not may:
            raise MissingRoles(
                f"the event store's roles {', '.join(missing)} do not exist and {user!r} may not create roles: "
                f"have an administrator create them once (CREATE ROLE {missing[0]} LOGIN PASSWORD '...'; and so on), "
                f"or run `keel migrate` as a role with CREATEROLE")
        for name in missing:
            connection.execute(sa.text(f"CREATE ROLE {quote_ident(name)} NOLOGIN"))
    present = connection.execute(sa.text(
        "SELECT relname FROM pg_class WHERE relnamespace = CAST(:s AS regnamespace) AND relkind IN ('r', 'p', 'v') "
        "UNION SELECT proname || '()' FROM pg_proc WHERE pronamespace = CAST(:s AS regnamespace) AND pronargs = 0"),
        {"s": quote_ident(schema)}).scalars()
    for statement in grant_statements(schema, frozenset(present)):
        connection.execute(sa.text(statement))


async def check_schema_current(engine: AsyncEngine, schema: str) -> None:
    """Raise ``SchemaNotCurrent`` unless ``schema`` is at ``head_revision()``: what a service checks at start
    instead of migrating (it has no DDL rights)."""
    head = head_revision()
    try:
        async with engine.connect() as conn:
            current = (await conn.execute(sa.text("SELECT version_num FROM alembic_version"))).scalar_one_or_none()
    except DBAPIError as exc:
        # 42P01: no such table (never migrated, or this role has no USAGE on the schema); 42501: no SELECT.
        if str(getattr(exc.orig, "sqlstate", "")) not in ("42P01", "42501"):
            raise
        raise SchemaNotCurrent(
            f"the event store schema {schema!r} is not migrated (or not for this database role): run `keel migrate` "
            f"(or keel-migrate) first; it creates the tables and grants each service's role its privileges") from None
    if current != head:
        raise SchemaNotCurrent(
            f"the event store schema {schema!r} is at revision {current or 'none'}, this Keel needs {head}: "
            f"run `keel migrate` (or keel-migrate) first")


@dataclass(frozen=True)
class RecordedEvent:
    """An event as the store holds it: its position, JetStream sequence and the upcast event."""

    position: int
    js_seq: int | None
    recorded_at: datetime
    event: Event


def event_row(event: Event, js_seq: int | None, as_sent: dict[str, Any] | None = None) -> tuple[Any, ...]:
    """The ``EVENT_COLUMNS`` tuple for ``append_events``.

    With ``as_sent`` (the envelope as it arrived) the row keeps the original ``schema_version`` and
    payload; the store upcasts on read.
    """
    version = as_sent["schema_version"] if as_sent else event.schema_version
    payload = as_sent["payload"] if as_sent else event.payload.model_dump(mode="json")
    return (
        event.id,
        js_seq,
        event.type,
        version,
        event.job_id,
        event.subject,
        event.occurred_at,
        event.producer,
        event.causation_id,
        event.correlation_id,
        json.dumps(payload, separators=(",", ":")),
        event.signed_by,
        event.signature,
    )


async def append_events(conn: AsyncConnection, rows: Sequence[tuple[Any, ...]]) -> dict[uuid.UUID, int]:
    """Append rows (``event_row`` tuples, in stream order) inside the caller's transaction.

    Idempotent on ``event_id``: rows already stored are skipped. Returns ``{event_id: position}`` for
    the rows that were new. Takes the commit-order lock on ``events``.
    """
    if not rows:
        return {}
    # Through a SECURITY DEFINER function: the recorder's role may not LOCK in this mode itself.
    await conn.execute(sa.text(f"SELECT {LOCK_FUNCTION}()"))
    raw = (await conn.get_raw_connection()).driver_connection
    assert raw is not None
    # The payload travels as text and is cast to jsonb in the INSERT: asyncpg's text jsonb codec
    # breaks binary COPY, and a binary codec on a pooled connection would confuse SQLAlchemy's reads.
    await raw.execute(
        "CREATE TEMP TABLE IF NOT EXISTS events_incoming ("
        "ord bigint, event_id uuid, js_seq bigint, type text, schema_version int, job_id text, subject text, "
        "occurred_at timestamptz, producer text, causation_id uuid, correlation_id uuid, payload text, "
        "signed_by text, signature text"
        ") ON COMMIT DELETE ROWS"
    )
    await raw.copy_records_to_table(
        "events_incoming",
        records=[(index, *row) for index, row in enumerate(rows)],
        columns=["ord", *EVENT_COLUMNS],
    )
    cols = ", ".join(EVENT_COLUMNS)
    select_cols = ", ".join("payload::jsonb" if c == "payload" else c for c in EVENT_COLUMNS)
    # Keep stream order (ord) for positions; a duplicate id inside one batch keeps its first copy.
    result = await raw.fetch(
        f"INSERT INTO events ({cols}) "
        f"SELECT {select_cols} FROM ("
        "  SELECT DISTINCT ON (event_id) * FROM events_incoming ORDER BY event_id, ord"
        ") AS fresh ORDER BY ord "
        "ON CONFLICT (event_id) DO NOTHING RETURNING event_id, position"
    )
    return {r["event_id"]: r["position"] for r in result}


async def save_tracking(conn: AsyncConnection, consumer: str, js_seq: int, position: int) -> None:
    stmt = insert(tracking_table).values(consumer=consumer, last_js_seq=js_seq, last_position=position)
    stmt = stmt.on_conflict_do_update(
        index_elements=["consumer"],
        set_={
            "last_js_seq": sa.func.greatest(tracking_table.c.last_js_seq, stmt.excluded.last_js_seq),
            "last_position": sa.func.greatest(tracking_table.c.last_position, stmt.excluded.last_position),
            "updated_at": sa.func.now(),
        },
    )
    await conn.execute(stmt)


async def record_dead_letter(conn: AsyncConnection, js_seq: int, subject: str, reason: str, raw: bytes) -> None:
    stmt = insert(dead_letters_table).values(js_seq=js_seq, subject=subject, reason=reason, raw=raw)
    await conn.execute(stmt.on_conflict_do_nothing(index_elements=["js_seq"]))


# The whole envelope as JSON text, built by Postgres: pydantic then parses and validates it in one
# pass in its core, without Python dicts, UUID or datetime objects in between (replay reads every
# event; ``bench/bus.py`` measures ``replay_eps``).
_ENVELOPE_JSON = sa.cast(
    sa.func.json_build_object(
        "id", events_table.c.event_id, "type", events_table.c.type,
        "schema_version", events_table.c.schema_version, "job_id", events_table.c.job_id,
        "subject", events_table.c.subject, "occurred_at", events_table.c.occurred_at,
        "producer", events_table.c.producer, "causation_id", events_table.c.causation_id,
        "correlation_id", events_table.c.correlation_id, "payload", events_table.c.payload,
        "signed_by", events_table.c.signed_by, "signature", events_table.c.signature,
    ),
    sa.Text,
).label("envelope")


_DATETIME: TypeAdapter[datetime] = TypeAdapter(datetime)


class EventStore:
    """Reads over the event log (audit queries, replay, cold starts)."""

    parsed_kept = 5_000
    """Events the listing reads keep parsed (``_recorded``), the least recently read dropped first."""

    stale_connections_dropped = 32
    """How many closed pooled connections one listing read drops before it gives up (after a server restart
    every idle connection of the pool is closed; each is found so, dropped and replaced in turn)."""

    def __init__(self, engine: AsyncEngine, registry: EventRegistry = REGISTRY, *,
                 fetch_engine: AsyncEngine | None = None) -> None:
        """``fetch_engine``: the engine of the listing reads (``read_newest``, ``read_correlated``, ``get_many``,
        ``count_of``, ``newest_position``), when not ``engine``: one without a test on checkout
        (``create_engine(pre_ping=False)``) saves three round trips a query, as those reads drop a connection the
        server closed and take another. Every other read goes through ``engine``."""
        self.engine = engine
        self.fetch_engine = fetch_engine or engine
        self.registry = registry
        self._statements: dict[tuple[Any, ...], tuple[str, tuple[str, ...], dict[str, Any]]] = {}
        self._parsed: OrderedDict[str, Event] = OrderedDict()
        """Parsed events by their envelope as stored: the on-call page and the timelines read the same incidents'
        events again and again, and parsing one costs about 15 us (300 to a page of incidents). Keyed by the text,
        not the position, so a log reset under a running reader cannot hand it another event's parse."""

    async def read(
        self,
        *,
        job_id: str | None = None,
        after_position: int = 0,
        types: Sequence[str] | None = None,
        subject: str | None = None,
        correlation_id: uuid.UUID | None = None,
        limit: int | None = None,
        chunk: int = 20000,
    ) -> AsyncIterator[RecordedEvent]:
        """Events in position order, upcast to their current version, streamed in chunks.

        The next chunk is fetched while the current one is decoded and consumed, so Postgres and the
        caller work at the same time (on two cores, nearly twice the replay rate).
        """
        remaining = limit

        def chunk_size() -> int:
            return chunk if remaining is None else min(chunk, remaining)

        parse = self.registry.parse_envelope_json
        size = chunk_size()
        fetching: asyncio.Task[list[Any]] | None = asyncio.ensure_future(
            self._fetch_chunk(after_position, size, job_id, types, subject, correlation_id)
        )
        try:
            while fetching is not None:  # None: the last chunk was fetched
                rows = await fetching
                full = len(rows) == size
                if remaining is not None:
                    remaining -= len(rows)
                if full and (remaining is None or remaining > 0):
                    size = chunk_size()
                    fetching = asyncio.ensure_future(
                        self._fetch_chunk(rows[-1][0], size, job_id, types, subject, correlation_id)
                    )
                else:
                    fetching = None
                for index, row in enumerate(rows):
                    if index % 256 == 0:
                        # Let the event loop read the next chunk off the socket meanwhile: otherwise
                        # Postgres stalls on a full socket buffer until this chunk is consumed.
                        await asyncio.sleep(0)
                    yield RecordedEvent(row[0], row[1], row[2], parse(row[3], row[4], row[5]))
        finally:
            if fetching is not None and not fetching.done():
                fetching.cancel()

    async def _fetch_chunk(
        self,
        after_position: int,
        size: int,
        job_id: str | None,
        types: Sequence[str] | None,
        subject: str | None,
        correlation_id: uuid.UUID | None,
    ) -> list[Any]:
        query = sa.select(
            events_table.c.position, events_table.c.js_seq, events_table.c.recorded_at,
            events_table.c.type, events_table.c.schema_version, _ENVELOPE_JSON,
        ).where(events_table.c.position > after_position)
        if job_id is not None:
            query = query.where(events_table.c.job_id == job_id)
        if types:
            query = query.where(events_table.c.type.in_(list(types)))
        if subject is not None:
            query = query.where(events_table.c.subject == subject)
        if correlation_id is not None:
            query = query.where(events_table.c.correlation_id == correlation_id)
        query = query.order_by(events_table.c.position).limit(size)
        # Built by SQLAlchemy, fetched with asyncpg: SQLAlchemy's per-row result processing cost more
        # than the fetch itself.
        async with self.engine.connect() as conn:
            compiled = query.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None
            params = [compiled.params[name] for name in compiled.positiontup or ()]
            return list(await raw.fetch(str(compiled), *params))

    async def read_newest(self, event_type: str, *, job_id: str | None = None, before_position: int | None = None,
                          limit: int = 100) -> list[RecordedEvent]:
        """The newest ``limit`` events of ``event_type`` (of ``job_id``), before ``before_position`` if given: newest
        first. A page of a listing: it walks the (job, type, position) index backwards and stops at ``limit`` (one
        type: with several, PostgreSQL reads every row of them and sorts)."""
        c = events_table.c

        def build() -> Any:
            query = sa.select(c.position, c.js_seq, c.recorded_at, c.type, c.schema_version, _ENVELOPE_JSON).where(
                c.type == sa.bindparam("type"))
            if job_id is not None:
                query = query.where(c.job_id == sa.bindparam("job_id"))
            if before_position is not None:
                query = query.where(c.position < sa.bindparam("before", type_=sa.BigInteger))
            return query.order_by(c.position.desc()).limit(sa.bindparam("limit", type_=sa.Integer))

        return await self._recorded(("newest", job_id is None, before_position is None), build,
                                    {"type": event_type, "job_id": job_id, "before": before_position, "limit": limit})

    async def read_correlated(self, correlation_ids: Sequence[uuid.UUID], *, types: Sequence[str] | None = None,
                              by_payload_incident_id: Sequence[str] = ()) -> list[RecordedEvent]:
        """The events whose correlation id is one of ``correlation_ids`` (of ``types``), in log order, through the
        correlation index. ``by_payload_incident_id``: types also taken when their payload's ``incident_id`` is one
        of the ids and they carry no correlation id (indexed for ``IncidentResolved``: migration 0005)."""
        if not correlation_ids:
            return []
        c = events_table.c

        def build() -> Any:
            # One branch per index (a UNION, not an OR: with an OR PostgreSQL scanned the type index instead).
            columns = (c.position, c.js_seq, c.recorded_at, c.type, c.schema_version, _ENVELOPE_JSON)
            correlated = sa.select(*columns).where(c.correlation_id == sa.any_(sa.bindparam("ids", type_=ARRAY(UUID))))
            if types:
                correlated = correlated.where(c.type == sa.any_(sa.bindparam("types", type_=ARRAY(sa.Text))))
            branches = [correlated]
            for event_type in by_payload_incident_id:
                # Spelled as migration 0005's partial index is (the type a literal, so even a generic plan may use
                # it). "No correlation id" as an expression no index has: as ``IS NULL`` PostgreSQL scanned every
                # uncorrelated event through the correlation index instead.
                branches.append(sa.select(*columns).where(
                    c.type == sa.literal_column(f"'{event_type}'"),
                    sa.literal_column("payload ->> 'incident_id'") == sa.any_(
                        sa.bindparam("id_texts", type_=ARRAY(sa.Text))),
                    sa.func.coalesce(sa.cast(c.correlation_id, sa.Text), "") == ""))
            query = sa.union_all(*branches) if len(branches) > 1 else branches[0]
            return query.order_by(sa.literal_column("position"))

        for event_type in by_payload_incident_id:
            if event_type not in self.registry.names():  # it becomes SQL text
                raise ValueError(f"{event_type!r} is not an event type")
        params = {"ids": list(correlation_ids), "id_texts": [str(i) for i in correlation_ids], "types": list(types or ())}
        rows = await self._recorded(("correlated", tuple(by_payload_incident_id), bool(types)), build, params)
        wanted, seen, out = set(correlation_ids), set(), []
        for row in rows:  # a payload match counts only without a correlation id; both branches may give a row
            if row.position not in seen and (row.event.correlation_id is None or row.event.correlation_id in wanted):
                seen.add(row.position)
                out.append(row)
        return out

    async def count_of(self, *, types: Sequence[str], job_id: str | None = None) -> int:
        """How many events of ``types`` (of ``job_id``) the log holds (an index-only count)."""
        c = events_table.c

        def build() -> Any:
            query = sa.select(sa.func.count()).select_from(events_table).where(
                c.type == sa.any_(sa.bindparam("types", type_=ARRAY(sa.Text))))
            return query if job_id is None else query.where(c.job_id == sa.bindparam("job_id"))

        rows = await self._fetch(("count", job_id is None), build, {"types": list(types), "job_id": job_id})
        return int(rows[0][0])

    async def newest_position(self, *, types: Sequence[str], job_id: str | None = None) -> int:
        """The position of the newest event of ``types`` (of ``job_id``), 0 when there is none: one backward step
        through the index per type. A reader's cheap test of whether anything it summarized has changed."""

        def build() -> Any:
            job = "" if job_id is None else "AND events.job_id = :job_id "
            return sa.text("SELECT coalesce(max(newest.position), 0) FROM unnest(CAST(:types AS text[])) AS wanted(type) "
                           "CROSS JOIN LATERAL (SELECT events.position FROM events WHERE events.type = wanted.type "
                           f"{job}ORDER BY events.position DESC LIMIT 1) AS newest")

        rows = await self._fetch(("newest_position", job_id is None), build, {"types": list(types), "job_id": job_id})
        return int(rows[0][0])

    async def get_many(self, event_ids: Sequence[uuid.UUID]) -> list[RecordedEvent]:
        """The events with these ids that the log holds, in log order (unknown ids are left out)."""
        if not event_ids:
            return []
        c = events_table.c

        def build() -> Any:
            return sa.select(c.position, c.js_seq, c.recorded_at, c.type, c.schema_version, _ENVELOPE_JSON).where(
                c.event_id == sa.any_(sa.bindparam("ids", type_=ARRAY(UUID)))).order_by(c.position)

        return await self._recorded(("by_id",), build, {"ids": list(event_ids)})

    async def _fetch(self, shape: tuple[Any, ...], build: Callable[[], Any], params: Mapping[str, Any]) -> list[Any]:
        """The rows of the query ``build()`` makes (one per ``shape``: compiled once, its SQL then reused, so the
        driver's prepared statement is too) with ``params``. A listing's page then costs its rows, not SQLAlchemy
        compiling a statement for every request (about 3 ms each here)."""
        dropped = 0
        while True:
            async with self.fetch_engine.connect() as conn:
                statement = self._statements.get(shape)
                if statement is None:
                    compiled = build().compile(dialect=conn.dialect)
                    # The statement's own literals (the envelope's key names) are bound parameters too: kept here.
                    statement = self._statements[shape] = (str(compiled), tuple(compiled.positiontup or ()),
                                                           dict(compiled.params))
                sql, order, literals = statement
                raw = (await conn.get_raw_connection()).driver_connection
                assert raw is not None
                try:
                    if not raw.is_closed():
                        return list(await raw.fetch(sql, *(params[name] if name in params else literals[name]
                                                           for name in order)))
                except Exception:
                    if not raw.is_closed():
                        raise  # the store's own error: the connection is fine
                # The server ended this pooled connection (restarted, or a timeout killed it) while it idled: asyncpg
                # found it closed, before the query or raising one of several errors on it. Nothing was read (these
                # are SELECTs), so the connection is dropped from the pool and the read taken again on another.
                await conn.invalidate()
                dropped += 1
                if dropped > self.stale_connections_dropped:
                    raise ConnectionError(f"{dropped} connections to the event store in a row were closed by the "
                                          "server; is PostgreSQL up?")

    async def _recorded(self, shape: tuple[Any, ...], build: Callable[[], Any],
                        params: Mapping[str, Any]) -> list[RecordedEvent]:
        """``_fetch`` of a query selecting (position, js_seq, recorded_at, type, schema_version, envelope): the rows
        as recorded events."""
        parse, kept, out = self.registry.parse_envelope_json, self._parsed, []
        for row in await self._fetch(shape, build, params):
            text = row[5]
            event = kept.get(text)
            if event is None:
                event = kept[text] = parse(row[3], row[4], text)  # the text holds the type and version too
                if len(kept) > self.parsed_kept:
                    kept.popitem(last=False)
            else:
                kept.move_to_end(text)
            out.append(RecordedEvent(row[0], row[1], row[2], event))
        return out

    async def get(self, event_id: uuid.UUID) -> RecordedEvent | None:
        found = await self.get_many([event_id])
        return found[0] if found else None

    async def envelope_as_stored(self, event_id: uuid.UUID) -> dict[str, Any] | None:
        """Event ``event_id``'s envelope as the store keeps it (at the schema version it was sent at, not
        upcast): what its signature covers (``keel.events.signing``). None when there is no such event."""
        query = sa.select(_ENVELOPE_JSON).where(events_table.c.event_id == event_id)
        async with self.engine.connect() as conn:
            text = (await conn.execute(query)).scalar_one_or_none()
        if text is None:
            return None
        envelope: dict[str, Any] = json.loads(text)
        # Postgres writes timestamps its own way; the envelope as sent held pydantic's (the same instant).
        envelope["occurred_at"] = _DATETIME.dump_python(_DATETIME.validate_python(envelope["occurred_at"]), mode="json")
        return envelope

    async def count(self, job_id: str | None = None) -> int:
        query = sa.select(sa.func.count()).select_from(events_table)
        if job_id is not None:
            query = query.where(events_table.c.job_id == job_id)
        async with self.engine.connect() as conn:
            return int((await conn.execute(query)).scalar_one())

    async def head_position(self) -> int:
        async with self.engine.connect() as conn:
            value = (await conn.execute(sa.select(sa.func.max(events_table.c.position)))).scalar_one()
        return int(value or 0)

    async def tracking(self, consumer: str) -> tuple[int, int] | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(sa.select(tracking_table).where(tracking_table.c.consumer == consumer))
            ).first()
        return None if row is None else (row.last_js_seq, row.last_position)

    async def save_snapshot(self, snapshot: Snapshot, *, keep: int = 3) -> None:
        """Store ``snapshot`` (idempotent) and drop all but the newest ``keep`` of its decider and scope."""
        row = {"decider": snapshot.decider, "scope": snapshot.scope, "position": snapshot.position,
               "js_seq": snapshot.js_seq, "event_id": snapshot.event_id, "fingerprint": snapshot.fingerprint,
               "digest": snapshot.digest, "events_folded": snapshot.events_folded,
               "state": zlib.compress(snapshot.state, 1)}
        t = snapshots_table.c
        async with self.engine.begin() as conn:
            await conn.execute(insert(snapshots_table).values(**row).on_conflict_do_nothing(
                constraint="snapshots_unique"))
            newest = (sa.select(t.id).where(t.decider == snapshot.decider, t.scope == snapshot.scope)
                      .order_by(t.position.desc(), t.id.desc()).limit(keep))
            await conn.execute(sa.delete(snapshots_table).where(
                t.decider == snapshot.decider, t.scope == snapshot.scope, t.id.not_in(newest)))

    async def snapshots(self, decider: str, scope: str = "*", *, fingerprint: str | None = None,
                        newest_only: bool = False) -> list[Snapshot]:
        """The stored snapshots of ``decider`` for ``scope``, newest first (of ``fingerprint`` only, if given)."""
        t = snapshots_table.c
        query = sa.select(snapshots_table).where(t.decider == decider, t.scope == scope)
        if fingerprint is not None:
            query = query.where(t.fingerprint == fingerprint)
        query = query.order_by(t.position.desc(), t.id.desc())
        if newest_only:
            query = query.limit(1)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [Snapshot(decider=r.decider, scope=r.scope, position=r.position, js_seq=r.js_seq, event_id=r.event_id,
                         fingerprint=r.fingerprint, digest=r.digest, events_folded=r.events_folded,
                         state=zlib.decompress(r.state), created_at=r.created_at) for r in rows]

    async def dead_letters(self) -> list[dict[str, Any]]:
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(dead_letters_table).order_by(dead_letters_table.c.id))).all()
        return [dict(row._mapping) for row in rows]


__all__ = [
    "EventStore",
    "InvalidEvent",
    "DatabaseNotUsable",
    "MissingRoles",
    "check_database",
    "SchemaNotCurrent",
    "check_schema_current",
    "engine_options",
    "grant_privileges",
    "head_revision",
    "RecordedEvent",
    "Snapshot",
    "append_events",
    "create_engine",
    "event_row",
    "record_dead_letter",
    "run_migrations",
    "save_tracking",
]
