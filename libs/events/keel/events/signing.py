"""Signed events: who may say what, and the check of an event's signature (pure; no files, no clock).

Anyone who can publish on the bus could otherwise drive Keel: evict a node, run code on every worker,
approve a held action, send every rank's weights elsewhere. So the events that make something happen carry
an ed25519 signature of their producer, and whoever acts on one checks it first (``verify_event``);
an event that fails is dead-lettered with the reason and never acted on.

What is signed (``signing_bytes``): the envelope as a JSON object, as sent, without its ``signature``
field and without top-level fields whose value is null, serialised with sorted keys, no whitespace and
UTF-8 (``json.dumps(..., sort_keys=True, separators=(",", ":"), ensure_ascii=False)``), after the domain
prefix ``SIGNATURE_CONTEXT``. ``signed_by`` (the signer's identity in the keyring) is part of what is
signed. A consumer that got an older schema version checks the envelope as sent (``decode_wire``'s
``as_sent``); one at the current version checks ``event.to_wire()``, which is the same JSON object
(pydantic's dump of a value it parsed is the value that was dumped).

Who signs what (``REQUIRED_SIGNER``): the controller its commands and decisions, the checkpoint broker its
placements, restore plans, schedules and commits, the analyzer its verdicts, hot-update its rollouts and
verdicts on code, the actuator its reports, an operator (``keel approve``, ``keel cordon``, ``keel
deploy``) the operator events, whose ``by`` must then be the signer's identity. Types not in the table
need no signature (a node agent's reports, the recorder's lag; see docs/security.md).

The keyring maps an identity to its role and public key (``Keyring``; ``keel.infra.signing`` reads and
writes it and the private keys).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from keel.events.envelope import Event

Role = Literal["controller", "checkpoint-broker", "hot-update", "analyzer", "recorder", "actuator", "notifier", "agent",
               "operator", "auditor", "chatops"]
ROLES: tuple[str, ...] = get_args(Role)

SIGNATURE_CONTEXT = b"keel-event-signature-v1\n"
"""Prefixed to what is signed, so a Keel event signature can never be taken for a signature of anything else."""

SIGNATURE_FIELD = "signature"
SIGNER_FIELD = "signed_by"

_CONTROLLER = frozenset({"controller"})
_BROKER = frozenset({"checkpoint-broker"})
_ANALYZER = frozenset({"analyzer"})
_HOT_UPDATE = frozenset({"hot-update"})
_ACTUATOR = frozenset({"actuator"})
_OPERATOR = frozenset({"operator"})
_CHATOPS = frozenset({"chatops"})
"""The API's chat-ops identity: it may sign a human's answer to an approval request, and nothing else."""

REQUIRED_SIGNER: Mapping[str, frozenset[str]] = {
    # The controller's commands (agents and actuators carry them out) and its decisions (the other deciders
    # and the controller's own cold start fold them into state).
    "RanksRestartRequested": _CONTROLLER, "NodeEvictionDecided": _CONTROLLER,
    "StandbyRefillRequested": _CONTROLLER, "StandbyPromotionRequested": _CONTROLLER,
    "DiagnosticsRequested": _CONTROLLER, "StacksRequested": _CONTROLLER, "SdcReplayRequested": _CONTROLLER,
    "NodeClockSkewed": _CONTROLLER, "NodeFenced": _CONTROLLER, "RestartDecided": _CONTROLLER, "RollbackDecided": _CONTROLLER,
    "JobStopDecided": _CONTROLLER, "IncidentOpened": _CONTROLLER, "IncidentResolved": _CONTROLLER,
    "ActionHeld": _CONTROLLER, "ApprovalRequested": _CONTROLLER, "StandbyPoolSized": _CONTROLLER,
    # The job clock: a forged tick from the future would expire every deadline (silence, acknowledgements).
    "TimerTicked": _CONTROLLER,
    # The checkpoint broker: where every rank's weights go and where a restore reads them from.
    "CheckpointBackupAssigned": _BROKER, "CheckpointNodeBackupsAssigned": _BROKER,
    "CheckpointRestorePlanned": _BROKER, "CheckpointNodeRestorePlanned": _BROKER,
    "CheckpointScheduleSet": _BROKER, "CheckpointStepCommitted": _BROKER, "CheckpointPersisted": _BROKER,
    # The analyzer's verdicts (a conviction evicts a node).
    "StacksAnalyzed": _ANALYZER, "FailSlowConvicted": _ANALYZER, "SdcReplayAnalyzed": _ANALYZER,
    # Hot-update: a rollout restarts the job onto new code.
    "CodeRolloutRequested": _HOT_UPDATE, "CodeVersionStable": _HOT_UPDATE,
    # The actuator's report of an eviction it carried out.
    "NodeEvicted": _ACTUATOR,
    # Operator events: a human's approval, cordon, deploy. An approval may also come through chat-ops (Slack's
    # buttons, a signed callback): the API's chatops key signs it, naming the approver it mapped.
    "ApprovalGiven": _OPERATOR | _CHATOPS, "NodeCordoned": _OPERATOR, "CodeVersionRegistered": _OPERATOR,
    # A rejection is an operator's (keel deploy's own checks) or hot-update's (a malformed registration).
    "CodeVersionRejected": _OPERATOR | _HOT_UPDATE,
    # Where a holder learns which node may send it each rank's backups (the shard store's authorization).
    "CheckpointNodeBackupsHeld": _BROKER,
}
"""Event type -> the roles whose keys may sign it. An event of a type listed here is acted on only with a
valid signature by a key of one of these roles; other types need none (one that carries a signature
anyway is checked all the same)."""

OPERATOR_TYPES = frozenset(name for name, roles in REQUIRED_SIGNER.items() if roles in (_OPERATOR, _OPERATOR | _CHATOPS))
"""Operator events: signed by an operator, their payload's ``by`` must be the signer's identity (not a free-text
name). Signed by the chatops identity (an approval only), ``by`` is the approver chat-ops mapped the Slack user
or callback to, and ``producer`` names the channel (``chatops-slack``, ``chatops-webhook``)."""


class KeyringError(ValueError):
    """A keyring or key that cannot be used; the message names what is wrong and how to fix it."""


@dataclass(frozen=True)
class PublicIdentity:
    """One keyring entry: an identity's role and public key (``node``: the node an agent's key belongs to)."""

    name: str
    role: str
    public_key: Ed25519PublicKey
    node: str | None = None

    def public_text(self) -> str:
        return b64encode(self.public_key.public_bytes_raw())


@dataclass(frozen=True)
class SigningKey:
    """An identity's private key: ``sign_event`` signs with it."""

    name: str
    role: str
    private_key: Ed25519PrivateKey

    @property
    def public(self) -> PublicIdentity:
        return PublicIdentity(self.name, self.role, self.private_key.public_key())


