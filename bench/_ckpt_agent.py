"""The node agent's checkpoint duties, for the checkpoint benchmark's "Keel as shipped" variant.

    python -m bench._ckpt_agent --node-dir D --peer-dir P --persist-root R --job J --ready F --done G

A separate process beside the rank, as the node agent is, running the agent's own checkpoint code: the
rank's node is ``keel.agent.checkpointing.NodeCheckpointing`` over a ``GrpcTransport`` (its shard store
and its sender, mutual TLS), exactly as ``NodeAgent`` builds it; the backup peer is a second
``NodeCheckpointing`` with its own ``GrpcTransport`` (on a real cluster, another node's agent; here both
share the machine's two cores either way). The node backs up the steps the schedule names (a copy into
its sent ring, then gRPC ``PutShard`` to the peer, one transfer per rank in flight) and persists every
K-th step (``keel.checkpoint.disk.write_shard``), all on its own thread pool, as shipped.

What the bench plays, because this process has no NATS and no broker:

- the agent's main loop: ``tick`` every ``--poll`` seconds, with the rank's newest committed step read
  from its slot headers (the agent learns it from the rank's report over the channel);
- the broker, with its own pure functions (``keel.checkpoint_broker.schedule``): the placement (the
  rank's backup on the peer: ``CheckpointNodeBackupsAssigned`` to the node, ``CheckpointNodeBackupsHeld``
  to the peer), the backup interval (``backup_interval`` / ``kept_backup_interval`` from the last
  transfer's time and the step time, within ``backup_max_duty`` and ``backup_min_period``; coarser at
  once, finer at most once per ``schedule_min_period``, as ``decide_schedule``), K fixed at
  ``--persist-every`` (the broker's floor for Young's K: the most often it ever persists), a peer commit
  (``CheckpointStepCommitted``) for every step the peer holds (a world of one), and the disk manifest for
  every persisted step (``keel.checkpoint.disk.write_manifest``, as the broker's adapter writes it).

Protocol with the rank (files): this process writes ``--ready`` (JSON: the peer's address) once both
stores serve; ``<done>.sync`` (JSON ``seq``, ``step``) asks it to settle: tick until no backup or persist
is running (the rank times that wait); the rank writes ``--done`` (JSON: its last step) after training:
this process then backs up that step (the interval set to 1 for it, so the peer restore can be checked
bitwise against the live model; outside every timed block), writes ``<done>.ack`` (JSON: what it did),
and keeps serving the peer store (the rank fetches its backup from it to time the peer restore) until
it is terminated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench._ckpt_agent")
    p.add_argument("--node-dir", type=Path, required=True)
    p.add_argument("--peer-dir", type=Path, required=True)
    p.add_argument("--persist-root", type=Path, required=True)
    p.add_argument("--job", default="ckptbench")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--persist-every", type=int, default=10)
    p.add_argument("--poll", type=float, default=0.01)
    p.add_argument("--backup-duty", type=float, default=None,
                   help="share of wall time spent sending backups (default: checkpoint.backup_max_duty)")
    p.add_argument("--ready", type=Path, required=True)
    p.add_argument("--done", type=Path, required=True)
    return p.parse_args(argv)


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write a small JSON file atomically (the other side polls for it)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(document))
    os.replace(tmp, path)


def newest_complete_step(node_dir: Path, rank: int) -> int:
    from keel.checkpoint import slots as ckpt_slots

    newest = -1
    for path in ckpt_slots.list_slots(node_dir).get(rank, []):
        try:
            header = ckpt_slots.read_header(path)
        except ckpt_slots.SlotError:
            continue
        if header.complete:
            newest = max(newest, header.step)
    return newest


class TimedTransport:
    """Wraps the node's ``GrpcTransport`` to record each backup transfer (step, seconds, bytes, error)
    for the bench's report. Every call goes to the real transport unchanged."""

    def __init__(self, inner: Any, node_dir: Path) -> None:
        self._inner, self._node_dir = inner, node_dir
        self.sends: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def send(self, address: str, *, rank: int, step: int) -> None:
        from keel.agent.checkpointing import complete_slots

        size = next((h.payload_len for _, h in complete_slots(self._node_dir, rank) if h.step == step), 0)
        started = time.perf_counter()
        record: dict[str, Any] = {"step": step, "bytes": size}
        try:
            self._inner.send(address, rank=rank, step=step)
        except BaseException as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            record["seconds"] = time.perf_counter() - started
            with self._lock:
                self.sends.append(record)


