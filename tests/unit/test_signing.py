"""Signed events: the canonical bytes, signing and verification with reasons, the keys and keyring on disk."""

from __future__ import annotations

import json
import os
import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from keel.events.envelope import REGISTRY, Event, decode_wire
from keel.events.signing import (
    REQUIRED_SIGNER,
    KeyringError,
    SigningKey,
    parse_keyring,
    sign_event,
    signing_bytes,
    verify_event,
)
from keel.events.types import ApprovalGiven, NodeEvictionDecided
from keel.infra.secrets import InsecurePathError
from keel.infra.signing import (
    NO_SIGNING,
    KeyringFile,
    Signing,
    ensure_signing_identity,
    load_signing_key,
)
from tests.factories import health_event

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
T0 = datetime(2026, 12, 1, 7, 0, tzinfo=UTC)
MAX = 256 * 1024


def key(name: str, role: str) -> SigningKey:
    return SigningKey(name, role, Ed25519PrivateKey.generate())


CONTROLLER = key("controller", "controller")
OPERATOR = key("alice", "operator")
AGENT = key("agent-n01", "agent")
RING = {k.name: k.public for k in (CONTROLLER, OPERATOR, AGENT)}


def eviction(**changes: object) -> Event:
    payload = NodeEvictionDecided(node_id="n01", rung=1, reason="fatal", expires_at=T0, **changes)  # type: ignore[arg-type]
    return Event.create(payload, job_id="j1", subject="node/n01", producer="controller", occurred_at=T0)


def wire(event: Event) -> bytes:
    return event.to_json()


def test_an_unsigned_event_keeps_its_json_as_before() -> None:
    event = eviction()
    assert b"signature" not in event.to_json() and "signed_by" not in event.to_wire()


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*/v*.json")), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_golden_event_signed_then_sent_verifies_at_the_consumer(path: Path) -> None:
    """What is signed survives the wire: the consumer's parse dumps to the same canonical bytes."""
    envelope = json.loads(path.read_text())["envelope"]
    _, event = decode_wire(json.dumps(envelope).encode(), max_bytes=MAX)
    roles = REQUIRED_SIGNER.get(event.type, frozenset({"controller"}))
    signer = SigningKey("signer", sorted(roles - {"chatops"})[0], Ed25519PrivateKey.generate())  # chatops: its own test
    if event.type in ("ApprovalGiven", "NodeCordoned", "CodeVersionRegistered", "CodeVersionRejected"):
        event = event.model_copy(update={"payload": event.payload.model_copy(update={"by": "signer"})})
    as_sent, received = decode_wire(sign_event(event, signer).to_json(), max_bytes=MAX)
    verdict = verify_event(received, {"signer": signer.public}, as_sent=as_sent)
    assert verdict.ok, verdict.reason


def test_an_old_version_is_checked_as_sent() -> None:
    """A producer on an older schema version signed that version's envelope: the consumer checks the envelope
    as sent, not its upcast."""
    envelope = json.loads((GOLDEN / "NodeHealthChanged" / "v1.json").read_text())["envelope"]
    envelope["signed_by"] = "controller"
    envelope["signature"] = __import__("base64").b64encode(CONTROLLER.private_key.sign(signing_bytes(envelope))).decode()
    as_sent, event = decode_wire(json.dumps(envelope).encode(), max_bytes=MAX)
    assert as_sent is not None and event.schema_version == REGISTRY.current_version("NodeHealthChanged")
    assert verify_event(event, RING, as_sent=as_sent).ok
    assert not verify_event(event, RING).ok  # the upcast is not what was signed


def test_signing_is_deterministic_so_a_decision_published_again_is_the_same_message() -> None:
    event = eviction()
    assert sign_event(event, CONTROLLER).to_json() == sign_event(event, CONTROLLER).to_json()


