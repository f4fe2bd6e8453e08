"""NATS identities and permissions: who may publish and receive what on Keel's bus.

Every client of Keel's NATS authenticates as one *identity* of one *role*; the server enforces, per
identity, which subjects it may publish and subscribe to. Keel's own deployments (``keel up``'s embedded
server, the compose file, the Terraform module) run with these permissions; an unauthenticated client is
refused.

Roles (``ROLES``) and what they may publish (``ROLE_EVENT_TYPES``; events are on
``<prefix>.<job>.<aggregate kind>.<aggregate id>.<type>``, ``keel.infra.subjects``):

- ``admin``: everything, including managing streams (create, update, delete, purge). ``keel up``,
  ``keel migrate``, ``keel dlq redrive`` (it republishes events of any type).
- ``recorder``: its lag reports and purging what it has stored from the events stream.
- ``controller``: the commands and decisions (restarts, evictions, standby, diagnostics, clock ticks).
- ``checkpoint-broker``, ``analyzer``, ``hot-update``: their own decisions' event types.
- ``actuator``: ``NodeEvicted``. ``supervisor``: ``ServiceRestarted`` / ``ServiceGaveUp``.
- ``agent``: one identity per (job, node). Only its own node's facts (``node.<its id>``), its ranks'
  ``RankStarted`` / ``RankExited`` and the job's ``CheckpointTierFallback``; it receives only through its
  own durable consumer (its exact name), so it cannot reconfigure another service's consumer.
- ``operator``: approvals, cordons, code-version registration, fault injection.
- ``auditor``: reads stream and consumer state; publishes nothing.
- ``chatops``: the API's identity for its actions: ``ApprovalGiven`` (chat-ops answers, an operator token's
  answers) and ``NodeCordoned`` (an operator token's cordons) only, publish only. What makes either one acted
  on is its signature (``keel.events.signing``): the API's chatops key may sign approvals only, a cordon must
  carry an operator's.

Every identity has its own inbox prefix (``_INBOX.<user>``) and may subscribe only below it, so no
client reads another's replies (JetStream deliveries of pull consumers go to inboxes).

A *scope* names the subject prefix and stream names the permissions are rendered for. Keel's own
deployments render the exact ones (``keel``, ``KEEL``, ``KEEL_DLQ``); a shared test server, where every
test takes its own prefix and streams, renders ``*`` for them (``NatsScope.any()``). With ``*`` a dead
letter's subject (``<prefix>_dlq...``) and an event's cannot be told apart by the server, so there a
dead-lettering client's permission to dead-letter the commands it consumes is also a permission to publish
them; the exact scope has no such overlap (docs/security.md).

Identity files: ``<credentials>/nats/<name>.json`` (0600): ``{"name", "role", "user", "password",
"inbox_prefix", "node", "job"}``. The server's authorization block is rendered from all of them
(``render_authorization``). ``NatsAuthority`` issues identities and has a local server reload them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from keel.infra.config import BusSettings, Settings, credentials_path
from keel.infra.secrets import ensure_private_dir, read_secret, write_secret
from keel.infra.subjects import encode_token

log = logging.getLogger(__name__)

ADMIN, RECORDER, CONTROLLER, BROKER, ANALYZER, HOT_UPDATE = (
    "admin", "recorder", "controller", "checkpoint-broker", "analyzer", "hot-update")
ACTUATOR, SUPERVISOR, AGENT, OPERATOR, AUDITOR = "actuator", "supervisor", "agent", "operator", "auditor"
NOTIFIER, CHATOPS = "notifier", "chatops"
ROLES = (ADMIN, RECORDER, CONTROLLER, BROKER, ANALYZER, HOT_UPDATE, ACTUATOR, NOTIFIER, SUPERVISOR, AGENT, OPERATOR,
         AUDITOR, CHATOPS)
SERVICE_ROLES = (RECORDER, CONTROLLER, BROKER, ANALYZER, HOT_UPDATE, ACTUATOR, NOTIFIER, SUPERVISOR)
"""The roles with one identity each, named after the role (``<credentials>/nats/<role>.json``)."""
STANDARD_IDENTITIES = (ADMIN, *SERVICE_ROLES, OPERATOR, AUDITOR, CHATOPS)
"""The identities ``keel up`` (and every Keel-managed server) creates at start; agents get theirs per
(job, node) from ``NatsAuthority.ensure_agent``."""

# (aggregate kind, event type) each role may publish. Decisions publish DecisionRefused when a decider
# refuses its own output (keel.kernel.decider).
_DECIDER_REFUSAL = (("job", "DecisionRefused"),)
ROLE_EVENT_TYPES: dict[str, tuple[tuple[str, str], ...]] = {
    RECORDER: (("recorder", "RecorderLagReported"),),
    CONTROLLER: (
        ("clock", "TimerTicked"), ("node", "NodeEvictionDecided"), ("node", "NodeClockSkewed"), ("node", "NodeFenced"),
        ("node", "RanksRestartRequested"), ("job", "IncidentOpened"), ("job", "IncidentResolved"),
        ("job", "DiagnosticsRequested"), ("node", "StandbyPromotionRequested"), ("job", "StandbyPoolSized"),
        ("job", "StandbyRefillRequested"), ("job", "RollbackDecided"), ("job", "JobStopDecided"),
        ("job", "RestartDecided"), ("job", "ActionHeld"), ("job", "ApprovalRequested"),
        ("job", "StacksRequested"), ("job", "SdcReplayRequested"), *_DECIDER_REFUSAL,
    ),
    BROKER: (
        ("node", "CheckpointNodeBackupsAssigned"), ("job", "CheckpointBackupAssigned"),
        ("node", "CheckpointShardsStored"), ("job", "CheckpointStepCommitted"), ("job", "CheckpointScheduleSet"),
        ("job", "CheckpointPersisted"), ("node", "CheckpointNodeRestorePlanned"),
        ("job", "CheckpointRestorePlanned"), ("job", "CheckpointTierFallback"), ("node", "CheckpointNodeBackupsHeld"),
        *_DECIDER_REFUSAL,
    ),
    ANALYZER: (("job", "StacksAnalyzed"), ("job", "FailSlowConvicted"), ("job", "SdcReplayAnalyzed"),
               *_DECIDER_REFUSAL),
    HOT_UPDATE: (("job", "CodeRolloutRequested"), ("job", "CodeVersionStable"), ("code", "CodeVersionRegistered"),
                 ("code", "CodeVersionRejected"), *_DECIDER_REFUSAL),
    ACTUATOR: (("node", "NodeEvicted"),),
    NOTIFIER: (("job", "NotificationSent"),),
    SUPERVISOR: (("service", "ServiceRestarted"), ("service", "ServiceGaveUp")),
    OPERATOR: (("job", "ApprovalGiven"), ("node", "NodeCordoned"), ("code", "CodeVersionRegistered"),
               ("code", "CodeVersionRejected"), ("node", "FaultInjected"), ("job", "JobRegistered")),
    AUDITOR: (),
    CHATOPS: (("job", "ApprovalGiven"), ("node", "NodeCordoned")),
}
AGENT_NODE_FACTS = (
    "NodeRegistered", "NodeHealthChanged", "NodeHeartbeat", "RanksRestarted", "CheckpointRanksRegistered",
    "CheckpointShardsStored", "CheckpointInventoryReported", "CheckpointBackupFailed", "DiagnosticsCompleted",
    "StandbyChecked", "StandbyPromoted", "StacksCaptured", "MetricAnomalyDetected", "SdcReplayCompleted",
    "CodeVersionApplied",
)
"""What an agent reports about its own node (``node.<its id>`` subjects only)."""
AGENT_OTHER_FACTS = (("rank", "RankStarted"), ("rank", "RankExited"), ("job", "CheckpointTierFallback"))
"""What an agent reports on other aggregates: its ranks (rank ids are job-wide numbers, so any rank of a
job it serves) and the job's tier fallback."""
AGENT_NODE_COMMANDS = ("RanksRestartRequested", "StandbyPromotionRequested", "NodeClockSkewed", "NodeEvictionDecided",
                       "NodeFenced",
                       "CheckpointNodeBackupsAssigned", "CheckpointNodeRestorePlanned", "CheckpointNodeBackupsHeld")