class BrokerStandIn:
    """The broker's part for a world of one, with the broker's own schedule functions (see the module doc)."""

    def __init__(self, args: argparse.Namespace, node: Any, peer: Any, peer_address: str) -> None:
        from keel.checkpoint_broker.state import BrokerPolicy
        from keel.events.types import BackupAssignment
        from keel.infra.config import CheckpointSettings

        self.args, self.node, self.peer = args, node, peer
        self.policy = BrokerPolicy.from_settings(CheckpointSettings())
        if args.backup_duty is not None:
            self.policy = dataclasses.replace(self.policy, backup_max_duty=args.backup_duty)
        self.assignment = BackupAssignment(rank=args.rank, node_id="node", backup_node_id="peer",
                                           backup_address=peer_address)
        self.backup_every = 1
        self.announced_at = time.monotonic()
        self.step_time_s = 0.0
        self.committed = -1
        self.persists: list[dict[str, Any]] = []

    def event(self, payload: Any, subject: str) -> Any:
        from keel.events.envelope import Event

        return Event.create(payload, job_id=self.args.job, subject=subject, producer="checkpoint-broker",
                            occurred_at=datetime.now(UTC))

    def place(self) -> None:
        from keel.events.types import CheckpointNodeBackupsAssigned, CheckpointNodeBackupsHeld

        reason = "bench: rank's backup on the peer (a world of one)"
        self.peer.handle_event(self.event(CheckpointNodeBackupsHeld(node_id="peer", held=[self.assignment],
                                                                    reason=reason), "node/peer"))
        self.node.handle_event(self.event(CheckpointNodeBackupsAssigned(
            node_id="node", assignments=[self.assignment], reason=reason, every_k_steps=self.args.persist_every,
            backup_every_k_steps=1), "node/node"))

    def announce(self, backup_every: int, why: str) -> None:
        from keel.events.types import CheckpointScheduleSet

        self.backup_every, self.announced_at = backup_every, time.monotonic()
        self.node.handle_event(self.event(CheckpointScheduleSet(
            every_k_steps=self.args.persist_every, backup_every_k_steps=backup_every,
            save_cost_s=0.0, mtbf_s=self.policy.mtbf_prior.total_seconds(), step_time_s=self.step_time_s,
            reason=why), f"job/{self.args.job}"))

    def reschedule(self, last_send_s: float) -> None:
        """The backup interval the broker would set from the node's last transfer and the step time."""
        from keel.checkpoint_broker.schedule import backup_interval, backup_steps_needed, kept_backup_interval

        if self.step_time_s <= 0 or last_send_s <= 0:
            return
        duty, ceiling = self.policy.backup_max_duty, self.policy.persist_every_ceiling
        floor_s = self.policy.backup_min_period.total_seconds()
        wanted = kept_backup_interval(self.backup_every,
                                      backup_interval(last_send_s, self.step_time_s, duty, ceiling, floor_s),
                                      backup_steps_needed(last_send_s, self.step_time_s, duty, floor_s))
        if wanted == self.backup_every:
            return
        if wanted < self.backup_every and time.monotonic() - self.announced_at < self.policy.schedule_min_period.total_seconds():
            return  # finer waits for the schedule period, as decide_schedule does
        self.announce(wanted, f"bench: transfer {last_send_s:.3f}s, step {self.step_time_s:.4f}s")

    def commit_peer(self, step: int, size: int) -> None:
        from keel.events.types import CheckpointStepCommitted

        if step > self.committed:
            self.committed = step
            self.node.handle_event(self.event(CheckpointStepCommitted(tier="peer", step=step, ranks=1, bytes=size), f"job/{self.args.job}"))

    def on_node_event(self, payload: Any, subject: str | None = None) -> None:
        """``emit`` of the node: the persisted shards get their manifest (the broker's adapter's write)."""
        from keel.checkpoint import disk as ckpt_disk
        from keel.events.types import CheckpointShardsStored

        if isinstance(payload, CheckpointShardsStored) and payload.tier == "disk":
            for shard in payload.shards:
                ckpt_disk.write_manifest(self.args.persist_root, self.args.job, shard.step, 1,
                                         [ckpt_disk.ShardEntry(shard.rank, shard.bytes, shard.digest)])
                ckpt_disk.apply_retention(self.args.persist_root, self.args.job, keep=2)
                self.persists.append({"step": shard.step, "write_s": shard.write_s, "bytes": shard.bytes,
                                      "path": str(ckpt_disk.shard_file(self.args.persist_root, self.args.job, shard.step, shard.rank))})