Keyring = Mapping[str, PublicIdentity]
"""Identity name -> its entry."""


@dataclass(frozen=True)
class Verdict:
    """Whether an event may be acted on, and why (``reason`` is what a dead letter carries)."""

    ok: bool
    reason: str


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64decode(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise KeyringError(f"{what} is not base64") from None


def signing_bytes(envelope: Mapping[str, Any]) -> bytes:
    """What a signature covers: ``envelope`` (a JSON-ready dict) in its canonical form (module docstring)."""
    body = {key: value for key, value in envelope.items() if key != SIGNATURE_FIELD and value is not None}
    return SIGNATURE_CONTEXT + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                          allow_nan=False).encode()


def needs_signature(event_type: str) -> bool:
    return event_type in REQUIRED_SIGNER


def sign_event(event: Event, key: SigningKey) -> Event:
    """``event`` signed by ``key`` (a new event; ed25519 is deterministic, so signing the same event again gives
    the same bytes, and a decision published again after a crash is the same message)."""
    wire = event.to_wire()
    wire[SIGNER_FIELD] = key.name
    signature = key.private_key.sign(signing_bytes(wire))
    return event.model_copy(update={SIGNER_FIELD: key.name, SIGNATURE_FIELD: b64encode(signature)})


def sign_if_required(event: Event, key: SigningKey | None) -> Event:
    """``event`` signed by ``key`` when its type must be signed by ``key``'s role and it is not signed yet
    (an event already signed, a redriven one say, keeps its producer's signature); else as it is."""
    if key is None or event.signature is not None:
        return event
    roles = REQUIRED_SIGNER.get(event.type)
    if roles is None or key.role not in roles:
        return event
    return sign_event(event, key)