@pytest.mark.parametrize(
    ("event", "ring", "reason"),
    [
        (eviction(), RING, "unsigned: NodeEvictionDecided"),
        (sign_event(eviction(), key("controller", "controller")), RING, "bad signature"),
        (sign_event(eviction(), key("mallory", "controller")), RING, "'mallory', which is not in the keyring"),
        (sign_event(eviction(), AGENT), RING, "role agent), but NodeEvictionDecided may only be signed by a controller"),
        (sign_event(eviction(), OPERATOR), RING, "may only be signed by a controller key"),
    ],
    ids=["unsigned", "forged-key-same-name", "unknown-signer", "wrong-role-agent", "wrong-role-operator"],
)
def test_a_command_that_fails_is_refused_with_its_reason(event: Event, ring: dict, reason: str) -> None:
    verdict = verify_event(event, ring)
    assert not verdict.ok
    assert reason in verdict.reason


def test_an_altered_signed_command_is_refused() -> None:
    signed = sign_event(eviction(), CONTROLLER)
    raw = json.loads(signed.to_json())
    raw["payload"]["node_id"] = "n02"
    raw["subject"] = "node/n02"
    _, altered = decode_wire(json.dumps(raw).encode(), max_bytes=MAX)
    verdict = verify_event(altered, RING)
    assert not verdict.ok and "bad signature" in verdict.reason
    assert verify_event(signed, RING).ok


def test_a_signature_that_is_not_base64_is_refused_not_raised() -> None:
    signed = sign_event(eviction(), CONTROLLER).model_copy(update={"signature": "***"})
    assert "bad signature" in verify_event(signed, RING).reason


def test_an_operator_event_must_name_its_signer_in_by() -> None:
    answer = Event.create(ApprovalGiven(request_id="r", approved=True, by="bob"), job_id="j1", subject="job/j1",
                          producer="keel-cli", occurred_at=T0)
    verdict = verify_event(sign_event(answer, OPERATOR), RING)
    assert not verdict.ok and "says by='bob' but is signed by 'alice'" in verdict.reason
    honest = answer.model_copy(update={"payload": answer.payload.model_copy(update={"by": "alice"})})
    assert verify_event(sign_event(honest, OPERATOR), RING).ok


def test_types_that_need_no_signature_pass_unsigned_and_are_checked_when_signed() -> None:
    health = health_event("n01")
    assert verify_event(health, RING).ok
    assert not verify_event(sign_event(health, key("controller", "controller")), RING).ok


def test_a_bus_signing_signs_only_what_its_roles_must_and_refuses_without_a_keyring() -> None:
    signing = Signing(keys=(CONTROLLER, OPERATOR), keyring=RING)
    signed = signing.sign(eviction())
    assert signed.signed_by == "controller" and signing.check(signed).ok
    health = health_event("n01")
    assert signing.sign(health) is health
    assert Signing(keys=(AGENT,)).sign(eviction()).signature is None  # an agent's key cannot sign a command
    verdict = NO_SIGNING.check(signed)
    assert not verdict.ok and "no keyring" in verdict.reason
    assert NO_SIGNING.check(health).ok


def test_ensure_signing_identity_creates_a_private_key_and_a_keyring_entry(tmp_path: Path) -> None:
    credentials = tmp_path / "credentials"
    created = ensure_signing_identity(credentials, "controller", "controller")
    key_file = credentials / "signing" / "controller.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((credentials / "signing").stat().st_mode) == 0o700
    again = ensure_signing_identity(credentials, "controller", "controller")
    assert again.public.public_text() == created.public.public_text()
    ensure_signing_identity(credentials, "alice", "operator")
    ring = parse_keyring((credentials / "signing" / "keyring.json").read_bytes())
    assert {n: e.role for n, e in ring.items()} == {"controller": "controller", "alice": "operator"}
    assert load_signing_key(credentials, "alice").role == "operator"
    assert verify_event(sign_event(eviction(), created), ring).ok


