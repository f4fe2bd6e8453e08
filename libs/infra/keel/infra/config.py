"""Typed settings: defaults < YAML file < ``KEEL_*`` environment < CLI flags.

Every duration and size carries a unit (see ``keel.events.units``). A bad value anywhere fails at start
with a ``ConfigError`` that names the source, the field and the reason.

Environment variables: ``KEEL_NATS_URL``, ``KEEL_DATABASE_URL``, ``KEEL_DATABASE_PASSWORD_FILE``, ``KEEL_HOME``,
``KEEL_DB_SCHEMA`` and ``KEEL_CONFIG`` (the YAML path) are top-level; every other field is ``KEEL_<SECTION>__<FIELD>``, e.g.
``KEEL_BUS__MAX_AGE=3d`` or ``KEEL_NATS__SYNC_ALWAYS=false``.

Every field carries its documentation as an attribute docstring (``use_attribute_docstrings``: pydantic
makes it the field's ``description``); ``keel.infra.config_docs`` renders them into
``docs/configuration.md``, and a unit test fails when that page is not what the models say now.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from keel.events.units import ByteSize, Duration, parse_duration, parse_size
from keel.infra.dbroles import AUDITOR, pg_role
from keel.infra.dburl import has_password, url_user, with_credentials
from keel.infra.secrets import InsecurePathError, read_secret

if TYPE_CHECKING:
    from keel.rules.metrics import MetricSettings

_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]+$")


class ConfigError(ValueError):
    """A configuration value is missing or wrong; the message names the source, field and reason."""


class _Section(BaseModel):
    # Attribute docstrings become field descriptions: the one place a setting is documented.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class NatsSettings(_Section):
    """The embedded NATS server or cluster (ignored when ``nats_url`` or ``nats.cluster`` names external servers)."""

    cluster: list[str] = Field(default_factory=list)
    """Your own NATS cluster: every server's client URL (``nats://host:4222`` or ``tls://...``; in the environment
    comma-separated). Keel connects with all of them and moves to another when one fails. The same as a
    comma-separated ``nats_url`` (set one of the two); ``keel up`` then starts no NATS server."""
    embedded_cluster_size: int = 1
    """How many NATS servers ``keel up`` starts: 1 (one standalone server) or 3 or 5 (a JetStream cluster on
    this host, or on ``hosts``; the streams are then replicated on 3 of them: ``bus.replicas``)."""
    port: int = Field(4322, ge=1, le=65535)
    """The embedded NATS server's client port (``nats://127.0.0.1:<port>``); server ``i`` of an embedded
    cluster (from 0) uses ``port + i``, and so for ``monitor_port`` and ``cluster_port``."""
    monitor_port: int = Field(8322, ge=1, le=65535)
    """Its HTTP monitoring port; ``keel up`` waits on its ``/healthz`` for JetStream to be ready."""
    cluster_port: int = Field(6322, ge=1, le=65535)
    """An embedded cluster's route port (servers connect to each other there, authenticated with a generated
    password, over TLS when ``tls`` is on). A single server opens none."""
    hosts: list[str] = Field(default_factory=list)
    """The IP address each embedded server binds every port to: one for all, or one per server (servers on
    separate hosts). Default 127.0.0.1."""
    sync_always: bool = True
    """JetStream ``sync_interval: always``: an acknowledged publish is on disk. The single-server default."""
    tls: bool = False
    """Serve TLS only on the embedded server (``tls://``), with a certificate from a CA in the credentials folder
    that clients verify (``bus.tls_ca`` defaults to it); an embedded cluster's routes then use TLS too. Off by
    default: the embedded server listens on 127.0.0.1 only; every client authenticates either way."""

    @field_validator("cluster", "hosts", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):  # from the environment: KEEL_NATS__CLUSTER=nats://a:4222,nats://b:4222
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("cluster")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not re.fullmatch(r"(nats|tls)://[^\s,/]+:\d{1,5}", url):
                raise ValueError(f"{url!r} is not a NATS server URL: nats://host:port or tls://host:port")
        return value

    @field_validator("hosts")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        for host in value:
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ValueError(f"{host!r} is not an IP address (a server binds to an address, not a name)") from None
        return value

    @model_validator(mode="after")
    def _cluster_shape(self) -> NatsSettings:
        size = self.embedded_cluster_size
        if size not in (1, 3, 5):
            raise ValueError(f"embedded_cluster_size must be 1, 3 or 5 (a JetStream cluster needs an odd number of "
                             f"servers for a quorum), got {size}")
        if self.cluster and size != 1:
            raise ValueError("cluster names your own NATS servers and embedded_cluster_size asks Keel to start "
                             "some: set one of the two")
        if len(self.hosts) not in (0, 1, size):
            raise ValueError(f"hosts has {len(self.hosts)} addresses for {size} embedded servers: give one, or "
                             f"one per server")
        ranges = {"port": self.port, "monitor_port": self.monitor_port}
        if size > 1:
            ranges["cluster_port"] = self.cluster_port
        for name, base in ranges.items():
            if base + size - 1 > 65535:
                raise ValueError(f"{name} {base} + {size - 1} (one port per server) is past 65535")
            for other, other_base in ranges.items():
                if other != name and base <= other_base < base + size:
                    raise ValueError(f"{other} {other_base} falls in the ports of {name} ({base}..{base + size - 1})")
        return self

    def server_count(self) -> int:
        """How many NATS servers Keel talks to as configured here: the external cluster's, else the embedded."""
        return len(self.cluster) or self.embedded_cluster_size


class PostgresSettings(_Section):
    """The embedded PostgreSQL server (ignored when ``database_url`` is set)."""

    port: int = Field(5433, ge=1, le=65535)
    """The embedded PostgreSQL server's TCP port (it listens on 127.0.0.1 only)."""


class DatabaseUrls(_Section):
    """Per-role database URLs for an external PostgreSQL (``keel.infra.dbroles``: each service connects as its
    role, never as the owner). A role without one here uses ``database_url``. Ignored by the embedded server,
    whose roles and passwords Keel makes itself (``<credentials>/postgres/``)."""

    migrate: str | None = None
    """The owner of the event store's tables, the only role that runs DDL: ``keel migrate``, ``keel-migrate``
    and ``keel up``'s migrate step (role ``keel_migrate``, or any role that owns the tables)."""
    recorder: str | None = None
    """The recorder's: appends events, records dead letters and its read models (role ``keel_recorder``, or a
    login role that is a member of it)."""
    decider: str | None = None
    """The controller's, checkpoint broker's, analyzer's and hot-update service's: read the log, write their
    snapshots (role ``keel_decider`` or a member of it)."""
    auditor: str | None = None
    """The reporting commands' (``keel incidents``, ``keel replay``, ``keel events``, ...): read only (role
    ``keel_auditor`` or a member of it)."""


class BusSettings(_Section):
    """The JetStream stream and consumer settings shared by every service."""

    subject_prefix: str = "keel"
    """Subjects are ``<prefix>.<job>.<aggregate>.<type>``; tests use their own prefix for isolation."""
    stream: str = "KEEL"
    """The JetStream stream that holds every event (subjects ``<prefix>.>``)."""
    dlq_stream: str = "KEEL_DLQ"
    """The dead-letter stream (subjects ``<prefix>_dlq.>``): messages that are not valid events, as raw bytes
    with the reason in headers; the recorder also records them in the ``dead_letters`` table."""
    max_age: Duration = parse_duration("7d")
    """Stream retention: Postgres is the system of record, the stream is a durable buffer in front of it."""
    max_bytes: ByteSize = parse_size("2GiB")
    """Per stream. JetStream reserves this much file storage up front, so it must fit the disk. At this limit
    the events stream refuses new events (discard-new: publishers back off and keep them) until the recorder
    has stored and purged older ones; size it for the event rate times the longest recorder or PostgreSQL
    outage to ride through without back-pressure (2.2 events/s per node of ~500 B: 1,000 nodes fill 2 GiB
    in about 30 min)."""
    replicas: int | None = Field(None, ge=1, le=5)
    """JetStream stream replicas. Unset: 3 (R3) when Keel talks to 3 or more NATS servers (an embedded cluster,
    ``nats.cluster``, or a comma-separated ``nats_url``), else 1. An R3 stream acknowledges an event once two of
    its three servers have it: one server lost or cut off loses no acknowledged event."""
    duplicate_window: Duration = parse_duration("2m")
    """JetStream dedup window on ``Nats-Msg-Id``: redelivered decisions inside it are dropped by the server."""
    max_event_bytes: ByteSize = parse_size("256KiB")
    """Largest accepted event; larger ones go to the dead-letter stream. Below NATS's 1 MiB max_payload."""
    ack_wait: Duration = parse_duration("10s")
    """How long a delivered, unacknowledged message waits before redelivery (a crashed consumer's batch)."""
    max_deliver: int = Field(10, ge=1)
    """Bounded redelivery of a message whose effect keeps failing transiently (deciders, actuators, agents);
    the recorder's consumer is unbounded: it never gives up on an event."""
    node_consumer_inactive: Duration = parse_duration("1d")
    """A node agent's durable consumer is removed by the server after this long without the agent (a node
    gone for good leaves nothing behind); an agent back after that reads its node's commands again from
    the start of the stream and ignores the expired ones."""
    publish_attempts: int = Field(5, ge=1)
    """Publish attempts on transient errors (timeouts, no responders, a reconnect) before ``PublishFailed``."""
    retry_backoff_initial: Duration = parse_duration("100ms")
    """The first wait between publish attempts; it doubles after each failed attempt..."""
    retry_backoff_max: Duration = parse_duration("5s")
    """...up to this."""
    publish_timeout: Duration = parse_duration("5s")
    """How long a publish waits for JetStream's acknowledgement before the attempt counts as failed (in a
    cluster, one that meets a stream leader's election is retried: the event is not dropped)."""
    ping_interval: Duration = parse_duration("10s")
    """How often a client pings its NATS server; after two unanswered pings it leaves that server for another
    (of a cluster) or reconnects. Catches a server that stops answering without closing the connection (a
    partitioned or frozen host)."""
    outage_tolerance: Duration = parse_duration("15m")
    """How long a publisher waits for a lost NATS connection to come back (the client reconnects on its
    own), or for the stream to have a leader again (a cluster electing one answers "no responders"), before
    ``PublishFailed``; attempts made meanwhile do not count against ``publish_attempts``. A NATS outage
    shorter than this is ridden out, not a crash."""
    credentials: Path | None = None
    """This process's NATS identity: a Keel identity file (``<credentials_dir>/nats/<name>.json``, 0600, issued
    by ``keel up`` / ``keel credentials issue``) or a NATS ``.creds`` file (JWT + nkey seed, from ``nsc``).
    Unset: services and the CLI use their role's file in ``credentials_dir`` when there is one."""
    tls_ca: Path | None = None
    """CA bundle that signed the NATS server's certificate: set it (and use a ``tls://`` URL) to connect over
    TLS with the server verified. Unset with a ``tls://`` URL: the system's CAs."""
    tls_cert: Path | None = None
    """Client certificate for servers that require mutual TLS (with ``tls_key``)."""
    tls_key: Path | None = None
    """The client certificate's private key (0600)."""

    @field_validator("subject_prefix", "stream", "dlq_stream")
    @classmethod
    def _token(cls, value: str) -> str:
        if not _TOKEN_RE.match(value):
            raise ValueError(f"must be letters, digits, '_' or '-' only, got {value!r}")
        return value


class RecorderSettings(_Section):
    """The recorder: persists every event exactly once, in commit order, with its read models."""

    batch_size: int = Field(1000, ge=1, le=100_000)
    """Most messages fetched and written in one transaction (one ``COPY`` plus the projections)."""
    fetch_timeout: Duration = parse_duration("200ms")
    """How long a fetch waits for the next message when none is there (a fetch takes what is there at once
    and never waits for a batch to fill)."""
    consumer: str = "recorder"
    """The durable JetStream consumer's name; also the recorder's row in the ``tracking`` table."""
    stream_trim_at: float = Field(0.8, gt=0, le=1)
    """The events stream refuses new events at its limit (discard-new: publishers back off and retry, never
    drop) rather than drop unrecorded ones. Once it is this full (of ``bus.max_bytes``), the recorder purges
    the oldest events it has stored..."""
    stream_trim_to: float = Field(0.5, ge=0, lt=1)
    """...down to about this fraction of the limit (never an event it has not stored). A running consumer
    further behind than that never receives the purged events (a stopped one loses nothing: a decider's
    cold start takes its unacknowledged tail from the log)."""
    stream_check_interval: Duration = parse_duration("1s")
    """How often the recorder checks how full the events stream is."""
    lag_threshold: Duration = parse_duration("10s")
    """Recorder lag (now minus the arrival in the stream of the oldest event not yet stored) above which it
    publishes ``RecorderLagReported``; it reports again when the lag falls back below."""
    lag_report_interval: Duration = parse_duration("1m")
    """While the lag stays above ``lag_threshold``, a ``RecorderLagReported`` this often."""

    @model_validator(mode="after")
    def _trim_below_threshold(self) -> RecorderSettings:
        if self.stream_trim_to >= self.stream_trim_at:
            raise ValueError(f"stream_trim_to ({self.stream_trim_to}) must be below stream_trim_at "
                             f"({self.stream_trim_at})")
        return self


class ControllerSettings(_Section):
    """The controller: the escalation ladder's timeouts, its guardrails and the warm-standby pool."""

    observe_only: bool = False
    """Observe mode: decide and record, execute nothing."""
    command_ttl: Duration = parse_duration("5m")
    """Every command expires; a cold start never executes a stale one."""
    diagnostics_timeout: Duration = parse_duration("60s")
    """Stop-time diagnostics: a node that has not reported within this is treated as failed."""
    stack_analysis: bool = True
    """Rung 3: a hang first gets every training process's stack captured and judged by the analyzer."""
    stacks_timeout: Duration = parse_duration("10s")
    """Agents answer a stack capture within this; the analyzer judges without the rest."""
    all_blocked_hang_after: Duration = parse_duration("5s")
    """A job every rank of which has been inside a collective at once this long is hung (rung 3): nobody is
    computing or loading data for the others to wait on. The nodes' heartbeats say which ranks are inside one
    (an agent all of whose ranks have been inside one for 5 s sends one every second: below 5 s, a call waits
    for the regular heartbeats). Raise it for a job one of whose collectives
    legitimately takes longer once every rank has entered it; 0s turns it off (the agents' per-rank
    ``collective_stuck`` check remains)."""
    stacks_verdict_timeout: Duration = parse_duration("20s")
    """No verdict from the analyzer this long after a capture was asked for: go on to rung 2."""
    sdc_replay: bool = True
    """Rung 5: a NaN or spike that stop-time diagnostics do not explain is replayed to locate the machine."""
    sdc_replay_timeout: Duration = parse_duration("60s")
    """Nodes answer a replay round within this (the analyzer judges without the rest); no verdict 30 s
    after that: restart in place, below the anomaly."""
    diagnostics_ack_timeout: Duration = parse_duration("2s")
    """A node of a diagnostics or stack capture round whose agent sent nothing since the request for this
    long is lost (agents answer a request with a heartbeat at once): a diagnostics round ends without
    waiting for it, a capture round evicts it; neither when half the round or more is silent or the
    controller's clock had a gap since the request."""
    peer_loss_silence: Duration = parse_duration("3s")
    """A node its peers' ranks cannot reach (their connections to its address keep retransmitting) is
    evicted at rung 1 once its agent has sent nothing for this long, and nothing since the report; a node
    that keeps heartbeating is never evicted on a peer's report."""
    recovery_timeout: Duration = parse_duration("10m")
    """A restart that has not brought the job back to stepping this long after it was decided stops the
    job and pages a human (the ``recovering`` stage never waits for ever)."""
    process_settle_interval: Duration = parse_duration("5s")
    """A job whose ranks never report through the SDK (no step is ever seen): its incident is resolved once
    every rank of the restarted generation has been running this long (process-level, coarser: a rank
    that runs but hangs counts as recovered)."""
    node_silence_timeout: Duration = parse_duration("30s")
    """A node of a running job the controller has not heard from this long is lost (rung 1). Judged on the
    controller's recorded clock (when the node's events arrive, between two job-clock ticks), never on the
    node's own timestamps, and only over time the clock was running."""
    clock_skew_allowance: Duration = parse_duration("5s")
    """How far a node's timestamps may lie from the controller's recorded clock before the controller
    reports it (``NodeClockSkewed``, once per crossing; reported, never acted on). Also how much later
    than ``clock_interval`` a tick may come before the job clock counts as interrupted (silence is then
    judged from the first tick after the gap)."""
    clock_interval: Duration = parse_duration("1s")
    """How often the job clock (hosted by the controller) records a ``TimerTicked`` for each live job."""
    clock_quiet_interval: Duration = parse_duration("5s")
    """The job clock's interval for a quiet job: no incident, and no input but routine reports
    (heartbeats, shard reports, commits, ticks) for ``clock_busy_window``. Deadlines of a quiet job (a
    node's silence, mostly) are then decided up to this late; set it to ``clock_interval`` to tick every
    job at that rate. A busy job is ticked every ``clock_interval``."""
    clock_busy_window: Duration = parse_duration("60s")
    """How long after a job's latest input other than a routine report the job clock ticks it every
    ``clock_interval`` (another decider may wait on a short deadline it started: a restore plan, a
    diagnostics round)."""
    clock_linger: Duration = parse_duration("10m")
    """How long the job clock keeps ticking a job after its last input (any event but a tick), even when
    the controller itself needs no time for it: another decider may still wait on a deadline (the
    checkpoint broker's restore plan after a human restarts a stopped job)."""
    eviction_window: Duration = parse_duration("1h")
    """The eviction circuit breaker's sliding window (past its limits: stop and page)."""
    max_evictions: int = Field(8, ge=1)
    """The eviction circuit breaker: at most this many evictions per window..."""
    max_eviction_fraction: float = Field(0.1, gt=0, le=1)
    """...and at most this fraction of the job's nodes (at least one is always allowed)."""
    restart_window: Duration = parse_duration("1h")
    """The crash-loop breaker's sliding window for ``restart_budget``."""
    restart_budget: int = Field(10, ge=1)
    """Job-wide restarts per window before the job is stopped and a human paged."""
    max_same_failure: int = Field(3, ge=2)
    """The same failure fingerprint this many times in a row (no progress between) is a crash loop: rung 6,
    stop and page."""
    approval_required: list[str] = Field(default_factory=list)
    """Action kinds that wait for `keel approve`: evict, restart, diagnose, rollback."""
    standby_min: int = Field(0, ge=0)
    """Keep at least this many warm standbys, whatever the binomial model says."""
    standby_replacement_window: Duration = parse_duration("1h")
    """How long a failed machine takes to come back: the window of the standby pool's binomial model."""
    shrink_without_standby: bool = False
    """No ready standby for an evicted node: go on with the nodes left as a smaller job, the checkpoint
    resharded onto them, instead of waiting for the pool. Off by default: the training script must load
    onto another world size (docs/checkpointing.md, "Shrink instead of stop")."""
    shrink_min_nodes: int = Field(1, ge=1)
    """A shrink never leaves fewer nodes than this (the job waits for a standby instead)."""
    shrink_node_multiple: int = Field(1, ge=1)
    """A shrink keeps the node count a multiple of this: the nodes one pipeline or tensor-parallel group spans."""


class CheckpointSettings(_Section):
    """The checkpoint broker: the persistent tier, its schedule (Young's formula) and restore planning."""

    persist_root: Path | None = None
    """Root of the persistent tier (``<root>/<job>/step-<s:09d>/rank-<r:05d>.shard`` and ``manifest.json``),
    the same path for the nodes and the broker; unset: ``<home>/checkpoints``."""
    retention: int = Field(3, ge=1)
    """Committed steps (manifests) kept per job; older step directories are removed."""
    persist_every_floor: int = Field(10, ge=1)
    """Fewest steps between two persists (K's lower clamp), in steps."""
    persist_every_ceiling: int = Field(1000, ge=1)
    """Most steps between two persists (K's upper clamp), in steps."""
    initial_save_cost: Duration = parse_duration("5s")
    """Young's C before any persist was measured."""
    mtbf_prior: Duration = parse_duration("4h")
    """Young's MTBF prior: MTBF = (observed time + prior) / (failures + 1)."""
    restore_plan_timeout: Duration = parse_duration("10s")
    """How long the broker waits for every node's inventory before planning with what arrived."""
    restore_plan_max_wait: Duration = parse_duration("60s")
    """How long the broker waits at most (from the first inventory) when planning after
    ``restore_plan_timeout`` would restore a step older than the newest memory or peer commit while a
    node not known lost has not reported (survivors stopping their ranks answer later than a promoted
    standby, which has none to stop). Below ``restore_plan_timeout``: no longer wait."""
    report_interval: Duration = parse_duration("1s")
    """How often agents report stored shards (and how often the broker looks again for a shard file it cannot see yet)."""
    backup_max_duty: float = Field(0.1, gt=0, le=1)
    """The share of wall time one rank's backup transfer may take: the broker sets the backup interval
    (the same on every node, a power of two) to the smallest one that keeps the slowest transfer
    within it. 1.0: back to back (every step while transfers are shorter than a step)."""
    backup_min_period: Duration = parse_duration("500ms")
    """The shortest time between two backup rounds: the floor of the backup interval. A round then
    commits well before the next begins, and a fast rank's store is rarely two rounds past a slow
    rank's delivery (a group lost then leaves no common peer step: the restore falls back to disk)."""

    store_address: str = ""
    """``HOST:PORT`` each node's shard store binds when ``keel run`` is given no ``--keel-store-address``
    (port 0: a free one). Empty: ``127.0.0.1:0`` on a one-node job; on several nodes, the address of the
    interface that reaches the rendezvous master (``--master-addr``), port 0. ``0.0.0.0`` only if set here
    or on the command line: the store then listens on every interface (mTLS still required)."""
    store_max_shard_bytes: ByteSize = parse_size("64GiB")
    """The largest backup a shard store accepts in one stream (a rank's snapshot)."""
    store_peer_quota: ByteSize = parse_size("128GiB")
    """What one peer's backups may take in a node's shard store, every copy kept (newest, previous, the
    committed step's) and the streams in flight; a backup past it is refused (RESOURCE_EXHAUSTED)."""
    store_total_quota: ByteSize = parse_size("512GiB")
    """What all peers' backups together may take in a node's shard store (its shared-memory folder)."""
    store_max_streams: int = Field(32, ge=1)
    """Streams (backups arriving, shards being fetched) a shard store serves at once."""
    store_max_streams_per_peer: int = Field(8, ge=1)
    """Streams a shard store serves at once to one peer."""

    @model_validator(mode="after")
    def _floor_below_ceiling(self) -> CheckpointSettings:
        if self.persist_every_floor > self.persist_every_ceiling:
            raise ValueError(f"persist_every_floor ({self.persist_every_floor}) must not exceed "
                             f"persist_every_ceiling ({self.persist_every_ceiling})")
        return self

    def resolved_persist_root(self, home: Path) -> Path:
        return (self.persist_root or home / "checkpoints").expanduser()


class AnalyzerSettings(_Section):
    """The analyzer's fail-slow rounds (rung 3 without a hang): step-time evidence every ``failslow_interval``,
    a conviction when one group was flagged most over the last ``failslow_rounds`` rounds; and the
    thresholds of metric anomalies, which every node agent checks on its ranks' reports."""

    failslow_interval: Duration = parse_duration("10s")
    """How often a fail-slow round compares the ranks' compute times."""
    failslow_rounds: int = Field(5, ge=1)
    """Rounds judged together: a conviction needs this many rounds in."""
    failslow_min_flags: int = Field(2, ge=1)
    """The fewest flags (of those rounds) that convict."""
    failslow_ratio: float = Field(1.15, gt=1)
    """A rank is flagged when it computes this many times longer per step than the median of its DP peers
    (or its modified z-score says so, and it is at least 5 % slower)."""
    failslow_warmup: Duration = parse_duration("30s")
    """A generation's first steps (after the job's start or a restart) that no round judges (at least one
    interval), counted from its first step: the first steps after a start or a restore run slower on some
    ranks than on others."""
    metric_spike_factor: float = Field(5.0, gt=1)
    """Metric anomalies (checked by each node agent): a loss or gradient norm above this many times the
    median of its previous ``metric_spike_window`` values is a spike."""
    metric_spike_window: int = Field(20, ge=1)
    """How many previous values (steps) a spike is judged against."""
    metric_warmup_steps: int = Field(10, ge=0)
    """Steps neither judged for spikes nor part of a baseline (losses fall steeply early on)."""
    metric_decline_window: int = Field(50, ge=1)
    """Steps per window of the throughput-decline check (tokens/s): the last window against the best earlier
    one. A decline alone is recorded, not acted on."""
    metric_decline_fraction: float = Field(0.8, gt=0, lt=1)
    """Tokens/s whose last window's median is below this fraction of its best earlier window's declined."""

    def metric_settings(self) -> MetricSettings:
        """These thresholds as the analyzer's ``MetricSettings`` (``ValueError`` when they disagree)."""
        from keel.rules.metrics import MetricSettings

        return MetricSettings(spike_factor=self.metric_spike_factor, spike_window=self.metric_spike_window,
                              warmup_steps=self.metric_warmup_steps, min_history=min(5, self.metric_spike_window),
                              decline_window=self.metric_decline_window,
                              decline_fraction=self.metric_decline_fraction)

    @model_validator(mode="after")
    def _flags_within_rounds(self) -> AnalyzerSettings:
        if self.failslow_min_flags > self.failslow_rounds:
            raise ValueError(f"failslow_min_flags ({self.failslow_min_flags}) must not exceed failslow_rounds "
                             f"({self.failslow_rounds})")
        return self


class HotUpdateSettings(_Section):
    """Code versions (``keel deploy``) and their rollout by the hot-update service."""

    stable_steps: int = Field(500, ge=1)
    """A version that ran this many steps since it was applied without an incident it could have caused is
    stable (rung 4 rolls back to the newest stable version)..."""
    stable_time: Duration = parse_duration("30m")
    """...or that ran this long."""
    default_deadline: Duration = parse_duration("24h")
    """A lazy version with no restart to ride on is forced this long after its deploy."""
    validate_timeout: Duration = parse_duration("120s")
    """How long validating a version (importing its entry point in a fresh interpreter) may take."""
    versions_dir: Path | None = None
    """The version store (default ``<home>/versions``): ``<sha256>/`` folders, read-only once published, in a
    folder writable by its owner alone. Agents must see the same path: they run a code version only from
    this folder, after re-hashing it (docs/hot-update.md)."""

    def resolved_versions_dir(self, home: Path) -> Path:
        return (self.versions_dir or home / "versions").expanduser()


class SigningSettings(_Section):
    """Signed events (``keel.events.signing``, docs/security.md): the controller, broker, analyzer, hot-update
    and actuator sign what they decide, operators what they approve, cordon and deploy; whoever acts on one
    checks it against the public keyring first. Keys live in ``<credentials>/signing/``."""

    keyring: Path | None = None
    """The public keyring consumers check signatures against (default ``<credentials>/signing/keyring.json``,
    which ``keel up`` and each service's first start fill). On a multi-host deployment, point the agents of
    every host at a copy of the control plane's keyring (public keys only: no secret in it)."""
    operator: str | None = None
    """The identity the CLI signs operator events (``keel approve``, ``keel cordon``, ``keel deploy``) with, and
    so their ``by``: default your login name. Its key is ``<credentials>/signing/<operator>.key``."""


class SupervisorSettings(_Section):
    """``keel up``'s supervisor (``keel supervise``): restarts a control-plane service that exits."""

    restart_backoff_initial: Duration = parse_duration("1s")
    """The wait before the first restart of a service that exited; it doubles with each restart since the
    service last ran healthy..."""
    restart_backoff_max: Duration = parse_duration("30s")
    """...up to this."""
    healthy_after: Duration = parse_duration("60s")
    """A service that ran this long before it exited was healthy: its back-off starts over."""
    crash_loop_restarts: int = Field(5, ge=1)
    """A service that exits again after this many restarts within ``crash_loop_window`` is crash-looping:
    the supervisor gives up on it (``ServiceGaveUp``, a log line, ``keel status``) until ``keel up``..."""
    crash_loop_window: Duration = parse_duration("5m")
    """...this window."""
    stop_timeout: Duration = parse_duration("10s")
    """``keel down``: how long a service may take to stop after SIGTERM before it is killed."""

    @model_validator(mode="after")
    def _backoff_order(self) -> SupervisorSettings:
        if self.restart_backoff_initial.total_seconds() <= 0:
            raise ValueError("restart_backoff_initial must be positive")
        if self.restart_backoff_max < self.restart_backoff_initial:
            raise ValueError(f"restart_backoff_max ({self.restart_backoff_max}) is below restart_backoff_initial "
                             f"({self.restart_backoff_initial})")
        if self.crash_loop_window.total_seconds() <= 0:
            raise ValueError("crash_loop_window must be positive")
        return self


class SlurmActuatorSettings(_Section):
    """The ``slurm`` actuator (``keel.actuator.slurm``): drains evicted nodes, finds and requests standbys."""

    conf: Path | None = None
    """The cluster's ``slurm.conf`` for Slurm's commands (``SLURM_CONF``; default: Slurm's own, usually
    ``/etc/slurm/slurm.conf``)."""
    partition: str | None = None
    """The partition standby jobs are submitted to (default: Slurm's default partition)."""
    job_id: str | None = None
    """The Slurm job id of the training job's allocation: its nodes past ``workers`` are the standbys
    ``keel run`` started there (``--nnodes`` below the allocation's node count)."""
    workers: int | None = Field(None, ge=1)
    """How many of the allocation's nodes run ranks (``keel run --nnodes``); the rest are standbys."""
    standby_command: list[str] = Field(default_factory=list)
    """What a refill submits (``sbatch --wrap``) on each new node, e.g. ``["srun", "keel", "run",
    "--keel-standby", "--nnodes", "4", "train.py"]``: without it a refill is reported failed."""
    command_timeout: Duration = parse_duration("30s")
    """How long one Slurm command (``scontrol``, ``squeue``, ``sbatch``) may take before the action fails."""

    @field_validator("standby_command", mode="before")
    @classmethod
    def _command_from_text(cls, value: Any) -> Any:
        # From the environment a list comes as text: JSON list syntax, nothing else (a command line split
        # on spaces would break quoted arguments).
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except ValueError:
                raise ValueError('give the command as a JSON list of strings, e.g. ["srun", "keel", "run"]') from None
            return parsed
        return value


class KubernetesActuatorSettings(_Section):
    """The ``kubernetes`` actuator (``keel.actuator.kubernetes``): cordons evicted nodes, scales the standby set."""

    namespace: str = "default"
    """The namespace of the job's standby Deployment (the job's pods are found in every namespace by their
    ``keel.dev/job`` label)."""
    standby_deployment: str = "keel-standby"
    """The Deployment of standby agent pods (labels ``keel.dev/job=<job>``, ``keel.dev/role=standby``) a refill scales up."""
    server: str | None = None
    """The API server (``https://host:port``); default: in the cluster, from ``KUBERNETES_SERVICE_HOST``/``_PORT``."""
    token_file: Path | None = None
    """A bearer token file for ``server``; default: the pod's service account token."""
    ca_file: Path | None = None
    """The API server's CA for ``server``; default: the pod's service account CA."""
    request_timeout: Duration = parse_duration("30s")
    """How long one API call may take before the action fails."""


class ActuatorSettings(_Section):
    """Where the machines are: the actuator service carries the controller's evictions and refills out there."""

    kind: str = "local"
    """``local`` (the agents of ``keel cluster up`` on this machine), ``slurm`` (Slurm nodes: drain, standby
    jobs) or ``kubernetes`` (cordon, taint and label nodes, delete the job's pods, scale the standby set;
    checked against the API's published schema only: see docs/deploy.md)."""
    slurm: SlurmActuatorSettings = SlurmActuatorSettings()
    """The ``slurm`` actuator's settings (used when ``kind`` is ``slurm``)."""
    kubernetes: KubernetesActuatorSettings = KubernetesActuatorSettings()
    """The ``kubernetes`` actuator's settings (used when ``kind`` is ``kubernetes``)."""

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        if value not in ("local", "slurm", "kubernetes"):
            raise ValueError(f"unknown actuator kind {value!r} (local, slurm, kubernetes)")
        return value


def _json_list_from_text(value: Any, what: str, example: str) -> Any:
    """From the environment a list of objects comes as text: JSON (``KEEL_API__TOKENS='[{...}]'``). Anything else
    is passed on as it is, to be validated as the list it should be."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError(f"give {what} as a JSON list of objects, e.g. {example}") from None
    return value


class NotifierDestinationSettings(_Section):
    """One place notifications go (``notifier.destinations``)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """A name of your choice: the delivery log and the service's log name destinations by it, never by URL."""
    kind: str
    """``slack`` (an incoming webhook), ``pagerduty`` (Events API v2) or ``webhook`` (signed per Standard Webhooks)."""
    url: str = ""
    """Where to POST: the webhook's URL; PagerDuty's events endpoint (default
    ``https://events.pagerduty.com/v2/enqueue``). A Slack incoming webhook's URL is a secret: give it in
    ``url_file`` instead."""
    url_file: Path | None = None
    """A private file holding the URL (a Slack incoming webhook's)."""
    secret_file: Path | None = None
    """A private file holding the secret: PagerDuty's routing (integration) key, or the webhook's signing secret
    (``whsec_<base64>`` as Standard Webhooks libraries issue them, or any string). Required for both."""
    min_severity: str = "warning"
    """The least severity sent here: ``info`` (also recoveries), ``warning`` (incidents, approvals, held
    actions, rollbacks) or ``critical`` (a job stopped at rung 6). PagerDuty is always sent the resolution of an
    incident it was sent."""
    kinds: list[str] = Field(default_factory=list)
    """Only these notification kinds (``incident_opened``, ``incident_resolved``, ``approval_requested``,
    ``action_held``, ``job_stopped``, ``rollback``); empty: all."""
    jobs: list[str] = Field(default_factory=list)
    """Only these training jobs; empty: all."""
    rate_per_minute: float = Field(30.0, gt=0)
    """At most this many deliveries a minute (bursts of 5); more wait their turn, none is dropped."""
    approval_buttons: bool = False
    """``slack``: an approval request's message carries Approve and Deny buttons. Turn it on once the Slack app's
    interactivity points at the API's ``/v1/chatops/slack`` and ``api.chatops`` is set (docs/notifications.md)."""

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        if value not in ("slack", "pagerduty", "webhook"):
            raise ValueError(f"unknown destination kind {value!r} (slack, pagerduty, webhook)")
        return value

    @field_validator("min_severity")
    @classmethod
    def _known_severity(cls, value: str) -> str:
        if value not in ("info", "warning", "critical"):
            raise ValueError(f"unknown severity {value!r} (info, warning, critical)")
        return value

    @field_validator("kinds")
    @classmethod
    def _known_kinds(cls, value: list[str]) -> list[str]:
        known = ("incident_opened", "incident_resolved", "approval_requested", "action_held", "job_stopped", "rollback")
        unknown = [k for k in value if k not in known]
        if unknown:
            raise ValueError(f"unknown notification kind(s) {unknown} ({', '.join(known)})")
        return value

    @model_validator(mode="after")
    def _complete(self) -> NotifierDestinationSettings:
        if self.url and self.url_file:
            raise ValueError(f"destination {self.name}: give url or url_file, not both")
        if self.kind == "slack" and not self.url_file:
            raise ValueError(f"destination {self.name}: a Slack incoming webhook's URL is a secret: put it in url_file")
        if self.kind == "webhook" and not (self.url or self.url_file):
            raise ValueError(f"destination {self.name}: a webhook destination needs url (or url_file)")
        if self.kind in ("pagerduty", "webhook") and self.secret_file is None:
            raise ValueError(f"destination {self.name}: a {self.kind} destination needs secret_file "
                             f"({'the routing key' if self.kind == 'pagerduty' else 'the signing secret'})")
        return self


class NotifierSettings(_Section):
    """The notifier service: incidents, approvals, held actions, stops and rollbacks sent to people."""

    destinations: list[NotifierDestinationSettings] = Field(default_factory=list)
    """Where notifications go (none: the notifier consumes and logs, delivering nothing)."""
    request_timeout: Duration = parse_duration("10s")
    """How long one delivery may take before it counts as no answer (and is tried again)."""
    retry_base: Duration = parse_duration("1s")
    """The first back-off after a failed delivery; it doubles with each attempt..."""
    retry_max_backoff: Duration = parse_duration("60s")
    """...up to this (a receiver's ``Retry-After`` is honoured instead when it sends one)."""
    give_up_after: Duration = parse_duration("1h")
    """A delivery still failing this long after its first attempt is given up (recorded as failed)."""

    @field_validator("destinations", mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        return _json_list_from_text(value, 'the destinations', '[{"name": "hook", "kind": "webhook", "url": '
                                    '"https://...", "secret_file": "/etc/keel/hook.secret"}]')


class ApiTokenSettings(_Section):
    """One bearer token of the HTTP API (``api.tokens``): its name, scope and SHA-256 digest, never the token."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.@-]{1,64}$")
    """Who holds it (a person or a tool): the API's log names the caller by it."""
    scope: Literal["read", "operator"] = "read"
    """``read``: every query. ``operator``: the queries and the actions (approvals, cordons), signed as ``identity``."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """The token's SHA-256 digest in hex (``keel-api --new-token NAME`` makes a token and prints its entry)."""
    identity: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
    """An operator token's signing identity (role ``operator``; default: the token's name): the API signs the
    token's actions with its key in ``<credentials>/signing/``, and the events name it as who acted. The API does
    not start when the key is missing (``keel-api --new-token NAME --scope operator`` creates it). A read token
    has none."""

    @model_validator(mode="after")
    def _identity_for_operators(self) -> ApiTokenSettings:
        if self.identity is not None and self.scope != "operator":
            raise ValueError(f"token {self.name!r}: only an operator token has a signing identity (a read token "
                             "cannot act)")
        return self


class ChatOpsCallbackSettings(_Section):
    """A tool that may answer approval requests through ``POST /v1/chatops/callback/<name>`` (``api.chatops.callbacks``),
    signing each request per Standard Webhooks with its secret."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """The callback's name: its URL's last part and what the log records as the channel (``webhook:<name>``)."""
    secret_file: Path
    """A private file (0600) holding the signing secret (``whsec_<base64>``, or any string of 16 characters or more)."""
    approvers: list[str] = Field(default_factory=list)
    """The operator names this tool may answer as; a request naming anyone else is refused. Empty: none."""


class ChatOpsSettings(_Section):
    """Chat-ops approvals served by the API: Slack's buttons and signed callbacks answer held actions
    (docs/api.md). Off unless a Slack signing secret or a callback is configured."""

    slack_signing_secret_file: Path | None = None
    """A private file (0600) holding the Slack app's signing secret (Basic Information, App Credentials): turns on
    ``POST /v1/chatops/slack``."""
    slack_approvers: dict[str, str] = Field(default_factory=dict)
    """Slack user id -> the operator name an answer is recorded under (``{"U024BE7LH": "alice"}``). A press by
    anyone else is refused and publishes nothing."""
    slack_response_url_prefix: str = "https://hooks.slack.com/"
    """The outcome is posted back to the message's ``response_url`` only when it starts with this."""
    callbacks: list[ChatOpsCallbackSettings] = Field(default_factory=list)
    """Signed generic callbacks (Standard Webhooks) for tools other than Slack."""
    timestamp_tolerance: Duration = parse_duration("5m")
    """A request whose signed timestamp is further than this from the API's clock is refused (expired or
    replayed)."""
    signing_identity: str = Field("chatops", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
    """The API's chat-ops signing identity (role ``chatops``, which may sign ``ApprovalGiven`` only) and the API's
    NATS identity (which may publish ``ApprovalGiven`` and ``NodeCordoned`` only: chat-ops answers and operator
    tokens' actions, the latter signed by each token's operator key). Its key is created on the first start, in
    ``<credentials>/signing/``."""

    @field_validator("slack_signing_secret_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # docker-compose.yml passes ${KEEL_API__CHATOPS__SLACK_SIGNING_SECRET_FILE:-}: empty means no Slack.
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("slack_approvers", mode="before")
    @classmethod
    def _approvers_from_text(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            return {}
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f'the Slack approvers as JSON, {{"U024BE7LH": "alice"}}: {exc}') from None
        return value

    @field_validator("callbacks", mode="before")
    @classmethod
    def _callbacks_from_text(cls, value: Any) -> Any:
        return _json_list_from_text(value, "the callbacks", '[{"name": "pager", "secret_file": "/etc/keel/pager.secret", '
                                    '"approvers": ["alice"]}]')

    @model_validator(mode="after")
    def _checked(self) -> ChatOpsSettings:
        for user, name in self.slack_approvers.items():
            if not re.fullmatch(r"[UW][A-Z0-9]{2,20}", user):
                raise ValueError(f"slack_approvers: {user!r} is not a Slack user id (U... or W...)")
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}", name):
                raise ValueError(f"slack_approvers: {name!r} is not an operator name")
        if self.timestamp_tolerance.total_seconds() <= 0:
            raise ValueError("timestamp_tolerance must be positive")
        names = [c.name for c in self.callbacks]
        if len(set(names)) != len(names):
            raise ValueError("callbacks: two share a name")
        return self

    @property
    def enabled(self) -> bool:
        return self.slack_signing_secret_file is not None or bool(self.callbacks)


class ApiSettings(_Section):
    """The HTTP API (``keel-api``): queries over the event store behind bearer tokens, approvals and cordons for
    operator tokens, and chat-ops approvals when ``chatops`` is set."""

    listen_host: str = "127.0.0.1"
    """The address it listens on (only this machine by default: put a TLS proxy in front to serve others)."""
    listen_port: int = Field(8380, ge=0, le=65535)
    """Its TCP port; 0: a free one, chosen at start (``keel up`` prints the URL it got)."""
    serve_with_up: bool = True
    """``keel up`` starts the API with the services, with a local operator token (``keel up`` prints where)."""
    tokens: list[ApiTokenSettings] = Field(default_factory=list)
    """Who may call it (``{"name", "scope", "sha256"}``, and an operator token's signing ``identity``). None: every
    request but ``/healthz`` is refused, saying so. An operator token makes the API connect to NATS too."""
    max_page: int = Field(1000, ge=1, le=100_000)
    """The most events or audit rows one request returns (``limit`` is capped at it)."""
    workers: int = Field(0, ge=0, le=64)
    """Processes serving requests on the one port (each reads the store on its own); 0: two, or one on a machine
    of one CPU. A request is Python work in one process: a second lets a slow page not hold up the rest."""
    parsed_events_kept: int = Field(5_000, ge=0, le=1_000_000)
    """Events each process keeps parsed for the listings and timelines (the least recently read dropped first; a
    few KB each): the page polls the same incidents, and a page of 100 costs about 300 parses otherwise. 0: none."""
    chatops: ChatOpsSettings = Field(default_factory=ChatOpsSettings)
    """Chat-ops approvals (Slack's buttons, signed callbacks): the API then also connects to NATS to publish the
    answers."""

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens_from_text(cls, value: Any) -> Any:
        return _json_list_from_text(value, "the tokens", '[{"name": "oncall", "scope": "read", "sha256": "<64 hex digits>"}]')


class SnapshotSettings(_Section):
    """Deciders' snapshots (``keel.kernel.snapshot``): a cold start folds the newest one plus the log after it."""

    enabled: bool = True
    """Write and load snapshots. Off: every cold start folds the whole log."""
    interval: Duration = parse_duration("10m")
    """How often a running decider folds the log it has acknowledged into a new snapshot (in the background,
    from its newest snapshot); also done at every cold start."""
    min_events: int = Field(10_000, ge=1)
    """A new snapshot is written only when at least this many events were folded since the newest one."""
    keep: int = Field(3, ge=1)
    """Snapshots kept per decider; older ones are deleted."""


class Settings(_Section):
    """All of Keel's settings. Build with ``load_settings``; never read the environment elsewhere."""

    home: Path = Field(default_factory=lambda: default_home())
    """Where ``keel up`` keeps its servers' data, logs and pid files (default ``~/.keel``; as root
    ``/var/lib/keel``, which the embedded PostgreSQL's unprivileged account can reach)."""
    nats_url: str | None = None
    """Use this NATS server instead of the embedded one (e.g. ``nats://host:4222``)."""
    database_url: str | None = None
    """Use this PostgreSQL instead of the embedded one (e.g. ``postgresql://keel_recorder@host:5432/keel?sslmode=verify-full&sslrootcert=/etc/keel/db-ca.pem``):
    the URL of the role this process connects as (``database_urls`` overrides it per role). libpq's TLS
    parameters are understood: ``sslmode`` (``disable``, ``prefer``, ``require``, ``verify-ca``, ``verify-full``),
    ``sslrootcert`` (a CA file, or ``system``), ``sslcert``, ``sslkey``, ``sslpassword``, ``sslcrl``."""
    database_password_file: Path | None = None
    """A file holding the password for ``database_url`` (when the URL has none): a Docker or Kubernetes secret,
    so the password is in no environment variable and no settings file."""
    database_urls: DatabaseUrls = DatabaseUrls()
    db_schema: str = "public"
    """The PostgreSQL schema of the event store and read models (a lower-case SQL identifier)."""
    credentials_dir: Path | None = None
    """Where Keel keeps the secrets it generates (0700; every file in it 0600): NATS identities, signing keys,
    the shard stores' certificate authority, database passwords. Default ``<home>/credentials``
    (``credentials_path`` resolves it). One sub-folder per subsystem: ``nats/``, ``signing/``, ``shard-ca/``,
    ``postgres/``."""
    nats: NatsSettings = NatsSettings()
    postgres: PostgresSettings = PostgresSettings()
    bus: BusSettings = BusSettings()
    recorder: RecorderSettings = RecorderSettings()
    controller: ControllerSettings = ControllerSettings()
    checkpoint: CheckpointSettings = CheckpointSettings()
    analyzer: AnalyzerSettings = AnalyzerSettings()
    hot_update: HotUpdateSettings = HotUpdateSettings()
    supervisor: SupervisorSettings = SupervisorSettings()
    signing: SigningSettings = SigningSettings()
    snapshots: SnapshotSettings = SnapshotSettings()
    actuator: ActuatorSettings = ActuatorSettings()
    """The actuator service: which kind of machines it acts on, and that kind's settings."""
    notifier: NotifierSettings = NotifierSettings()
    api: ApiSettings = ApiSettings()
    inspector: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the node agent's ``InspectorPolicy`` (e.g. ``step_timeout_floor: 25s``), checked
    by the agent at start: an unknown key or a value without its unit stops it with the reason."""
    diagnostics: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the node agent's stop-time ``DiagnosticsPolicy`` (``keel.agent.diagnostics``; e.g.
    ``min_bandwidth_gbps: 100``, ``matmul_rtol: 1e-4``), checked by the agent at start like ``inspector``."""

    @model_validator(mode="before")
    @classmethod
    def _derive_cluster(cls, data: Any) -> Any:
        """``nats.cluster`` into ``nats_url`` (comma-separated: what every client and service is given), and
        ``bus.replicas`` from the number of NATS servers when it is not set."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        nats = data.get("nats")
        try:
            nats_settings = nats if isinstance(nats, NatsSettings) else NatsSettings.model_validate(nats or {})
        except ValidationError:
            return data  # reported with its field when the section itself is validated
        if nats_settings.cluster:
            joined = ",".join(nats_settings.cluster)
            url = data.get("nats_url")
            if url and [u.strip() for u in str(url).split(",")] != nats_settings.cluster:
                raise ValueError(f"nats_url ({url}) and nats.cluster ({joined}) both name NATS servers: set one")
            data["nats_url"] = joined
        url = data.get("nats_url")
        servers = len([u for u in str(url).split(",") if u.strip()]) if url else nats_settings.server_count()
        bus = data.get("bus")
        if isinstance(bus, BusSettings):
            if bus.replicas is None:
                data["bus"] = bus.model_copy(update={"replicas": 3 if servers >= 3 else 1})
        elif isinstance(bus, Mapping) or bus is None:
            bus = dict(bus or {})
            if bus.get("replicas") is None:
                bus["replicas"] = 3 if servers >= 3 else 1
            data["bus"] = bus
        return data

    @model_validator(mode="after")
    def _replicas_fit(self) -> Settings:
        embedded = self.nats_url is None
        replicas = self.bus.replicas or 1
        if embedded and replicas > self.nats.embedded_cluster_size:
            raise ValueError(f"bus.replicas {replicas} needs at least {replicas} NATS servers, and keel up starts "
                             f"{self.nats.embedded_cluster_size} (nats.embedded_cluster_size)")
        return self

    @field_validator("db_schema")
    @classmethod
    def _schema_token(cls, value: str) -> str:
        if not re.match(r"^[a-z_][a-z0-9_]*$", value):
            raise ValueError(f"must be a lower-case SQL identifier, got {value!r}")
        return value


def credentials_path(settings: Settings) -> Path:
    """The credentials folder of ``settings``: ``credentials_dir``, else ``<home>/credentials`` (not created
    here; ``keel.infra.secrets.ensure_private_dir`` creates it 0700)."""
    return (settings.credentials_dir or settings.home / "credentials").expanduser()


def default_home() -> Path:
    """``~/.keel``; as root ``/var/lib/keel``, because the embedded PostgreSQL runs as an unprivileged
    account that cannot reach into ``/root``."""
    if os.geteuid() == 0:
        return Path("/var/lib/keel")
    return Path("~/.keel").expanduser()


_TOP_LEVEL_ENV = {
    "KEEL_NATS_URL": "nats_url",
    "KEEL_DATABASE_URL": "database_url",
    "KEEL_DATABASE_PASSWORD_FILE": "database_password_file",
    "KEEL_HOME": "home",
    "KEEL_DB_SCHEMA": "db_schema",
    "KEEL_CREDENTIALS_DIR": "credentials_dir",
}


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def _env_layer(environ: Mapping[str, str]) -> dict[str, Any]:
    layer: dict[str, Any] = {}
    for name, value in environ.items():
        if name in _TOP_LEVEL_ENV:
            layer[_TOP_LEVEL_ENV[name]] = value
        elif name.startswith("KEEL_") and "__" in name:
            # KEEL_ACTUATOR__SLURM__CONF: one level per "__". Values stay text; a list-typed setting reads
            # JSON list syntax itself (KEEL_ACTUATOR__SLURM__STANDBY_COMMAND='["srun", "keel", "run"]').
            *path, field = name[len("KEEL_") :].lower().split("__")
            target = layer
            for part in path:
                nested = target.setdefault(part, {})
                if not isinstance(nested, dict):
                    raise ConfigError(f"environment {name}: {part} is a setting, not a section")
                target = nested
            target[field] = value
    return layer


def _yaml_layer(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping, got {type(data).__name__}")
    return data


def _describe(source: str, error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        reason = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            reason = "unknown setting"
        lines.append(f"{source}: {field}: {reason}")
    return "; ".join(lines)


def load_settings(
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge the layers and validate once.

    ``overrides`` are CLI flags as a nested mapping (``{"nats": {"port": 5000}}``); ``None`` values are
    ignored so unset flags do not mask lower layers. Raises ``ConfigError``.
    """
    environ = os.environ if environ is None else environ
    if config_file is None and environ.get("KEEL_CONFIG"):
        config_file = Path(environ["KEEL_CONFIG"])
    layers: list[tuple[str, dict[str, Any]]] = []
    if config_file is not None:
        layers.append((f"config file {config_file}", _yaml_layer(config_file)))
    layers.append(("environment", _env_layer(environ)))
    layers.append(("command line", _drop_none(overrides or {})))

    merged: dict[str, Any] = {}
    for source, layer in layers:
        # Validate each layer on its own first so the error names the layer the bad value came from.
        try:
            Settings.model_validate(_deep_merge(merged, layer))
        except ValidationError as exc:
            raise ConfigError(_describe(source, exc)) from None
        merged = _deep_merge(merged, layer)
    settings = Settings.model_validate(merged)
    return settings.model_copy(update={"home": settings.home.expanduser()})


def _drop_none(mapping: Mapping[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            nested = _drop_none(value)
            if nested:
                result[key] = nested
        elif value is not None:
            result[key] = value
    return result


def resolve_endpoints(settings: Settings, role: str | None = AUDITOR) -> tuple[str, str]:
    """(NATS URL, database URL of ``role``): the configured servers (``KEEL_NATS_URL``/``KEEL_DATABASE_URL``,
    ``database_urls`` or the settings file) when set, else those of the embedded runtime that ``keel up``
    started under ``settings.home``. ``role`` (``keel.infra.dbroles.ROLES``; by default the read-only
    ``auditor``) picks whose credentials the database URL carries; ``None``: none (for a caller that needs only
    the NATS URL: no password is read). Raises ``ConfigError`` when neither is there, or the role's password
    cannot be read."""
    nats_url, database_url = settings.nats_url, _configured_database_url(settings, role)
    if nats_url and database_url:
        return nats_url, database_url
    state_file = settings.home / "runtime.json"
    if not state_file.exists():
        raise ConfigError(
            f"no embedded runtime under {settings.home}: run `keel up` or set KEEL_NATS_URL and KEEL_DATABASE_URL"
        )
    state = json.loads(state_file.read_text())
    if role is None:
        return nats_url or state["nats"]["url"], database_url or state["postgres"]["dsn"]
    return nats_url or state["nats"]["url"], database_url or _embedded_database_url(settings, state["postgres"], role)


def database_url_for(settings: Settings, role: str) -> str:
    """The database URL ``role`` connects with (see ``resolve_endpoints``)."""
    return _configured_database_url(settings, role) or resolve_endpoints(settings, role)[1]


def _configured_database_url(settings: Settings, role: str | None) -> str | None:
    """``database_urls.<role>``, else ``database_url`` (with ``database_password_file``'s password when the URL
    has none), else None: the embedded server's. ``role`` None: ``database_url`` as it is."""
    if role is None:
        return settings.database_url
    pg_role(role)  # an unknown role is a programming error: fail here, whatever is configured
    url = getattr(settings.database_urls, role) or settings.database_url
    if url is None:
        return None
    if settings.database_password_file is not None and not has_password(url):
        path = settings.database_password_file
        try:
            # Not read_secret: a mounted Docker/Kubernetes secret is often owned by root and readable by all.
            password = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"database_password_file {path}: cannot read it: {exc.strerror or exc}") from None
        if not password:
            raise ConfigError(f"database_password_file {path} is empty")
        url = with_credentials(url, url_user(url) or pg_role(role), password)
    return url


def _embedded_database_url(settings: Settings, postgres: dict[str, Any], role: str) -> str:
    """``role``'s URL on the embedded server: its address from ``runtime.json`` and the password ``keel up``
    generated for it under ``<credentials>/postgres/``."""
    secrets_dir = Path(postgres.get("secrets_dir") or credentials_path(settings) / "postgres")
    name = pg_role(role)
    try:
        password = read_secret(secrets_dir / f"{name}.password").decode().strip()
    except (FileNotFoundError, InsecurePathError) as exc:
        raise ConfigError(f"the embedded PostgreSQL's password for role {name}: {exc} (`keel up` generates it; "
                          f"run Keel as the user who ran `keel up`)") from None
    except PermissionError as exc:
        raise ConfigError(f"the embedded PostgreSQL's password for role {name}: {exc}; run Keel as the user who "
                          f"ran `keel up`") from None
    return with_credentials(postgres["dsn"], name, password)