AGENT_JOB_COMMANDS = ("DiagnosticsRequested", "StacksRequested", "SdcReplayRequested", "CheckpointBackupAssigned",
                      "CheckpointScheduleSet", "CheckpointRestorePlanned", "CheckpointStepCommitted")
"""What an agent consumes (``keel.agent.consumer``): what it may dead-letter."""
ACTUATOR_COMMANDS = (("node", "NodeEvictionDecided"), ("job", "StandbyRefillRequested"))

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class NatsAuthError(RuntimeError):
    """An identity cannot be issued or found; the message says what to do."""


@dataclass(frozen=True)
class NatsScope:
    """The subject prefix and stream names permissions are rendered for (``*`` for any)."""

    prefix: str = "keel"
    stream: str = "KEEL"
    dlq_stream: str = "KEEL_DLQ"

    @classmethod
    def any(cls) -> NatsScope:
        return cls("*", "*", "*")

    @property
    def dlq_prefix(self) -> str:
        return "*" if self.prefix == "*" else f"{self.prefix}_dlq"


@dataclass(frozen=True)
class NatsIdentity:
    """One client identity: its NATS user and password, its inbox prefix, and what it stands for."""

    name: str
    role: str
    user: str
    password: str
    inbox_prefix: str
    node: str | None = None
    job: str | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, source: str) -> NatsIdentity:
        try:
            raw = json.loads(data)
            identity = cls(**{key: raw.get(key) for key in ("name", "role", "user", "password", "inbox_prefix",
                                                             "node", "job")})
        except (ValueError, TypeError) as exc:
            raise NatsAuthError(f"NATS identity file {source} is not a Keel identity: {exc}") from None
        if identity.role not in ROLES or not identity.user or not identity.password:
            raise NatsAuthError(f"NATS identity file {source}: role {identity.role!r} unknown or user/password missing")
        return identity


