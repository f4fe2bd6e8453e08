"""Node ranks from a rendezvous (``keel run --rdzv-backend c10d`` without ``--node-rank``): the pure part.

torchrun's c10d semantics (``torch.distributed.elastic.rendezvous.dynamic_rendezvous``), for a job's
first start only:

- ``--nnodes MIN:MAX``: the rendezvous waits for MIN nodes. When the MIN-th joins, a *last call* of
  ``last_call_timeout`` starts; it closes when that ends or when the MAX-th node joins, whichever comes
  first. A node that comes after it closed is refused (start it as ``--keel-standby``). Not MIN nodes
  within ``join_timeout`` of a node's join: that node fails and leaves the round.
- Node ranks are deterministic: the admitted nodes sorted by node id (``--keel-node-id``, the host name by
  default), then by their join token (two agents with one node id on one host). ``nnodes`` becomes the
  number admitted; the node of rank 0 names the ranks' ``MASTER_ADDR``/``MASTER_PORT``.
- The rendezvous is for the first start only. Keel's restart generations keep every node's rank (the
  controller restarts all nodes; a promoted standby takes the evicted node's slice), and an agent
  restarted under a running job takes its rank from ``<agent dir>/rendezvous.json``.

Timeouts and options come from ``--rdzv-conf`` (``parse_rdzv_conf``), torchrun's ``key=value,...``
with torch's defaults. The store I/O lives in ``keel.agent.rendezvous_store``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import timedelta

from keel.events.units import parse_duration

STATIC = "static"
C10D = "c10d"
DEFAULT_C10D_PORT = 29400
"""torchrun's port when ``--rdzv-endpoint`` names only a host."""
UNSUPPORTED_BACKENDS = ("etcd", "etcd-v2")

DEFAULT_JOIN_TIMEOUT = timedelta(seconds=600)
DEFAULT_LAST_CALL_TIMEOUT = timedelta(seconds=30)
DEFAULT_CLOSE_TIMEOUT = timedelta(seconds=30)
DEFAULT_READ_TIMEOUT = timedelta(seconds=60)

_DURATION_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "read_timeout")
_ACCEPTED_UNUSED = frozenset({
    # torch's keep-alive of a re-rendezvous (Keel rendezvous once), the static backend's store timeout.
    "heartbeat_timeout", "keep_alive_interval", "keep_alive_max_attempt", "timeout",
})


class RendezvousConfigError(ValueError):
    """``--nnodes``, ``--rdzv-backend``, ``--rdzv-endpoint`` or ``--rdzv-conf`` is wrong; the message says how."""


@dataclass(frozen=True)
class RendezvousConf:
    """``--rdzv-conf``, with torch's defaults."""

    join_timeout: timedelta = DEFAULT_JOIN_TIMEOUT
    last_call_timeout: timedelta = DEFAULT_LAST_CALL_TIMEOUT
    close_timeout: timedelta = DEFAULT_CLOSE_TIMEOUT
    """How long the node hosting the store waits for every admitted node to read its rank before it stops
    listening."""
    read_timeout: timedelta = DEFAULT_READ_TIMEOUT
    """One store operation (connecting included)."""
    is_host: bool | None = None
    """Whether this node hosts the store (None: when the endpoint names this machine, as torch decides)."""


def _conf_duration(key: str, value: str) -> timedelta:
    """torch's spelling (whole seconds) or Keel's (a duration with its unit: ``500ms``, ``2s``)."""
    text = value.strip()
    try:
        duration = timedelta(seconds=int(text)) if text.lstrip("-").isdigit() else parse_duration(text)
    except ValueError:
        raise RendezvousConfigError(f"--rdzv-conf {key}={value!r}: not a duration (seconds, as torchrun takes "
                                    f"them, or with a unit: 500ms, 30s, 10m)") from None
    if duration <= timedelta(0):
        raise RendezvousConfigError(f"--rdzv-conf {key}={value!r}: must be positive")
    return duration