def verify_event(event: Event, keyring: Keyring, *, as_sent: Mapping[str, Any] | None = None) -> Verdict:
    """May ``event`` be acted on? Its signature is checked when its type needs one (``REQUIRED_SIGNER``) or it
    carries one. ``as_sent``: the envelope as it arrived when it was an older schema version (what was
    signed), else ``event.to_wire()`` is checked."""
    roles = REQUIRED_SIGNER.get(event.type)
    what = f"{event.type} {event.id} (producer {event.producer!r})"
    if event.signature is None or event.signed_by is None:
        if roles is None:
            return Verdict(True, f"{event.type} needs no signature")
        return Verdict(False, f"unsigned: {what} must be signed by a {'/'.join(sorted(roles))} key; "
                              "refusing to act on it")
    signer = keyring.get(event.signed_by)
    if signer is None:
        return Verdict(False, f"{what} is signed by {event.signed_by!r}, which is not in the keyring (a forgery, "
                              "or a key added after this keyring was copied: copy the keyring again)")
    if roles is not None and signer.role not in roles:
        return Verdict(False, f"{what} is signed by {signer.name!r} (role {signer.role}), but {event.type} may only "
                              f"be signed by a {'/'.join(sorted(roles))} key")
    try:
        signature = b64decode(event.signature, "the signature")
        signer.public_key.verify(signature, signing_bytes(as_sent if as_sent is not None else event.to_wire()))
    except (KeyringError, InvalidSignature):
        return Verdict(False, f"bad signature: {what} does not match the signature of {signer.name!r} "
                              "(forged, or altered after it was signed)")
    if event.type in OPERATOR_TYPES and signer.role == "operator":
        by = getattr(event.payload, "by", None)
        if by != signer.name:
            return Verdict(False, f"{what} says by={by!r} but is signed by {signer.name!r}: an operator event "
                                  "names the identity that signed it")
    if signer.role == "chatops" and not event.producer.startswith("chatops"):
        return Verdict(False, f"{what} is signed by chat-ops identity {signer.name!r} but its producer does not "
                              "name a chat-ops channel (chatops-...)")
    return Verdict(True, f"signed by {signer.name!r} ({signer.role})")


def parse_keyring(text: str | bytes, *, source: str = "keyring") -> dict[str, PublicIdentity]:
    """A keyring's JSON (``{"identities": {name: {"role", "public_key" (base64 raw ed25519), "node"?}}}``) to
    its entries. Raises ``KeyringError`` naming ``source`` and what is wrong."""
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KeyringError(f"{source} is not valid JSON ({exc}); restore it from a copy, or delete it and run "
                           "`keel up` to create the keys again") from None
    identities = doc.get("identities") if isinstance(doc, dict) else None
    if not isinstance(identities, dict):
        raise KeyringError(f"{source} has no 'identities' object")
    entries: dict[str, PublicIdentity] = {}
    for name, entry in identities.items():
        if not isinstance(entry, dict):
            raise KeyringError(f"{source}: identity {name!r} is not an object")
        role, public, node = entry.get("role"), entry.get("public_key"), entry.get("node")
        if role not in ROLES:
            raise KeyringError(f"{source}: identity {name!r} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(public, str):
            raise KeyringError(f"{source}: identity {name!r} has no 'public_key' string")
        raw = b64decode(public, f"{source}: the public key of {name!r}")
        if len(raw) != 32:
            raise KeyringError(f"{source}: the public key of {name!r} is {len(raw)} bytes, an ed25519 key is 32")
        if node is not None and not isinstance(node, str):
            raise KeyringError(f"{source}: identity {name!r} has a 'node' that is not a string")
        entries[name] = PublicIdentity(name, role, Ed25519PublicKey.from_public_bytes(raw), node)
    return entries


def keyring_json(entries: Mapping[str, PublicIdentity]) -> bytes:
    """The JSON ``parse_keyring`` reads (sorted, so a rewrite of the same keyring is the same bytes)."""
    identities: dict[str, dict[str, str]] = {}
    for name, entry in sorted(entries.items()):
        item = {"role": entry.role, "public_key": entry.public_text()}
        if entry.node is not None:
            item["node"] = entry.node
        identities[name] = item
    return (json.dumps({"identities": identities}, indent=2, sort_keys=True) + "\n").encode()
