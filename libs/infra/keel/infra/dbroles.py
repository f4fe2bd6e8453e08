"""PostgreSQL roles of the event store: who may do what, as data, and the SQL that makes it so.

Four roles, one per kind of client (``ROLES``):

- ``migrate`` (PostgreSQL role ``keel_migrate``): owns the schema's tables; the only role that runs DDL.
  Used by ``keel migrate``, ``keel-migrate`` and ``keel up``'s migrate step, never by a service.
- ``recorder`` (``keel_recorder``): appends events (INSERT, never UPDATE/DELETE/TRUNCATE), records dead
  letters, maintains its read model (``node_status``) and its ``tracking`` row. It takes the append lock
  through ``lock_events_for_append()``, a SECURITY DEFINER function, because ``LOCK TABLE`` in that mode
  would otherwise need UPDATE, DELETE or TRUNCATE on ``events``.
- ``decider`` (``keel_decider``): the controller, checkpoint broker, analyzer and hot-update service: read
  the log; write (and prune) their own ``snapshots``.
- ``auditor`` (``keel_auditor``): read-only on every table and the audit views: ``keel incidents``,
  ``keel replay``, ``keel events``, ``keel audit`` and the other reporting commands.

Every role may read ``alembic_version``, so a service can check at start that the schema is at the latest
revision (it never migrates). ``grant_statements(schema)`` revokes what a role has in the schema and grants
exactly ``TABLE_PRIVILEGES``: re-running it (every migration does) repairs drift.

Pure: no I/O here (the SCRAM verifier takes its salt from the caller).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets

MIGRATE, RECORDER, DECIDER, AUDITOR = "migrate", "recorder", "decider", "auditor"
ROLES: tuple[str, ...] = (MIGRATE, RECORDER, DECIDER, AUDITOR)
"""The logical roles; ``pg_role(role)`` is the PostgreSQL role name."""

SERVICE_ROLES: dict[str, str] = {
    "recorder": RECORDER,
    "controller": DECIDER,
    "checkpoint-broker": DECIDER,
    "analyzer": DECIDER,
    "hot-update": DECIDER,
}
"""Which role each service that reads the log connects as (the actuator reads none)."""

EVENT_STORE_TABLES: tuple[str, ...] = ("events", "tracking", "dead_letters", "node_status", "snapshots",
                                       "alembic_version")
AUDIT_VIEWS: tuple[str, ...] = ("audit_decisions", "audit_incidents", "audit_evictions", "audit_rollbacks",
                                "audit_node_history", "audit_human_actions")
"""Views over ``events`` (migration 0005) for audits: read by the ``auditor`` only."""

TABLE_PRIVILEGES: dict[str, dict[str, tuple[str, ...]]] = {
    RECORDER: {
        "events": ("SELECT", "INSERT"),
        "tracking": ("SELECT", "INSERT", "UPDATE"),
        "dead_letters": ("SELECT", "INSERT"),
        "node_status": ("SELECT", "INSERT", "UPDATE"),
        "alembic_version": ("SELECT",),
    },
    DECIDER: {
        "events": ("SELECT",),
        "snapshots": ("SELECT", "INSERT", "DELETE"),
        "alembic_version": ("SELECT",),
    },
    AUDITOR: {table: ("SELECT",) for table in (*EVENT_STORE_TABLES, *AUDIT_VIEWS)},
}
"""Per role (but ``migrate``, which owns the tables): table -> privileges in the event store's schema."""

LOCK_FUNCTION = "lock_events_for_append"
"""SECURITY DEFINER function (migration 0003) taking ``events``' commit-order lock for the recorder."""

FUNCTION_PRIVILEGES: dict[str, tuple[str, ...]] = {RECORDER: (f"{LOCK_FUNCTION}()",)}
"""Per role: functions of the schema it may EXECUTE (EXECUTE is revoked from PUBLIC)."""

_SCRAM_ITERATIONS = 4096
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]*$")


def pg_role(role: str) -> str:
    """The PostgreSQL role name of logical ``role`` (``keel_<role>``); ``ValueError`` for an unknown one."""
    if role not in ROLES:
        raise ValueError(f"unknown database role {role!r}; the roles are {', '.join(ROLES)}")
    return f"keel_{role}"


def service_role(service: str) -> str:
    """The role ``service`` connects as; ``ValueError`` for a service that reads no log."""
    try:
        return SERVICE_ROLES[service]
    except KeyError:
        raise ValueError(f"service {service!r} has no database role (those that have: "
                         f"{', '.join(sorted(SERVICE_ROLES))})") from None


def generate_password() -> str:
    """A fresh random password: 256 bits, URL-safe characters only (it goes into URLs unescaped)."""
    return secrets.token_urlsafe(32)