def user_token(name: str) -> str:
    """A NATS user name (and inbox token) for identity ``name``: ``name`` encoded as one subject token."""
    return encode_token(name)


def agent_identity_name(job_id: str, node_id: str) -> str:
    return f"agent.{job_id}.{node_id}"


def agent_durable(job_id: str, node_id: str, *, checkpointing: bool) -> str:
    """The durable consumer name of node ``node_id``'s agent for ``job_id``: exact, so the agent's identity
    may create and read that one consumer and no other."""
    return f"agent-{job_id}-{encode_token(node_id)}-{'ckpt' if checkpointing else 'cmd'}"


def new_identity(name: str, role: str, *, node: str | None = None, job: str | None = None) -> NatsIdentity:
    if role not in ROLES:
        raise NatsAuthError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    if not _NAME.match(name):
        raise NatsAuthError(f"identity name {name!r}: use letters, digits, '.', '_' and '-' (at most 200)")
    if role == AGENT and (not node or not job):
        raise NatsAuthError("an agent identity names its job and node")
    user = user_token(name)
    return NatsIdentity(name=name, role=role, user=user, password=secrets.token_urlsafe(32),
                        inbox_prefix=f"_INBOX.{user}", node=node, job=job)


# ------------------------------------------------------------------------------------------- permissions


def _events(scope: NatsScope, pairs: Iterable[tuple[str, str]], *, aggregate: str = "*", job: str = "*") -> list[str]:
    return [f"{scope.prefix}.{job}.{kind}.{aggregate}.{event_type}" for kind, event_type in pairs]


