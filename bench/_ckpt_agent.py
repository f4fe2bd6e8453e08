"""The node agent's checkpoint duties, for the checkpoint benchmark's "Keel as shipped" variant.

    python -m bench._ckpt_agent --node-dir D --peer-dir P --persist-root R --job J --ready F --done G

A separate process beside the rank, as the node agent is: it watches the rank's slot files (the real
agent learns the newest committed step from the rank's report; here it reads the slot headers every
``--poll`` seconds), sends every newly committed step to the backup peer with the agent's
``ShardSender`` (gRPC ``PutShard``, latest wins, one transfer in flight: steps are skipped, never
queued), and every ``--persist-every`` steps writes the persistent tier with ``keel.checkpoint.disk``
(``write_shard``: temp file, fsync, rename; then the manifest, as the broker would for a world of one).

The backup peer is a ``ShardStoreServer`` over ``--peer-dir``, in this same process (on a real
cluster it is another node's agent; here both share the machine's two cores either way).

Protocol with the rank (files): this process writes ``--ready`` (JSON: the peer's address) once it
serves; the rank writes ``--done`` (JSON: its last step) after training; this process then makes sure
that step (or a newer one) reached the peer and that no persist is running, writes ``<done>.ack``
(JSON: what it did), and keeps serving the peer store (the rank fetches its backup from it to time
the peer restore) until it is terminated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
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
    p.add_argument("--backup-rate", type=float, default=None,
                   help="cap the backup stream at this many MB/s (ShardSender max_bytes_per_s; default: none, as the agent ships)")
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


def persist(node_dir: Path, root: Path, job: str, rank: int, step: int) -> dict[str, Any]:
    """The agent's persist of one step (read the slot, verify it, write the shard) and the broker's manifest."""
    from keel.agent.shard_store import read_committed_slot
    from keel.checkpoint import disk as ckpt_disk
    from keel.checkpoint.slots import SlotError

    started = time.perf_counter()
    try:
        header, payload = read_committed_slot(node_dir, rank, step)
    except SlotError as exc:
        return {"step": step, "error": str(exc)}
    written = ckpt_disk.write_shard(root, job, header.step, rank, payload)
    ckpt_disk.write_manifest(root, job, header.step, 1, [ckpt_disk.ShardEntry(rank, written.bytes, written.sha256)])
    ckpt_disk.apply_retention(root, job, keep=2)
    return {"step": header.step, "write_s": written.seconds, "total_s": time.perf_counter() - started,
            "bytes": written.bytes, "path": str(written.path)}


async def run(args: argparse.Namespace) -> None:
    if args.backup_duty is None:
        from keel.infra.config import CheckpointSettings

        args.backup_duty = CheckpointSettings().backup_max_duty
    from keel.agent.shard_store import ShardSender, ShardStoreServer, TlsMaterial, TransferOutcome

    args.node_dir.mkdir(parents=True, exist_ok=True)
    args.peer_dir.mkdir(parents=True, exist_ok=True)
    # The stores speak mTLS only: both ends get a certificate of the job's CA, as a launcher issues them.
    credentials = args.node_dir.parent / "credentials"
    tls = {node: TlsMaterial.issue(credentials, args.job, node, ("127.0.0.1",)) for node in ("node", "peer")}
    peer = ShardStoreServer(args.job, "peer", args.peer_dir, tls=tls["peer"], world_size=args.rank + 1)
    peer.assign_senders({args.rank: "node"})
    address = await peer.start("127.0.0.1", 0)
    outcomes: list[TransferOutcome] = []
    from keel.agent.checkpointing import SENT_DIR, keep_sent_copy
    from keel.checkpoint.slots import SlotError

    # As the agent does: copy the step into the sent ring, send from there (see keep_sent_copy).
    sender = ShardSender(args.job, "node", args.node_dir / SENT_DIR, tls=tls["node"], on_outcome=outcomes.append,
                         max_bytes_per_s=int(args.backup_rate * 1e6) if args.backup_rate else None)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    from bench._ckpt_worker import anon_bytes_tree

    anon0 = anon_bytes_tree()
    write_json(args.ready, {"address": address, "pid": os.getpid()})

    submitted, sends_started = -1, 0
    persisting: asyncio.Future | None = None
    next_persist = args.persist_every
    persists: list[dict[str, Any]] = []
    done_step: int | None = None
    ack = Path(str(args.done) + ".ack")
    sync = Path(str(args.done) + ".sync")
    sync_ack = Path(str(sync) + ".ack")
    sync_seq, sync_step, syncing = 0, -1, None

    async def settle(seq: int) -> None:
        await sender.wait_idle()
        while persisting is not None and not persisting.done():
            await asyncio.sleep(args.poll)
        write_json(sync_ack, {"seq": seq})

    # As shipped: backups only for steps that are multiples of the broker's interval (checkpoint
    # backup_max_duty; keel.checkpoint_broker.schedule.backup_interval), from the slowest measured transfer
    # and the step time; the newest such step, one transfer in flight.
    from keel.checkpoint_broker.schedule import backup_interval

    backup_every, seen_outcomes, last_step_seen, step_seen_at, step_time = 1, 0, -1, time.monotonic(), 0.0
    while True:
        step = newest_complete_step(args.node_dir, args.rank)
        if step > last_step_seen:
            now = time.monotonic()
            if last_step_seen >= 0:
                per_step = (now - step_seen_at) / (step - last_step_seen)
                step_time = per_step if step_time == 0 else 0.8 * step_time + 0.2 * per_step
            last_step_seen, step_seen_at = step, now
        if len(outcomes) > seen_outcomes:
            seen_outcomes = len(outcomes)
            finished = outcomes[-1].result
            if finished is not None and step_time > 0:
                backup_every = backup_interval(finished.seconds, step_time, args.backup_duty, 1000)
        idle = seen_outcomes >= sends_started
        wanted = step - step % backup_every if step >= 0 else -1
        if done_step is not None:
            wanted = step  # the final step, as the benchmark checks the peer holds it
        if wanted > submitted and idle and wanted >= 0:
            try:
                await asyncio.to_thread(keep_sent_copy, args.node_dir, args.rank, wanted)
            except SlotError:
                wanted = step  # the ring moved on: back up the newest step instead
                await asyncio.to_thread(keep_sent_copy, args.node_dir, args.rank, wanted)
            sender.submit(address, args.rank, wanted)
            sends_started += 1
            submitted = wanted
        if persisting is not None and persisting.done():
            persists.append(persisting.result())
            persisting = None
        if persisting is None and args.persist_every > 0 and step >= next_persist:
            # the first committed step at or past the next multiple of K (the real agent persists the
            # K-th step when the rank reports it; polling, this one may see a slightly later step)
            persisting = asyncio.ensure_future(asyncio.to_thread(
                persist, args.node_dir, args.persist_root, args.job, args.rank, step))
            next_persist = (step // args.persist_every + 1) * args.persist_every
        if sync.exists():
            try:
                request = json.loads(sync.read_text())
                if int(request["seq"]) > sync_seq:
                    sync_seq, sync_step = int(request["seq"]), int(request["step"])
            except (ValueError, KeyError):
                pass
        if sync_step >= 0 and (syncing is None or syncing.done()):  # paced: settle what runs, send nothing new
            syncing = asyncio.ensure_future(settle(sync_seq))
            sync_step = -1
        if done_step is None and args.done.exists():
            try:
                done_step = int(json.loads(args.done.read_text())["last_step"])
            except (ValueError, KeyError):
                done_step = None
        if done_step is not None and submitted >= done_step:
            break
        await asyncio.sleep(args.poll)

    drain_started = time.perf_counter()
    await sender.wait_idle()
    if persisting is not None:
        persists.append(await persisting)
    drain_s = time.perf_counter() - drain_started
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    sent = [o.result for o in outcomes if o.result is not None]
    errors = [str(o.error) for o in outcomes if o.error is not None]
    held, _ = peer.held_shards(verify=False)
    backups = [h for h in held if h.kind == "backup"]
    from bench._ckpt_worker import allocated_bytes

    write_json(ack, {
        "address": address,
        "backup_every_steps": backup_every,
        "sends": len(sent),
        "send_errors": errors[:5],
        "skipped_steps": sender.skipped_steps,
        "send_s_mean": statistics.fmean(r.seconds for r in sent) if sent else None,
        "send_mb_per_s_mean": statistics.fmean(r.bytes_per_s for r in sent) / 1e6 if sent else None,
        "last_sent_step": max((r.step for r in sent), default=-1),
        "backup_step": backups[-1].step if backups else -1,
        "backup_sha256": backups[-1].sha256 if backups else "",
        "peer_backup_bytes": allocated_bytes([args.peer_dir]),
        "persists": [p for p in persists if "error" not in p],
        "persist_errors": [p["error"] for p in persists if "error" in p][:5],
        "drain_s": drain_s,
        "agent_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        "agent_anon_bytes": anon_bytes_tree() - anon0,
    })
    while True:  # keep serving GetShard for the peer restore until terminated
        await asyncio.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        asyncio.run(run(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