def parse_rdzv_conf(text: str) -> RendezvousConf:
    """``--rdzv-conf key=value,...`` (torchrun's format). Keys torch's c10d backend reads for a re-rendezvous
    that Keel never does are accepted and unused; an unknown key or a bad value is refused."""
    conf = RendezvousConf()
    if not text.strip():
        return conf
    seen: set[str] = set()
    durations: dict[str, timedelta] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not key or not sep or not value.strip():
            raise RendezvousConfigError(f"--rdzv-conf must be key=value,...; got {item.strip()!r} in {text!r}")
        if key in seen:
            raise RendezvousConfigError(f"--rdzv-conf gives {key} twice")
        seen.add(key)
        if key in _DURATION_KEYS:
            durations[key] = _conf_duration(key, value)
        elif key == "is_host":
            flag = value.strip().lower()
            if flag not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise RendezvousConfigError(f"--rdzv-conf is_host={value!r}: must be true or false")
            conf = replace(conf, is_host=flag in ("1", "true", "yes", "on"))
        elif key == "store_type":
            if value.strip().lower() != "tcp":
                raise RendezvousConfigError(f"--rdzv-conf store_type={value!r}: Keel's c10d rendezvous uses a TCP "
                                            f"store only")
        elif key not in _ACCEPTED_UNUSED:
            known = sorted({*_DURATION_KEYS, "is_host", "store_type", *_ACCEPTED_UNUSED})
            raise RendezvousConfigError(f"--rdzv-conf: unknown key {key!r} (known: {', '.join(known)})")
    return replace(conf, join_timeout=durations.get("join_timeout", conf.join_timeout),
                   last_call_timeout=durations.get("last_call_timeout", conf.last_call_timeout),
                   close_timeout=durations.get("close_timeout", conf.close_timeout),
                   read_timeout=durations.get("read_timeout", conf.read_timeout))