def _dead_letters(scope: NatsScope, pairs: Iterable[tuple[str, str]], *, aggregate: str = "*",
                  job: str = "*") -> list[str]:
    return [f"{scope.dlq_prefix}.{job}.{kind}.{aggregate}.{event_type}" for kind, event_type in pairs]


def _consumer_api(scope: NatsScope, durable: str, stream: str | None = None) -> list[str]:
    stream = stream or scope.stream
    return [
        f"$JS.API.CONSUMER.CREATE.{stream}.{durable}", f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}", f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    ]


def permissions(identity: NatsIdentity, scope: NatsScope) -> dict[str, dict[str, list[str]]]:
    """``{"publish": {"allow": [...]}, "subscribe": {"allow": [...]}}`` for ``identity`` (pure)."""
    if identity.role == ADMIN:
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    subscribe = [f"{identity.inbox_prefix}.>"]
    # Reading stream and consumer state is harmless and every client does it at connect.
    publish = ["$JS.API.INFO", f"$JS.API.STREAM.INFO.{scope.stream}", f"$JS.API.STREAM.INFO.{scope.dlq_stream}",
               f"$JS.API.CONSUMER.INFO.{scope.stream}.*"]
    role = identity.role
    if role == AGENT:
        node = encode_token(identity.node or "")
        job = identity.job or "*"
        publish += [f"{scope.prefix}.{job}.node.{node}.{event_type}" for event_type in AGENT_NODE_FACTS]
        publish += _events(scope, AGENT_OTHER_FACTS, job=job)
        for checkpointing in (False, True):
            publish += _consumer_api(scope, agent_durable(identity.job or "", identity.node or "",
                                                          checkpointing=checkpointing))
        publish += [f"{scope.dlq_prefix}.{job}.node.{node}.{event_type}" for event_type in AGENT_NODE_COMMANDS]
        publish += [f"{scope.dlq_prefix}.{job}.job.*.{event_type}" for event_type in AGENT_JOB_COMMANDS]
        return {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}}
    if role in (AUDITOR, OPERATOR):  # dead letters are for people to read (keel dlq show)
        publish += [f"$JS.API.STREAM.MSG.GET.{scope.dlq_stream}", f"$JS.API.DIRECT.GET.{scope.dlq_stream}",
                    f"$JS.API.DIRECT.GET.{scope.dlq_stream}.>"]
    if role == AUDITOR:
        return {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}}
    publish += _events(scope, ROLE_EVENT_TYPES.get(role, ()))
    if role in (OPERATOR, CHATOPS):  # people's answers: publish only, no consumer
        return {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}}
    # The services: consumers of their own (any durable: they are trusted with each other's positions),
    # reading single messages (cold start checks the stream, keel.infra.runner) and dead-lettering what
    # they cannot process.
    publish += _consumer_api(scope, "*") + _consumer_api(scope, "*", scope.dlq_stream)
    publish += [f"$JS.API.STREAM.MSG.GET.{scope.stream}", f"$JS.API.DIRECT.GET.{scope.stream}",
                f"$JS.API.DIRECT.GET.{scope.stream}.>"]
    if role == ACTUATOR:
        publish += _dead_letters(scope, ACTUATOR_COMMANDS)
    elif scope.prefix != "*":
        publish += [f"{scope.dlq_prefix}.>"]
    else:  # with any prefix, ``*.>`` would be every event: dead-letter only what the role consumes
        publish += _dead_letters(scope, [(kind, t) for _, pairs in ROLE_EVENT_TYPES.items() for kind, t in pairs])
    if role == RECORDER:
        publish += [f"$JS.API.STREAM.PURGE.{scope.stream}"]
    return {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}}


