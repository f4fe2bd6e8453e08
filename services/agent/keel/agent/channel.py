"""The agent's end of the node-local channel: a Unix datagram socket receiving ``RankReport``s.

Reports are tracked per (rank, generation): the latest phase and step, when the last report arrived
and when the step last advanced (agent clock, UTC), and recent step times for timeout calibration.
Malformed datagrams are counted and dropped; they never stop the agent.

Who sent a datagram is the kernel's word, not the datagram's: the socket has ``SO_PASSCRED`` on, so
every datagram arrives with its sender's real pid, uid and gid (``SCM_CREDENTIALS``; the socket is
unconnected, where ``SO_PEERCRED`` says nothing). A report is taken only from a rank process the
supervisor started, and only for the rank and pid that process is (``sender_problem``, pure): anything
else on the host that can reach the socket (another user's process, a rank's child such as a dataloader
worker that inherited the SDK's exception hook, one rank speaking for another) is dropped, counted in
``rejected`` and logged once per sender, and can neither mark a rank failed (the agent SIGKILLs a rank
that reports ``PHASE_FAILED``) nor fake its progress. Only the rank processes themselves count, not their
descendants: the supervisor starts each rank directly (a fresh interpreter or a fork of the zygote),
and the SDK reports from that process. Root can put any pid into ``SCM_CREDENTIALS``; the check holds
against unprivileged local processes, not against root on the node. The socket's folder is private to
the agent's user besides (``keel.agent.rejoin.AgentLock``).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from keel.protocol import node_local_pb2
from keel.rules.metrics import MetricSample

log = logging.getLogger(__name__)

PHASE_NAMES = {
    node_local_pb2.PHASE_UNSPECIFIED: "setup",
    node_local_pb2.PHASE_SETUP: "setup",
    node_local_pb2.PHASE_STEP: "step",
    node_local_pb2.PHASE_CHECKPOINT: "checkpoint",
    node_local_pb2.PHASE_EVAL: "eval",
    node_local_pb2.PHASE_DONE: "done",
    node_local_pb2.PHASE_FAILED: "failed",
}


@dataclass
class RankState:
    rank: int
    pid: int
    generation: int
    phase: str = "setup"
    step: int = -1
    first_report_at: datetime | None = None
    last_report_at: datetime | None = None
    last_progress_at: datetime | None = None
    step_times_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    compute_times_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    """Per step: the time outside collectives (only when the loop marks its collective waits)."""
    metric_samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=300))
    """Per step: loss, gradient norm and tokens/s as reported (``keel.rules.metrics.MetricSample``)."""
    collective_waits_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    """Per step: the longest single collective wait (only when the loop marks its collectives)."""
    collective: str = ""
    """The collective the rank is inside now ('' when in none)."""
    collective_seq: int = 0
    collective_entered_at: datetime | None = None
    """When (agent clock) the rank entered the collective it is inside now: the first report from inside
    it, less the wait it reported then. None when it is in none."""
    loss: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    error: str = ""
    """With phase ``failed``: the uncaught exception the rank reported."""
    last_seq: int = 0
    dropped: int = 0
    """Reports the rank sent that never arrived (gaps in ``seq``)."""
    checkpoint_step: int = -1
    """The newest step whose shared-memory snapshot the rank completed (-1: none)."""
    checkpoint_blocking_s: float = 0.0
    """The seconds the rank's training thread has spent blocked in checkpointing so far (a running total)."""
    groups: dict[str, Any] | None = None
    """The rank's parallel groups (``dp``, ``pp``, ``tp``, ``shard``: global ranks; ``shard_is_dp``) as
    ``RankGroups`` fields, once its Checkpointer exists."""


def _fold_collective(state: RankState, report: node_local_pb2.RankReport, now: datetime) -> None:
    """Where the rank is in its collectives. A report from inside one says how long it has waited; the
    entry time is taken from the first such report of that collective (later ones only confirm it)."""
    if report.collective_wait_s <= 0:
        state.collective, state.collective_entered_at = "", None
    elif report.collective_seq != state.collective_seq or state.collective_entered_at is None:
        state.collective = report.collective
        state.collective_entered_at = now - timedelta(seconds=report.collective_wait_s)
    state.collective_seq = report.collective_seq