class AgentWarnings(logging.Handler):
    """The agent's own warnings about its duties, counted for the report: a persist that failed, a snapshot
    the ring overwrote before it could be backed up (a skipped backup)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.persist_errors: list[str] = []
        self.skipped: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "persisting rank" in message:
            self.persist_errors.append(message)
        elif "moved on before it could be backed up" in message:
            self.skipped.append(message)


def run(args: argparse.Namespace) -> None:
    from keel.agent.checkpointing import GrpcTransport, NodeCheckpointing
    from keel.agent.shard_store import TlsMaterial

    warnings = AgentWarnings()
    logging.getLogger("keel.agent.checkpointing").addHandler(warnings)

    for folder in (args.node_dir, args.peer_dir):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    # The stores speak mTLS only: both ends get a certificate of the job's CA, as a launcher issues them.
    credentials = args.node_dir.parent / "credentials"
    tls = {node: TlsMaterial.issue(credentials, args.job, node, ("127.0.0.1",)) for node in ("node", "peer")}
    world = args.rank + 1
    peer_transport = GrpcTransport(args.job, "peer", args.peer_dir, bind="127.0.0.1:0", tls=tls["peer"], world_size=world)
    node_transport = TimedTransport(GrpcTransport(args.job, "node", args.node_dir, bind="127.0.0.1:0", tls=tls["node"],
                                                  world_size=world), args.node_dir)
    agents = args.node_dir.parent / "agents"
    stand_in: BrokerStandIn | None = None

    def emit(payload: Any, subject: str | None = None) -> None:
        if stand_in is not None:
            stand_in.on_node_event(payload, subject)

    node = NodeCheckpointing(job_id=args.job, node_id="node", local_ranks=[args.rank], world_size=world,
                             node_dir=args.node_dir, agent_dir=agents / "node", emit=emit,
                             transport=node_transport,  # type: ignore[arg-type]
                             persist_root=args.persist_root)
    peer = NodeCheckpointing(job_id=args.job, node_id="peer", local_ranks=[], world_size=world, node_dir=args.peer_dir,
                             agent_dir=agents / "peer", emit=lambda *a, **k: None, transport=peer_transport,
                             persist_root=None)
    node.start_fresh()
    stand_in = BrokerStandIn(args, node, peer, peer_transport.address)
    stand_in.place()
    groups = {args.rank: {"dp": [args.rank], "pp": [args.rank], "tp": [args.rank]}}
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    from bench._ckpt_worker import anon_bytes_tree

    anon0 = anon_bytes_tree()
    write_json(args.ready, {"address": peer_transport.address, "pid": os.getpid()})

    ack = Path(str(args.done) + ".ack")
    sync = Path(str(args.done) + ".sync")
    sync_ack = Path(str(sync) + ".ack")
    sync_seq, settling = 0, None
    last_step_seen, step_seen_at = -1, time.monotonic()
    sends_seen, done_step, done_seen_at, sent_seen = 0, None, 0.0, -1
    every_in_training, sends_in_training = 1, 0
    agent_send_s: list[float] = []

    def busy() -> bool:
        return bool(node.sending or node.persisting)

    while True:
        # The sync request first: the rank writes it after its last slot is complete, so the step read
        # next includes that slot, and the tick below starts whatever backup or persist it makes due.
        if sync.exists():
            try:
                request = json.loads(sync.read_text())
                if int(request["seq"]) > sync_seq:
                    sync_seq, settling = int(request["seq"]), int(request["seq"])
            except (ValueError, KeyError):
                pass
        step = newest_complete_step(args.node_dir, args.rank)
        if step > last_step_seen:
            now = time.monotonic()
            if last_step_seen >= 0:
                per_step = (now - step_seen_at) / (step - last_step_seen)
                # The rank's slots advance only in its checkpointed blocks: a gap spanning a plain block (or
                # a sync) is no step time. The real agent gets the rank's own step time in its reports.
                if stand_in.step_time_s == 0:
                    stand_in.step_time_s = per_step
                elif per_step <= 3 * stand_in.step_time_s:
                    stand_in.step_time_s = 0.8 * stand_in.step_time_s + 0.2 * per_step
            last_step_seen, step_seen_at = step, now
        node.tick(time.monotonic(), groups, {args.rank: step} if step >= 0 else {})
        sends_seen = len(node_transport.sends)
        sent = node.progress[args.rank].last_sent_step
        if sent > sent_seen:
            # What the agent reports to the broker (the copy into its sent ring and the transfer): the broker
            # sets the interval from it, and so does this stand-in.
            sent_seen = sent
            agent_send_s.append(node.progress[args.rank].last_send_s)
            if done_step is None:
                stand_in.reschedule(node.progress[args.rank].last_send_s)
        if sent >= 0:
            stand_in.commit_peer(sent, next((r["bytes"] for r in reversed(node_transport.sends) if r["step"] == sent), 0))
        if settling is not None and not busy():
            write_json(sync_ack, {"seq": settling})
            settling = None
        if done_step is None and args.done.exists():
            try:
                done_step = int(json.loads(args.done.read_text())["last_step"])
            except (ValueError, KeyError):
                done_step = None
            done_seen_at = time.perf_counter()
            every_in_training, sends_in_training = stand_in.backup_every, sends_seen
            if done_step is not None and stand_in.backup_every != 1:
                stand_in.announce(1, "bench: the final step is backed up for the bitwise peer-restore check")
        if done_step is not None and node.progress[args.rank].last_sent_step >= done_step and not busy():
            break
        time.sleep(args.poll)

    drain_s = time.perf_counter() - done_seen_at  # backing up the final step, after the timed blocks
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    ok = [r for r in node_transport.sends if "error" not in r]
    errors = [r["error"] for r in node_transport.sends if "error" in r]
    held = peer_transport.held_backups()[0]
    newest = max(held, key=lambda h: h["step"]) if held else None
    from bench._ckpt_worker import allocated_bytes

    write_json(ack, {
        "address": peer_transport.address,
        "agent_code": "keel.agent.checkpointing.NodeCheckpointing over GrpcTransport (node and peer)",
        "backup_every_steps": every_in_training,
        "sends": len(ok),
        "sends_before_done": sends_in_training,
        "sent_steps": [r["step"] for r in ok],
        "send_errors": errors[:5],
        "skipped_steps": len(warnings.skipped),
        "send_s_mean": statistics.fmean(r["seconds"] for r in ok) if ok else None,
        "agent_send_s_mean": statistics.fmean(agent_send_s) if agent_send_s else None,
        "send_mb_per_s_mean": statistics.fmean(r["bytes"] / r["seconds"] for r in ok if r["seconds"] > 0) / 1e6 if ok else None,
        "last_sent_step": max((r["step"] for r in ok), default=-1),
        "backup_step": newest["step"] if newest else -1,
        "backup_sha256": newest["sha256"] if newest else "",
        "peer_backup_bytes": allocated_bytes([args.peer_dir]),
        "persists": stand_in.persists,
        "persist_errors": warnings.persist_errors[:5],
        "drain_s": drain_s,
        "agent_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        "agent_anon_bytes": anon_bytes_tree() - anon0,
    })
    try:
        while True:  # keep serving GetShard for the peer restore until terminated
            time.sleep(3600)
    finally:
        node.close(job_finished=False)
        peer.close(job_finished=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
