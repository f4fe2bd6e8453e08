"""libpq's TLS parameters become asyncpg's ``ssl=`` (``keel.infra.dburl``), credentials and redaction, and the role
grants as data (``keel.infra.dbroles``)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ssl
import subprocess
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from keel.infra import dbroles
from keel.infra.dburl import redact, split_tls, with_credentials
from keel.infra.store import engine_options


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-signed CA certificate (openssl), so the verifying modes have a real file to load."""
    folder = tmp_path_factory.mktemp("ca")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=keel-test-ca",
                    "-keyout", str(folder / "ca.key"), "-out", str(folder / "ca.pem")], check=True, capture_output=True)
    return folder / "ca.pem"


def test_the_untranslated_url_is_what_used_to_raise_a_type_error() -> None:
    # SQLAlchemy passes the query string on as keywords: asyncpg.connect(sslmode=...) is a TypeError.
    engine = create_async_engine("postgresql+asyncpg://u:p@db:5432/keel?sslmode=require")
    _, kwargs = engine.dialect.create_connect_args(engine.url)
    assert kwargs.get("sslmode") == "require"


def test_sslmode_require_is_translated_into_an_encrypting_context() -> None:
    url, connect_args = engine_options("postgresql://u:p@db:5432/keel?sslmode=require&application_name=keel")
    assert url == "postgresql+asyncpg://u:p@db:5432/keel?application_name=keel"
    context = connect_args["ssl"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_NONE and not context.check_hostname
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    engine = create_async_engine(url, connect_args=connect_args)
    _, kwargs = engine.dialect.create_connect_args(engine.url)
    assert "sslmode" not in kwargs  # nothing left for asyncpg to choke on


def test_verify_full_builds_a_context_that_verifies_chain_and_host(ca_file: Path) -> None:
    _, tls = split_tls(f"postgresql://u@db.example.com/keel?sslmode=verify-full&sslrootcert={ca_file}")
    assert isinstance(tls, ssl.SSLContext)
    assert tls.verify_mode == ssl.CERT_REQUIRED and tls.check_hostname
    assert [c["subject"] for c in tls.get_ca_certs()] == [((("commonName", "keel-test-ca"),),)]


def test_verify_ca_verifies_the_chain_but_not_the_name_and_require_with_a_root_is_verify_ca(ca_file: Path) -> None:
    for mode in ("verify-ca", "require"):
        _, tls = split_tls(f"postgresql://u@db/keel?sslmode={mode}&sslrootcert={ca_file}")
        assert isinstance(tls, ssl.SSLContext)
        assert tls.verify_mode == ssl.CERT_REQUIRED and not tls.check_hostname


def test_sslrootcert_system_uses_the_system_trust_store() -> None:
    _, tls = split_tls("postgresql://u@db/keel?sslmode=verify-full&sslrootcert=system")
    assert isinstance(tls, ssl.SSLContext) and tls.verify_mode == ssl.CERT_REQUIRED and tls.check_hostname


def test_the_modes_that_need_no_context() -> None:
    assert split_tls("postgresql://u@db/keel?sslmode=disable") == ("postgresql://u@db/keel", False)
    assert split_tls("postgresql://u@db/keel?sslmode=prefer")[1] == "prefer"
    assert split_tls("postgresql://u@db/keel?sslmode=allow")[1] == "allow"
    assert split_tls("postgresql://u@db/keel") == ("postgresql://u@db/keel", None)


def test_bad_tls_parameters_are_refused_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.postgresql/root.crt
    with pytest.raises(ValueError, match="sslmode='verify_full' is not one of disable, allow, prefer"):
        split_tls("postgresql://u@db/keel?sslmode=verify_full")
    with pytest.raises(ValueError, match=r"no sslrootcert, and .*root.crt does not exist: add sslrootcert="):
        split_tls("postgresql://u@db/keel?sslmode=verify-full")
    with pytest.raises(ValueError, match="sslrootcert=/nowhere/ca.pem does not exist"):
        split_tls("postgresql://u@db/keel?sslmode=verify-ca&sslrootcert=/nowhere/ca.pem")
    with pytest.raises(ValueError, match="sslcompression are not supported"):
        split_tls("postgresql://u@db/keel?sslcompression=1")
    with pytest.raises(ValueError, match="sslkey is given without sslcert"):
        split_tls("postgresql://u@db/keel?sslmode=require&sslkey=/k.pem")
    with pytest.raises(ValueError, match="not a PostgreSQL URL"):
        split_tls("mysql://u:secret@db/keel")


def test_a_refused_url_never_shows_its_password() -> None:
    with pytest.raises(ValueError) as caught:
        split_tls("mysql://u:hunter2@db/keel")
    assert "hunter2" not in str(caught.value)


def test_credentials_in_and_out() -> None:
    assert with_credentials("postgresql://127.0.0.1:5433/postgres", "keel_recorder", "pw") == \
        "postgresql://keel_recorder:pw@127.0.0.1:5433/postgres"
    assert with_credentials("postgresql://old:x@h/db?sslmode=require", "new", "p/w@") == \
        "postgresql://new:p%2Fw%40@h/db?sslmode=require"
    assert redact("postgresql://keel:s3cret@h:1/db?sslmode=require") == "postgresql://keel:***@h:1/db?sslmode=require"
    assert redact("postgresql://h/db") == "postgresql://h/db"


def test_scram_verifier_follows_rfc_7677() -> None:
    salt = b"0123456789abcdef"
    verifier = dbroles.scram_verifier("pencil", salt, iterations=4096)
    method, rest = verifier.split("$", 1)
    params, keys = rest.split("$")
    iterations, salt_b64 = params.split(":")
    stored_b64, server_b64 = keys.split(":")
    salted = hashlib.pbkdf2_hmac("sha256", b"pencil", salt, 4096)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    assert (method, iterations, base64.b64decode(salt_b64)) == ("SCRAM-SHA-256", "4096", salt)
    assert base64.b64decode(stored_b64) == hashlib.sha256(client_key).digest()
    assert base64.b64decode(server_b64) == hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    with pytest.raises(ValueError):
        dbroles.scram_verifier("pässword", salt)


def test_grants_give_each_role_exactly_its_privileges() -> None:
    statements = dbroles.grant_statements("public")
    recorder = [s for s in statements if s.startswith("GRANT") and s.endswith('"keel_recorder"')]
    assert 'GRANT SELECT, INSERT ON TABLE "public"."events" TO "keel_recorder"' in recorder
    assert 'GRANT EXECUTE ON FUNCTION "public".lock_events_for_append() TO "keel_recorder"' in recorder
    assert not any("snapshots" in s for s in recorder)
    everything = " ".join(statements)
    for forbidden in ("UPDATE ON TABLE \"public\".\"events\"", "DELETE ON TABLE \"public\".\"events\"", "TRUNCATE",
                      "keel_migrate", "CREATE ON"):
        assert forbidden not in everything
    decider = [s for s in statements if s.startswith("GRANT") and s.endswith('"keel_decider"')]
    assert 'GRANT SELECT ON TABLE "public"."events" TO "keel_decider"' in decider
    assert 'GRANT SELECT, INSERT, DELETE ON TABLE "public"."snapshots" TO "keel_decider"' in decider
    # A schema at an older revision: only what exists is granted.
    older = dbroles.grant_statements("public", frozenset({"events", "alembic_version"}))
    assert not any("snapshots" in s or "lock_events_for_append" in s for s in older)
    with pytest.raises(ValueError, match="not a lower-case SQL identifier"):
        dbroles.grant_statements('x"; DROP TABLE events; --')


def test_every_service_that_reads_the_log_has_a_role() -> None:
    assert dbroles.service_role("recorder") == dbroles.RECORDER
    assert {dbroles.service_role(s) for s in ("controller", "checkpoint-broker", "analyzer", "hot-update")} == \
        {dbroles.DECIDER}
    with pytest.raises(ValueError, match="service 'actuator' has no database role"):
        dbroles.service_role("actuator")
    with pytest.raises(ValueError, match="unknown database role 'root'"):
        dbroles.pg_role("root")