def scram_verifier(password: str, salt: bytes, iterations: int = _SCRAM_ITERATIONS) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (what ``ALTER ROLE ... PASSWORD``
    accepts instead of the plain text, so the password itself never reaches the server or its log).
    ``password`` must be ASCII (SASLprep is then the identity), as ``generate_password`` makes it."""
    if not password.isascii():
        raise ValueError("scram_verifier needs an ASCII password")
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def quote_ident(name: str) -> str:
    """``name`` as a quoted SQL identifier; only lower-case identifiers are accepted (schemas, roles)."""
    if not _IDENTIFIER.match(name):
        raise ValueError(f"not a lower-case SQL identifier: {name!r}")
    return f'"{name}"'


def grant_statements(schema: str, present: frozenset[str] | None = None) -> list[str]:
    """The statements that give each non-owner role exactly its privileges in ``schema`` (run by the
    tables' owner or a superuser, in one transaction, after the migrations). ``present``: the tables and
    functions (``name()``) the schema has (a schema migrated to an older revision lacks some); None: all."""
    def has(name: str) -> bool:
        return present is None or name in present

    s = quote_ident(schema)
    lock = f"{LOCK_FUNCTION}()"
    out = [f"REVOKE ALL ON FUNCTION {s}.{lock} FROM PUBLIC"] if has(lock) else []
    for role in (RECORDER, DECIDER, AUDITOR):
        name = quote_ident(pg_role(role))
        out += [f"REVOKE ALL ON ALL TABLES IN SCHEMA {s} FROM {name}",
                f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {s} FROM {name}",
                f"REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {s} FROM {name}",
                f"GRANT USAGE ON SCHEMA {s} TO {name}"]
        for table, privileges in TABLE_PRIVILEGES[role].items():
            if has(table):
                out.append(f"GRANT {', '.join(privileges)} ON TABLE {s}.{quote_ident(table)} TO {name}")
        for function in FUNCTION_PRIVILEGES.get(role, ()):
            if has(function):
                out.append(f"GRANT EXECUTE ON FUNCTION {s}.{function} TO {name}")
    return out


def login_role_script(verifiers: dict[str, str], database: str) -> str:
    """SQL (for psql, run by a superuser) that creates or updates the login role of every role in ``verifiers``
    (role -> SCRAM verifier) with no attributes beyond LOGIN, and lets ``migrate`` create schemas in
    ``database`` and tables in ``public``."""
    lines = []
    for role, verifier in verifiers.items():
        name = pg_role(role)
        lines.append(f"SELECT format('CREATE ROLE %I', '{name}') "
                     f"WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{name}')\\gexec")
        lines.append(f"ALTER ROLE {quote_ident(name)} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE "
                     f"NOREPLICATION NOBYPASSRLS PASSWORD '{verifier}';")
    owner = quote_ident(pg_role(MIGRATE))
    lines += [f"GRANT CONNECT, CREATE, TEMPORARY ON DATABASE {quote_ident(database)} TO {owner};",
              f"GRANT USAGE, CREATE ON SCHEMA public TO {owner};"]
    return "\n".join(lines) + "\n"


def adopt_script(superuser: str) -> str:
    """SQL (run by a superuser) that hands ``migrate`` every table, sequence and function ``superuser`` owns in a
    Keel schema (one with an ``alembic_version`` table), and such schemas themselves: a cluster migrated before
    these roles existed, whose next migration ``keel_migrate`` must be able to run. A no-op once done. It takes
    the tables' exclusive locks: run it before the services start (``keel up`` does)."""
    owner = quote_ident(pg_role(MIGRATE))
    keel_schema = "EXISTS (SELECT FROM pg_class v WHERE v.relnamespace = n.oid AND v.relname = 'alembic_version')"
    return f"""DO $adopt$
DECLARE obj record;
BEGIN
  FOR obj IN
    SELECT c.oid::regclass AS rel, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE c.relowner = '{superuser}'::regrole AND c.relkind IN ('r', 'p', 'v', 'm', 'S') AND {keel_schema}
      AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                      AND d.deptype IN ('a', 'i'))
  LOOP
    EXECUTE format('ALTER %s %s OWNER TO {owner}',
                   CASE obj.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW'
                                    WHEN 'm' THEN 'MATERIALIZED VIEW' ELSE 'TABLE' END, obj.rel);
  END LOOP;
  FOR obj IN
    SELECT p.oid::regprocedure AS fn FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE p.proowner = '{superuser}'::regrole AND {keel_schema}
  LOOP
    EXECUTE format('ALTER FUNCTION %s OWNER TO {owner}', obj.fn);
  END LOOP;
  FOR obj IN
    SELECT n.nspname FROM pg_namespace n WHERE n.nspowner = '{superuser}'::regrole AND {keel_schema}
  LOOP
    EXECUTE format('ALTER SCHEMA %I OWNER TO {owner}', obj.nspname);
  END LOOP;
END $adopt$;
"""


__all__ = [
    "AUDITOR", "AUDIT_VIEWS", "DECIDER", "EVENT_STORE_TABLES", "FUNCTION_PRIVILEGES", "LOCK_FUNCTION", "MIGRATE", "RECORDER", "ROLES",
    "SERVICE_ROLES", "TABLE_PRIVILEGES", "adopt_script", "generate_password", "grant_statements", "login_role_script",
    "pg_role",
    "quote_ident", "scram_verifier", "service_role",
]