MAX_RANK = 1 << 20
"""Ranks above this are not a job Keel runs (a million processes); a report naming one is malformed."""


def report_problem(report: node_local_pb2.RankReport) -> str:
    """Why a rank's report cannot be taken as it is ('' when it can): the fields that key state or go
    into events must be in range, and its numbers finite."""
    if not 0 <= report.rank < MAX_RANK or not 0 <= report.local_rank < MAX_RANK:
        return f"rank {report.rank} / local rank {report.local_rank} out of range"
    if report.pid <= 0:
        return f"pid {report.pid} is not a process id"
    if report.step < -1 or (report.HasField("checkpoint_step") and report.checkpoint_step < -1):
        return f"step {report.step} / checkpoint step {report.checkpoint_step} out of range"
    for name in ("sent_at_unix_s", "step_time_s", "compute_time_s", "collective_wait_s", "collective_wait_max_s",
                 "checkpoint_blocking_s"):
        value = getattr(report, name)
        if not math.isfinite(value) or value < 0:
            return f"{name} {value} is not a finite, non-negative number"
    return ""


@dataclass(frozen=True)
class Sender:
    """A datagram's sender as the kernel reports it (``SCM_CREDENTIALS``)."""

    pid: int
    uid: int
    gid: int


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAX_LOGGED_SENDERS = 256
"""Senders whose rejected reports are logged (once each); past that only the count grows."""


def sender_problem(report: node_local_pb2.RankReport, sender: Sender | None, rank_pids: Mapping[int, int]) -> str:
    """Why ``report`` is not taken from ``sender`` ('' when it is): the sender must be one of the agent's
    rank processes (``rank_pids``: pid -> global rank, the supervisor's), and the report must name that
    rank and that pid."""
    if sender is None:
        return "the kernel attached no sender credentials"
    rank = rank_pids.get(sender.pid)
    if rank is None:
        return f"pid {sender.pid} (uid {sender.uid}) is not a rank process of this agent"
    if report.rank != rank:
        return f"rank {rank} (pid {sender.pid}) sent a report for rank {report.rank}"
    if report.pid != sender.pid:
        return f"rank {rank} (pid {sender.pid}) sent a report naming pid {report.pid}"
    return ""


