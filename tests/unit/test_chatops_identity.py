"""The chat-ops identity's least privilege: its signing key (role ``chatops``) makes an ``ApprovalGiven`` count and
nothing else, only with a chat-ops producer; its NATS identity (the API's) may publish ``ApprovalGiven`` and
``NodeCordoned`` only. An operator's approval still has to name its signer."""

from __future__ import annotations

from datetime import UTC, datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from keel.events.envelope import Event
from keel.events.signing import SigningKey, sign_event, verify_event
from keel.events.types import ApprovalGiven, NodeCordoned
from keel.infra.nats_auth import CHATOPS, STANDARD_IDENTITIES, NatsScope, new_identity, permissions
from keel.infra.signing import Signing

T0 = datetime(2026, 12, 7, 8, 0, tzinfo=UTC)
CHAT = SigningKey("chatops", "chatops", Ed25519PrivateKey.generate())
ALICE = SigningKey("alice", "operator", Ed25519PrivateKey.generate())
RING = {k.name: k.public for k in (CHAT, ALICE)}


def approval(by: str = "bob", producer: str = "chatops-slack") -> Event:
    return Event.create(ApprovalGiven(request_id="7d1c2a4e-6a7e-4d1c-9b7a-6b6565c0de01", approved=True, by=by,
                                      comment="via Slack, Slack user U024BE7LH"),
                        job_id="j1", subject="job/j1", producer=producer, occurred_at=T0)


def test_the_chatops_key_signs_an_approval_naming_the_approver_it_mapped() -> None:
    verdict = verify_event(sign_event(approval(), CHAT), RING)
    assert verdict.ok, verdict.reason
    assert Signing(keys=(CHAT,), keyring=RING).sign(approval()).signed_by == "chatops"


def test_the_chatops_key_cannot_sign_anything_else_or_pose_as_the_cli() -> None:
    cordon = Event.create(NodeCordoned(node_id="n1", by="bob", reason="x"), job_id="j1", subject="node/n1",
                          producer="chatops-slack", occurred_at=T0)
    refused = verify_event(sign_event(cordon, CHAT), RING)
    assert not refused.ok and "may only be signed by a operator key" in refused.reason
    assert Signing(keys=(CHAT,), keyring=RING).sign(cordon).signature is None  # its bus does not even sign one
    as_cli = verify_event(sign_event(approval(producer="cli"), CHAT), RING)
    assert not as_cli.ok and "does not name a chat-ops channel" in as_cli.reason


def test_an_operators_approval_still_names_its_signer() -> None:
    assert verify_event(sign_event(approval(by="alice", producer="cli"), ALICE), RING).ok
    forged = verify_event(sign_event(approval(by="bob", producer="cli"), ALICE), RING)
    assert not forged.ok and "names the identity that signed it" in forged.reason


def test_the_chatops_nats_identity_publishes_approvals_and_cordons_only() -> None:
    # The API's NATS identity carries chat-ops answers and operator tokens' answers and cordons (keel.api.actions);
    # a cordon counts only signed by an operator's key (above).
    assert CHATOPS in STANDARD_IDENTITIES  # keel up issues it
    allowed = permissions(new_identity(CHATOPS, CHATOPS), NatsScope())["publish"]["allow"]
    events = [s for s in allowed if s.startswith("keel.")]
    assert events == ["keel.*.job.*.ApprovalGiven", "keel.*.node.*.NodeCordoned"]
    assert not [s for s in allowed if "CONSUMER.CREATE" in s or "DURABLE" in s or "MSG.GET" in s]
