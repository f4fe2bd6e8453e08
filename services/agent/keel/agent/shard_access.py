"""Who may do what to a node's shard store: pure decisions, each refusal with its reason.

The shard store (``keel.agent.shard_store``) serves mTLS only; the TLS handshake proves the peer holds a
certificate of this job's CA (``keel.infra.shard_ca``), and ``peer`` below is the node id that
certificate names. On top of that:

- ``authorize_put``: a backup of rank ``r`` is accepted only from the node the broker assigned to back
  ``r`` up on this node (``senders``, from the broker's placement), only as that node's own shard (the
  header's owner is the peer), only for ``0 <= r < world_size``, and only of this node's generation or a
  newer one (``min_generation``): a backup of an older generation comes from a history the job left, from
  a node that was fenced out of it (a host back after its eviction) or lags behind its restart;
- ``authorize_read``: ``GetShard`` and ``ListShards`` from any node of the job (any certificate of the
  job's CA), ``GetShard`` only for ``0 <= r < world_size``;
- ``admit_stream``: at most ``max_streams`` streams at once (``max_streams_per_peer`` per peer), and a
  backup only while what the peer's backups hold and stream stays within ``peer_quota_bytes`` and
  what every backup holds and streams within ``total_quota_bytes``.

No I/O, no clock: the server gathers the numbers, these functions decide.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["StoreLimits", "Refusal", "StreamLoad", "authorize_put", "authorize_read", "admit_stream"]

RefusalCode = Literal["PERMISSION_DENIED", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION"]


@dataclass(frozen=True)
class StoreLimits:
    """A shard store's limits (``keel.infra.config.CheckpointSettings``: ``store_*``)."""

    max_shard_bytes: int = 64 * 1024**3
    """The largest backup one stream may declare."""
    peer_quota_bytes: int = 128 * 1024**3
    """What the backups of one peer may hold here, every copy (newest, previous, pinned) and streams in flight."""
    total_quota_bytes: int = 512 * 1024**3
    """What every peer's backups together may hold here, with the streams in flight."""
    max_streams: int = 32
    """Streams (PutShard and GetShard) served at once."""
    max_streams_per_peer: int = 8
    """Streams served at once to one peer."""

    def __post_init__(self) -> None:
        for name in ("max_shard_bytes", "peer_quota_bytes", "total_quota_bytes", "max_streams", "max_streams_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"shard store limit {name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Refusal:
    """Why a call is refused; ``code`` names the gRPC status it is answered with."""

    code: RefusalCode
    reason: str


@dataclass(frozen=True)
class StreamLoad:
    """What the store serves and holds when a stream asks in."""

    streams: int = 0
    """Streams being served now (all peers)."""
    peer_streams: int = 0
    """Streams being served now to the asking peer."""
    peer_bytes: int = 0
    """Bytes the asking peer's backups hold here plus its backups streaming in (declared lengths)."""
    total_bytes: int = 0
    """The same for every peer."""


def _rank_refusal(rank: int, world_size: int) -> Refusal | None:
    if not 0 <= rank < world_size:
        return Refusal("INVALID_ARGUMENT", f"rank {rank} is outside this job's ranks 0..{world_size - 1}")
    return None


def authorize_put(peer: str, rank: int, owner_node_id: str, *, store_node: str, world_size: int,
                  senders: Mapping[int, str], generation: int = 0, min_generation: int = 0) -> Refusal | None:
    """None when node ``peer`` may store its backup of ``rank`` (the header names ``owner_node_id``) of
    ``generation`` on ``store_node``; else why not. ``senders``: rank -> the node assigned to back it up
    here; ``min_generation``: the generation ``store_node`` runs (older backups are of a history it left)."""
    refusal = _rank_refusal(rank, world_size)
    if refusal is not None:
        return refusal
    if generation < min_generation:
        return Refusal("FAILED_PRECONDITION", f"{peer!r} offered rank {rank}'s backup of generation {generation}, "
                                              f"older than {store_node!r}'s generation {min_generation}: a stale "
                                              f"history (a node fenced out of the job, or one not restarted yet)")
    if owner_node_id != peer:
        return Refusal("PERMISSION_DENIED", f"node {peer!r} sent a backup claiming to be node {owner_node_id!r}'s: "
                                            f"a node sends only its own ranks' backups")
    assigned = senders.get(rank)
    if assigned is None:
        return Refusal("PERMISSION_DENIED", f"no node is assigned to back up rank {rank} on {store_node!r} (as far as "
                                            f"this node has heard from the checkpoint broker); {peer!r} is refused")
    if assigned != peer:
        return Refusal("PERMISSION_DENIED", f"rank {rank}'s backups on {store_node!r} come from {assigned!r}, "
                                            f"not from {peer!r}")
    return None


def authorize_read(peer: str, rank: int | None, *, world_size: int) -> Refusal | None:
    """None when node ``peer`` (of this job: its certificate says so) may read ``rank`` (None: a listing)."""
    if rank is None:
        return None
    return _rank_refusal(rank, world_size)


def admit_stream(peer: str, declared_bytes: int, load: StreamLoad, limits: StoreLimits) -> Refusal | None:
    """None when one more stream from ``peer`` fits (``declared_bytes``: the length of a backup streaming
    in, 0 for a read); else which limit it would pass."""
    if load.streams >= limits.max_streams:
        return Refusal("RESOURCE_EXHAUSTED", f"{load.streams} streams in progress, the store's limit of "
                                             f"{limits.max_streams} (store_max_streams)")
    if load.peer_streams >= limits.max_streams_per_peer:
        return Refusal("RESOURCE_EXHAUSTED", f"{load.peer_streams} streams in progress with {peer!r}, the "
                                             f"per-peer limit of {limits.max_streams_per_peer} "
                                             f"(store_max_streams_per_peer)")
    if declared_bytes > limits.max_shard_bytes:
        return Refusal("RESOURCE_EXHAUSTED", f"shard of {declared_bytes} bytes exceeds this store's limit of "
                                             f"{limits.max_shard_bytes} (store_max_shard_bytes)")
    if declared_bytes and load.peer_bytes + declared_bytes > limits.peer_quota_bytes:
        return Refusal("RESOURCE_EXHAUSTED", f"{peer!r}'s backups hold or stream {load.peer_bytes} bytes here; "
                                             f"{declared_bytes} more would pass the per-peer quota of "
                                             f"{limits.peer_quota_bytes} (store_peer_quota)")
    if declared_bytes and load.total_bytes + declared_bytes > limits.total_quota_bytes:
        return Refusal("RESOURCE_EXHAUSTED", f"backups hold or stream {load.total_bytes} bytes here; {declared_bytes} "
                                             f"more would pass the store's quota of {limits.total_quota_bytes} "
                                             f"(store_total_quota)")
    return None