class RankChannel:
    """Binds the socket and folds incoming reports into ``ranks`` (keyed by global rank). The socket's
    folder must exist and be the agent's own (``AgentLock`` makes sure)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ranks: dict[int, RankState] = {}
        self.malformed = 0
        self.rejected = 0
        """Datagrams dropped because their sender is not the rank they claim to be (``sender_problem``)."""
        self._logged_senders: set[int] = set()
        path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # Before bind: no datagram may arrive without its sender's credentials.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(str(path))
        path.chmod(0o600)  # the folder is 0700 already; sending needs write access to the socket file
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)

    def drain(self, now: datetime, generation: int, rank_pids: Mapping[int, int]) -> int:
        """Read every datagram waiting; take only the reports of ``generation`` that the rank processes
        ``rank_pids`` (pid -> global rank) sent about themselves (``sender_problem``). Returns how many
        datagrams were read."""
        count = 0
        while True:
            try:
                data, ancillary, _flags, _address = self.sock.recvmsg(65536, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                return count
            count += 1
            sender = _sender(ancillary)
            if sender is None or sender.pid not in rank_pids:
                self._reject(sender, sender_problem(node_local_pb2.RankReport(), sender, rank_pids))
                continue  # not even parsed: it is no rank's
            try:
                report = node_local_pb2.RankReport.FromString(data)
            except DecodeError:
                self.malformed += 1
                continue
            if report.generation != generation:
                continue
            problem = report_problem(report)
            if problem:
                # One bad datagram (a rank's bug) is counted and dropped, never a state that later breaks
                # an event (a negative rank) and with it the agent.
                self.malformed += 1
                log.warning("ignoring a rank report: %s", problem)
                continue
            problem = sender_problem(report, sender, rank_pids)
            if problem:
                self._reject(sender, problem)
                continue
            try:
                self.apply(report, now)
            except Exception as exc:  # noqa: BLE001 - one report that cannot be folded is dropped, not the rest
                self.malformed += 1
                log.warning("dropping a report of rank %d that could not be folded: %r", report.rank, exc)

    def _reject(self, sender: Sender | None, problem: str) -> None:
        self.rejected += 1
        key = sender.pid if sender is not None else 0
        if key in self._logged_senders or len(self._logged_senders) >= MAX_LOGGED_SENDERS:
            return
        self._logged_senders.add(key)
        log.warning("%s: ignoring its reports on %s (counted, logged once per sender)", problem, self.path)

    def apply(self, report: node_local_pb2.RankReport, now: datetime) -> None:
        state = self.ranks.get(report.rank)
        if state is None or state.pid != report.pid or state.generation != report.generation:
            state = RankState(rank=report.rank, pid=report.pid, generation=report.generation, first_report_at=now)
            self.ranks[report.rank] = state
        if report.seq and report.seq <= state.last_seq:
            return  # reordered or duplicated datagram
        if state.last_seq and report.seq > state.last_seq + 1:
            state.dropped += report.seq - state.last_seq - 1
        state.last_seq = report.seq
        state.last_report_at = now
        phase = PHASE_NAMES.get(report.phase, "setup")
        if phase != state.phase:
            state.last_progress_at = now  # entering a checkpoint or eval restarts the clock
        state.phase = phase
        if report.step > state.step:
            if state.step >= 0 and report.step_time_s > 0:
                state.step_times_s.append(report.step_time_s)
                if report.compute_time_s > 0:
                    state.compute_times_s.append(report.compute_time_s)
                if report.collective_seq > 0:
                    state.collective_waits_s.append(report.collective_wait_max_s)
            state.metric_samples.append(MetricSample(step=report.step, loss=report.loss, grad_norm=report.grad_norm,
                                                     tokens_per_s=report.tokens_per_s or None, rank=report.rank))
            state.step = report.step
            state.last_progress_at = now
        elif state.last_progress_at is None:
            state.last_progress_at = now
        _fold_collective(state, report, now)
        state.loss = report.loss
        state.grad_norm = report.grad_norm
        state.tokens_per_s = report.tokens_per_s
        if report.error:
            state.error = report.error
        if report.HasField("checkpoint_step") and report.checkpoint_step > state.checkpoint_step:
            state.checkpoint_step = report.checkpoint_step
        state.checkpoint_blocking_s = max(state.checkpoint_blocking_s, report.checkpoint_blocking_s)  # a running total
        if report.checkpoint_groups_json and state.groups is None:
            state.groups = _parse_groups(report.checkpoint_groups_json, report.rank)

    def forget_generation_before(self, generation: int) -> None:
        self.ranks = {r: s for r, s in self.ranks.items() if s.generation >= generation}


def _sender(ancillary: list[tuple[int, int, bytes]]) -> Sender | None:
    """The ``SCM_CREDENTIALS`` of one received datagram (None if absent or cut short)."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            pid, uid, gid = _UCRED.unpack_from(data)
            return Sender(pid, uid, gid)
    return None


def _parse_groups(text: str, rank: int) -> dict[str, Any] | None:
    """``{"dp": [...], "pp": [...], "tp": [...], "shard": [...] | "dp"}`` from a rank, as ``RankGroups`` fields,
    or None (logged) when malformed. A group the rank did not send is just the rank (``shard``: none, as from an
    SDK without shard groups); ``"shard": "dp"`` is a shard group equal to the DP group (``shard_is_dp``)."""
    try:
        raw = json.loads(text)
        groups: dict[str, Any] = {kind: [int(r) for r in raw.get(kind, [rank])] for kind in ("dp", "pp", "tp")}
        shard = raw.get("shard", [])
        groups["shard_is_dp"] = shard == "dp"
        groups["shard"] = [] if shard == "dp" else [int(r) for r in shard]
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("rank %d sent malformed checkpoint groups %r: %s", rank, text[:200], exc)
        return None
    return groups