def render_authorization(identities: Sequence[NatsIdentity], scopes: Sequence[NatsScope]) -> str:
    """The server's ``authorization { users: [...] }`` block for ``identities``, each allowed the union of
    its permissions in every scope (pure; JSON is valid NATS configuration syntax)."""
    users = []
    for identity in sorted(identities, key=lambda i: i.name):
        merged: dict[str, dict[str, list[str]]] = {"publish": {"allow": []}, "subscribe": {"allow": []}}
        for scope in scopes:
            for direction, rules in permissions(identity, scope).items():
                allow = merged[direction]["allow"]
                allow += [subject for subject in rules["allow"] if subject not in allow]
        users.append({"user": identity.user, "password": identity.password, "permissions": merged})
    return "# generated by keel.infra.nats_auth; rewritten whenever an identity is issued\n" \
           f"authorization {json.dumps({'users': users}, indent=1)}\n"


# ----------------------------------------------------------------------------------------------- files


def identity_dir(credentials_dir: Path) -> Path:
    return Path(credentials_dir) / "nats"


def identity_file(credentials_dir: Path, name: str) -> Path:
    return identity_dir(credentials_dir) / f"{name}.json"


def load_identity(path: Path) -> NatsIdentity:
    return NatsIdentity.from_json(read_secret(path), str(path))


@dataclass(frozen=True)
class LocalServer:
    """What ``NatsAuthority`` needs of a NATS server on this machine to have it reload its identities."""

    auth_file: Path
    pid_file: Path
    monitor_url: str

    def to_dict(self) -> dict[str, str]:
        return {"auth_file": str(self.auth_file), "pid_file": str(self.pid_file), "monitor_url": self.monitor_url}

    @classmethod
    def from_dict(cls, raw: dict[str, str]) -> LocalServer:
        return cls(Path(raw["auth_file"]), Path(raw["pid_file"]), raw["monitor_url"])

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().split()[0])
            os.kill(pid, 0)
        except (OSError, ValueError, IndexError):
            return None
        return pid


@dataclass(frozen=True)
class Attachment:
    """``server.json``: the local servers that accept this folder's identities, and the scopes their
    permissions are rendered for (the same for all)."""

    servers: tuple[LocalServer, ...] = ()
    scopes: tuple[NatsScope, ...] = (NatsScope(),)

    def to_json(self) -> bytes:
        raw = {"servers": [server.to_dict() for server in self.servers],
               "scopes": [asdict(scope) for scope in self.scopes]}
        return json.dumps(raw, indent=2).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> Attachment:
        raw = json.loads(data)
        return cls(tuple(LocalServer.from_dict(server) for server in raw["servers"]),
                   tuple(NatsScope(**scope) for scope in raw["scopes"]))