def parse_nnodes(text: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` -> (min, max), ``0 < min <= max`` as torchrun requires."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise RendezvousConfigError(f"--nnodes must be N or MIN:MAX, got {text!r}") from None
    if not 0 < low <= high:
        raise RendezvousConfigError(f"--nnodes {text}: needs 0 < MIN <= MAX")
    return low, high


def parse_endpoint(text: str, default_port: int) -> tuple[str, int]:
    """``HOST[:PORT]`` (``[v6]:PORT`` too) -> (host, port); torchrun's default port when none is given."""
    text = text.strip()
    host, port = text, default_port
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise RendezvousConfigError(f"--rdzv-endpoint must be HOST[:PORT], got {text!r}")
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, _, digits = text.partition(":")
        if not digits.isdigit():
            raise RendezvousConfigError(f"--rdzv-endpoint must be HOST[:PORT], got {text!r}")
        port = int(digits)
    if not host:
        raise RendezvousConfigError(f"--rdzv-endpoint must name a host, got {text!r}")
    if not 0 < port < 65536:
        raise RendezvousConfigError(f"--rdzv-endpoint port {port} is outside 1..65535")
    return host, port


# -- the round: a state every node updates with compare-and-set ------------------------------------------


@dataclass(frozen=True)
class Member:
    node_id: str
    token: str
    """Unique per agent (two agents with one node id on one host stay two members)."""


@dataclass(frozen=True)
class Round:
    """One rendezvous's shared state (JSON in the store under the rendezvous id)."""

    members: tuple[Member, ...] = ()
    last_call_ends_at: float | None = None
    """Unix time (the clock of the node that reached MIN) when the last call ends; None before MIN."""
    closed: bool = False

    def to_json(self) -> str:
        return json.dumps({"members": [[m.node_id, m.token] for m in self.members],
                           "last_call_ends_at": self.last_call_ends_at, "closed": self.closed}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Round:
        raw = json.loads(text)
        return cls(members=tuple(Member(str(n), str(t)) for n, t in raw["members"]),
                   last_call_ends_at=raw["last_call_ends_at"], closed=bool(raw["closed"]))

    def has(self, token: str) -> bool:
        return any(m.token == token for m in self.members)


@dataclass(frozen=True)
class Admission:
    round: Round
    """The round with the node in it (unchanged when refused)."""
    refused: str = ""
    """Why the node is not admitted ("" when it is)."""


def admit(current: Round, me: Member, *, min_nodes: int, max_nodes: int, now: float,
          conf: RendezvousConf) -> Admission:
    """A node joins (pure): admitted while the round is open and below MAX; the MIN-th starts the last
    call, the MAX-th closes the round."""
    if current.has(me.token):
        return Admission(current)
    if current.closed or len(current.members) >= max_nodes:
        return Admission(current, f"the rendezvous already closed with {len(current.members)} node(s) "
                                  f"(--nnodes {min_nodes}:{max_nodes}); a node that comes later is not admitted "
                                  f"(start it as --keel-standby, or start the job again)")
    members = (*current.members, me)
    ends_at = current.last_call_ends_at
    if len(members) >= min_nodes and ends_at is None:
        ends_at = now + conf.last_call_timeout.total_seconds()
    return Admission(Round(members, ends_at, closed=len(members) >= max_nodes))


def settle(current: Round, *, min_nodes: int, now: float) -> Round:
    """Close an open round whose last call has ended with at least MIN members (pure)."""
    if (not current.closed and len(current.members) >= min_nodes and current.last_call_ends_at is not None
            and now >= current.last_call_ends_at):
        return replace(current, closed=True)
    return current


def leave(current: Round, token: str, *, min_nodes: int) -> Round:
    """A node that gives up (its join timed out) leaves an open round; below MIN the last call is off."""
    if current.closed or not current.has(token):
        return current
    members = tuple(m for m in current.members if m.token != token)
    return Round(members, current.last_call_ends_at if len(members) >= min_nodes else None, closed=False)


def node_ranks(closed: Round) -> dict[str, int]:
    """Token -> node rank: the members sorted by node id, then token (deterministic for a member set)."""
    ordered = sorted(closed.members, key=lambda m: (m.node_id, m.token))
    return {m.token: rank for rank, m in enumerate(ordered)}


@dataclass(frozen=True)
class Verdict:
    """What a waiting node does next (``judge``)."""

    node_rank: int | None = None
    """Admitted: this node's rank (with ``nnodes``)."""
    nnodes: int = 0
    failed: str = ""
    """Give up with this reason."""

    @property
    def waiting(self) -> bool:
        return self.node_rank is None and not self.failed


def judge(current: Round, token: str, *, min_nodes: int, max_nodes: int, joined_at: float, now: float,
          conf: RendezvousConf) -> Verdict:
    """A member's verdict on the round it reads (pure): its rank once closed, a failure when its join
    timed out, else wait."""
    if current.closed:
        ranks = node_ranks(current)
        if token not in ranks:
            return Verdict(failed=f"the rendezvous closed with {len(current.members)} node(s) without this one "
                                  f"(--nnodes {min_nodes}:{max_nodes})")
        return Verdict(node_rank=ranks[token], nnodes=len(current.members))
    if now - joined_at >= conf.join_timeout.total_seconds():
        names = ", ".join(sorted(m.node_id for m in current.members)) or "none"
        return Verdict(failed=f"only {len(current.members)} of the {min_nodes} node(s) needed (--nnodes "
                              f"{min_nodes}:{max_nodes}) joined within join_timeout "
                              f"{conf.join_timeout.total_seconds():g}s (joined: {names})")
    return Verdict()


def duplicate_node_ids(closed: Round) -> list[str]:
    """Node ids more than one admitted agent carries (their events would be taken for one node's)."""
    ids = [m.node_id for m in closed.members]
    return sorted({n for n in ids if ids.count(n) > 1})


WORKER_PORT_SPAN = 1000
"""Ports above the ranks' base port that a job may use: ``base + generation``, diagnostics rounds at
``base + 500 + round`` (``keel.agent.diagnostics.round_port``)."""


def worker_port_clear(base: int, endpoint_port: int) -> bool:
    """Whether the ranks' ports (``base .. base + WORKER_PORT_SPAN``) keep clear of the rendezvous port (pure)."""
    return not base <= endpoint_port <= base + WORKER_PORT_SPAN