def test_a_rotated_key_replaces_its_keyring_entry(tmp_path: Path) -> None:
    old = ensure_signing_identity(tmp_path, "controller", "controller")
    (tmp_path / "signing" / "controller.key").unlink()
    new = ensure_signing_identity(tmp_path, "controller", "controller")
    ring = KeyringFile(tmp_path / "signing" / "keyring.json")
    assert ring["controller"].public_text() == new.public.public_text() != old.public.public_text()
    assert not verify_event(sign_event(eviction(), old), ring).ok


def test_bad_identities_and_keyrings_are_refused_with_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(KeyringError, match="role 'root' is unknown"):
        ensure_signing_identity(tmp_path, "x", "root")
    with pytest.raises(KeyringError, match="not a valid name"):
        ensure_signing_identity(tmp_path, "../etc", "operator")
    ensure_signing_identity(tmp_path, "controller", "controller")
    with pytest.raises(KeyringError, match="with role controller, not operator"):
        ensure_signing_identity(tmp_path, "controller", "operator")
    with pytest.raises(KeyringError, match="is not in the keyring"):
        load_signing_key(tmp_path, "nobody")
    (tmp_path / "signing" / "keyring.json").write_text("{not json")
    with pytest.raises(KeyringError, match="is not valid JSON"):
        KeyringFile(tmp_path / "signing" / "keyring.json")
    with pytest.raises(KeyringError, match="32"):
        parse_keyring(json.dumps({"identities": {"a": {"role": "operator", "public_key": "AAAA"}}}))


def test_a_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    ensure_signing_identity(tmp_path, "controller", "controller")
    os.chmod(tmp_path / "signing" / "controller.key", 0o644)
    with pytest.raises(InsecurePathError, match="chmod 600"):
        ensure_signing_identity(tmp_path, "controller", "controller")


def test_a_keyring_file_learns_an_identity_added_after_it_was_read(tmp_path: Path) -> None:
    # At once, with no pause: a new operator's first event comes right after the recorder started.
    ensure_signing_identity(tmp_path, "controller", "controller")
    ring = KeyringFile(tmp_path / "signing" / "keyring.json")
    assert "alice" not in ring
    alice = ensure_signing_identity(tmp_path, "alice", "operator")
    assert ring["alice"].public_text() == alice.public.public_text()
    (tmp_path / "signing" / "alice.key").unlink()  # a rotation: same name, a new key, a keyring of the same size
    rotated = ensure_signing_identity(tmp_path, "alice", "operator")
    assert rotated.public.public_text() != alice.public.public_text()
    assert ring["alice"].public_text() == alice.public.public_text()  # a known name does not re-read the file
    assert "mallory" not in ring and ring["alice"].public_text() == rotated.public.public_text()  # a miss does
    missing = KeyringFile(tmp_path / "nowhere.json")
    assert len(missing) == 0 and not verify_event(sign_event(eviction(), CONTROLLER), missing).ok


def test_a_rotated_key_of_a_known_name_verifies_at_its_first_event(tmp_path: Path) -> None:
    old = ensure_signing_identity(tmp_path, "controller", "controller")
    signing = Signing(keyring=KeyringFile(tmp_path / "signing" / "keyring.json"))
    assert signing.check(sign_event(eviction(), old)).ok
    (tmp_path / "signing" / "controller.key").unlink()
    new = ensure_signing_identity(tmp_path, "controller", "controller")  # rotated: same name, same size
    assert signing.check(sign_event(eviction(), new)).ok  # the failed check read the file again
    forged = Ed25519PrivateKey.generate()
    verdict = signing.check(sign_event(eviction(), type(new)("controller", "controller", forged)))
    assert not verdict.ok and "bad signature" in verdict.reason  # a key nobody entered still fails


def test_a_broken_keyring_is_read_once_per_version(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ensure_signing_identity(tmp_path, "controller", "controller")
    path = tmp_path / "signing" / "keyring.json"
    ring = KeyringFile(path)
    path.write_text("{not json")
    for name in ("a", "b", "c"):
        assert name not in ring
    assert sum("could not read it again" in r.message for r in caplog.records) == 1
    assert "controller" in ring  # the identities read before are kept