class NatsAuthority:
    """Issues identities into ``<credentials>/nats/`` and keeps local servers' authorization in step.

    ``attach(server, scope)`` records a server that accepts this folder's identities (``server.json``;
    several may, e.g. a test's own server beside the shared one); issuing an identity then rewrites each
    running server's authorization file and has it reload (SIGHUP), waiting until the reload took effect.
    Without an attached server (an external NATS) an issued identity must be added to that server by its
    operator (``render_authorization`` renders the block)."""

    def __init__(self, credentials_dir: Path) -> None:
        self.folder = identity_dir(credentials_dir)

    @property
    def server_file(self) -> Path:
        return self.folder / "server.json"

    def identities(self) -> list[NatsIdentity]:
        if not self.folder.is_dir():
            return []
        return [load_identity(path) for path in sorted(self.folder.glob("*.json")) if path.name != "server.json"]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One issuer at a time (processes on this host): agents starting together each issue their identity,
        and a rewrite of the authorization rendered before another's identity existed, written after it,
        would drop that identity from the server."""
        ensure_private_dir(self.folder.parent)  # the credentials folder itself, before mkdir makes it 0755
        ensure_private_dir(self.folder)
        fd = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def ensure(self, name: str, role: str, *, node: str | None = None, job: str | None = None,
               reload: bool = True) -> Path:
        """The identity file of ``name`` (created, and the attached servers reloaded, when missing)."""
        path = identity_file(self.folder.parent, name)
        if path.exists():
            return self._existing(path, name, role, node, job)
        with self._locked():
            if path.exists():  # issued by another process meanwhile
                return self._existing(path, name, role, node, job)
            write_secret(path, new_identity(name, role, node=node, job=job).to_json())
            if reload:
                self._reload()
        return path

    @staticmethod
    def _existing(path: Path, name: str, role: str, node: str | None, job: str | None) -> Path:
        """``path`` when the identity there is the one asked for; else the reason it is not."""
        existing = load_identity(path)
        if existing.role != role or existing.node != node or existing.job != job:
            raise NatsAuthError(f"identity {name} exists with role {existing.role} (node {existing.node}, job "
                                f"{existing.job}), not {role}; remove {path} to issue it anew")
        return path

    def ensure_standard(self) -> None:
        """The admin, service, operator and auditor identities (no reload: called before a server starts)."""
        for name in STANDARD_IDENTITIES:
            self.ensure(name, name, reload=False)

    def ensure_agent(self, job_id: str, node_id: str) -> Path:
        """The identity of node ``node_id``'s agent for ``job_id`` (issued and loaded by the servers if new)."""
        return self.ensure(agent_identity_name(job_id, node_id), AGENT, node=node_id, job=job_id)

    def attachment(self) -> Attachment | None:
        if not self.server_file.exists():
            return None
        return Attachment.from_json(read_secret(self.server_file))

    def local_server(self) -> LocalServer | None:
        """The first attached server still running (None: no local server to issue identities for)."""
        attachment = self.attachment()
        if attachment is None:
            return None
        return next((server for server in attachment.servers if server.pid() is not None), None)

    def attach(self, server: LocalServer, scope: NatsScope) -> None:
        """Record ``server`` (replacing a record of the same authorization file, dropping servers no longer
        running) and write its authorization file. ``scope`` is added to the rendered scopes."""
        with self._locked():
            self._attach(server, scope)

    def _attach(self, server: LocalServer, scope: NatsScope) -> None:
        previous = self.attachment() or Attachment(servers=(), scopes=())
        servers = tuple(s for s in previous.servers if s.auth_file != server.auth_file and s.pid() is not None)
        scopes = previous.scopes if scope in previous.scopes else (*previous.scopes, scope)
        attachment = Attachment((*servers, server), scopes)
        write_secret(self.server_file, attachment.to_json())
        self.write_authorization(server, attachment.scopes)

    def write_authorization(self, server: LocalServer, scopes: Sequence[NatsScope]) -> None:
        write_secret(server.auth_file, render_authorization(self.identities(), scopes).encode(),
                     private_parent=False)

    def add_scope(self, scope: NatsScope, keep: int = 8) -> None:
        """Render the attached servers' permissions for ``scope`` too (the newest ``keep`` scopes are kept):
        how a test server shared by tests with their own prefixes and streams enforces exact permissions."""
        with self._locked():
            attachment = self.attachment()
            if attachment is None:
                raise NatsAuthError(f"no local NATS server attached to {self.folder}")
            scopes = tuple(s for s in attachment.scopes if s != scope)[-(keep - 1):] + (scope,)
            write_secret(self.server_file, Attachment(attachment.servers, scopes).to_json())
            self._reload()

    def reload(self, timeout_s: float = 10.0) -> bool:
        """Rewrite every running attached server's authorization and have it reload; False when none runs
        (a server reads the file when it starts)."""
        with self._locked():
            return self._reload(timeout_s)

    def _reload(self, timeout_s: float = 10.0) -> bool:
        attachment = self.attachment()
        if attachment is None:
            log.warning("NATS identities in %s have no local server attached: add the new identity to your "
                        "NATS server's authorization (docs/security.md)", self.folder)
            return False
        reloaded = False
        for server in attachment.servers:
            pid = server.pid()
            if pid is None:
                continue
            self.write_authorization(server, attachment.scopes)
            before = _config_load_time(server.monitor_url)
            try:
                os.kill(pid, signal.SIGHUP)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + timeout_s
            while True:
                now = _config_load_time(server.monitor_url)
                if now is not None and now != before:
                    reloaded = True
                    break
                if time.monotonic() > deadline:
                    raise NatsAuthError(f"NATS server (pid {pid}) did not reload its authorization within "
                                        f"{timeout_s:g} s")
                time.sleep(0.02)
        return reloaded


def _config_load_time(monitor_url: str) -> str | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{monitor_url}/varz", timeout=1.0) as response:
            return str(json.loads(response.read()).get("config_load_time"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def fingerprint(identity: NatsIdentity) -> str:
    """A short, non-secret fingerprint of an identity's password (for logs and ``keel credentials ls``)."""
    return hashlib.sha256(identity.password.encode()).hexdigest()[:12]


def bus_settings_for(settings: Settings, identity: str) -> BusSettings:
    """``settings.bus`` with this process's NATS identity: ``bus.credentials`` when set; else identity
    ``identity``'s file in the credentials folder when there is one (what ``keel up`` issued); else as it is
    (a server without authorization, or the connect is refused with the reason)."""
    bus = settings.bus
    if bus.tls_ca is None and (tls_ca := server_tls_ca(credentials_path(settings))).exists():
        bus = bus.model_copy(update={"tls_ca": tls_ca})  # used only with a tls:// URL
    if bus.credentials is not None:
        return bus
    path = identity_file(credentials_path(settings), identity)
    if not path.exists():
        return bus
    return bus.model_copy(update={"credentials": path})


def server_tls_ca(credentials_dir: Path) -> Path:
    """The CA certificate of a Keel-managed NATS server's TLS (``ensure_server_tls``)."""
    return identity_dir(credentials_dir) / "shard-ca" / "tls" / "ca.pem"


def ensure_server_tls(credentials_dir: Path, hosts: Sequence[str], server: str = "nats-server") -> tuple[Path, Path, Path]:
    """``(certificate, key, CA certificate)`` for NATS server ``server`` reachable as ``hosts``, from a CA of its
    own kept under ``<credentials>/nats/`` (the shard stores' CA code, ``keel.infra.shard_ca``, for one pseudo
    job ``tls``). Clients verify the server with the CA (``bus.tls_ca``), and the servers of a cluster each other's
    routes; issued anew on every call, one key and certificate per ``server``."""
    from keel.infra.shard_ca import issue_node_certificate

    issued = issue_node_certificate(identity_dir(credentials_dir), "tls", server, hosts=tuple(hosts))
    return issued.cert, issued.key, issued.ca


ROUTE_USER = "keel-route"
"""The user a clustered Keel-managed NATS server's routes authenticate as (``route_password``)."""


def route_password_file(credentials_dir: Path) -> Path:
    return identity_dir(credentials_dir) / "cluster-route.password"


def route_password(credentials_dir: Path) -> str:
    """The password of the routes between the servers of a Keel-managed NATS cluster: generated once into
    ``<credentials>/nats/cluster-route.password`` (0600), the same for every server that shares the folder.
    A server that does not present it cannot join the cluster (its route is refused)."""
    path = route_password_file(credentials_dir)
    if not path.exists():
        ensure_private_dir(Path(credentials_dir))
        ensure_private_dir(path.parent)
        try:
            # O_EXCL through a link: two servers starting at once must not each make (and use) their own.
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            write_secret(tmp, secrets.token_urlsafe(32).encode() + b"\n")
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    password = read_secret(path).decode().strip()
    if not re.fullmatch(r"[A-Za-z0-9_-]{16,}", password):
        raise NatsAuthError(f"{path} does not hold a route password (16 or more of A-Z a-z 0-9 _ -): remove it to "
                            "generate one, then restart every server of the cluster")
    return password
