"""Each piece of the agent's loop is isolated: real rank processes under a running agent (``run``), real
datagrams on its socket, real slot files; a piece made to raise on every tick is logged once
(rate-limited) and the agent goes on heartbeating and running its ranks. Its outbox never connects: what
it emitted waits in ``outbox.pending``, in order."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from keel.agent.agent import NodeAgent
from keel.agent.channel import RankChannel
from keel.agent.checkpointing import NodeCheckpointing
from keel.agent.inspector_adapter import classify
from keel.agent.launch_spec import LaunchSpec
from keel.agent.rejoin import state_path
from keel.agent.supervisor import RankSupervisor
from keel.checkpoint import slots as ckpt_slots
from keel.cluster.local import rendezvous_base_port, seed_overlay_root
from keel.events.envelope import EventPayload
from keel.infra.config import BusSettings
from keel.infra.outbox import Outbox
from keel.protocol import node_local_pb2

pytestmark = pytest.mark.integration

SLEEPER = ("-c", "import time; time.sleep(120)")
REPORTER = ("-c", "import time, keel.sdk\nsession = keel.sdk.init()\nfor step in range(8):\n"
                  "    session.step_done(step, loss=1.0)\n    time.sleep(0.2)\ntime.sleep(120)")
"""A rank that reports steps 0..7 through the SDK, then idles."""


class BrokenProbes:
    """A health watcher whose probes raise on every sample (a bug, a probe meeting what nobody foresaw)."""

    def __init__(self) -> None:
        self.calls = 0

    def sample(self, now: datetime, channel: RankChannel, supervisor: RankSupervisor) -> list[EventPayload]:
        self.calls += 1
        raise RuntimeError("a probe broke")


def make_agent(directory: Path, watcher: BrokenProbes, command: tuple[str, ...] = SLEEPER) -> NodeAgent:
    root = directory / "n00" / "root"
    seed_overlay_root(root, gpus=2)
    spec = LaunchSpec(nnodes=1, nproc_per_node=2, node_rank=0, master_addr="127.0.0.1",
                      master_port=rendezvous_base_port(), command=command, job_id="job", node_id="n00",
                      agent_dir=directory / "n00", root=root, heartbeat_interval=timedelta(seconds=0.2),
                      probe_interval=timedelta(seconds=0.1), ckpt_dir=None, warm_ranks=False)
    return NodeAgent(spec, outbox=Outbox("nats://127.0.0.1:1", BusSettings(), name="test"), watcher=watcher,
                     classify=classify(spec), supervised=True)


async def test_a_piece_that_raises_on_every_tick_leaves_the_heartbeat_and_the_ranks_alone(
        scratch_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    watcher = BrokenProbes()
    agent = make_agent(scratch_dir, watcher, REPORTER)

    def broken(*_: object) -> None:
        raise ValueError("a bug in this piece")

    agent.metric_watch.check = broken  # type: ignore[method-assign]
    agent.rounds.poll = broken  # type: ignore[method-assign]
    agent.stacks.poll = broken  # type: ignore[method-assign]
    agent.supervisor.zygote_needed = broken  # type: ignore[method-assign]
    folded = agent.channel.apply

    def apply(report: node_local_pb2.RankReport, now: datetime) -> None:
        if report.rank == 1:
            raise KeyError("a report this agent cannot fold")
        folded(report, now)

    agent.channel.apply = apply  # type: ignore[method-assign]
    stop = asyncio.Event()
    caplog.set_level(logging.ERROR, logger="keel.agent.agent")
    running = asyncio.create_task(agent.run(stop))
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while len(agent.supervisor.alive()) < 2:
            assert asyncio.get_running_loop().time() < deadline and not running.done()
            await asyncio.sleep(0.05)
        pids = sorted(p.pid for p in agent.supervisor.alive())
        # The ranks report steps 0..7 themselves, 0.2 s apart (rank 1's reports cannot be folded).
        while 0 not in agent.channel.ranks or agent.channel.ranks[0].step < 7:
            assert asyncio.get_running_loop().time() < deadline and not running.done()
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        assert not running.done(), running
        assert agent.outbox is not None
        beats = [e for e in agent.outbox.pending if e.type == "NodeHeartbeat"]
        # >= 1.6 s at one beat per 0.2 s (the first at start), every one with both ranks alive and the
        # steps of the report that could be folded.
        assert len(beats) >= 6, len(beats)
        assert all(b.payload.ranks_alive == 2 for b in beats), [b.payload.ranks_alive for b in beats]
        assert beats[-1].payload.last_step == 7
        assert sorted(p.pid for p in agent.supervisor.alive()) == pids  # the same processes, untouched
        # Rank 1's step reports and its SDK's heartbeats: none folded, each counted; nothing came from elsewhere.
        assert 0 in agent.channel.ranks and 1 not in agent.channel.ranks and agent.channel.malformed >= 8
        assert agent.channel.rejected == 0
        failures = agent.pieces.failures
        assert {"metric watch", "diagnostics rounds", "stack captures", "health probes", "zygote upkeep"} <= set(
            failures), failures
        assert failures["diagnostics rounds"].total >= 10 and watcher.calls >= 10, (failures, watcher.calls)
        # Rate-limited: one log line (with the traceback) per piece, however often it failed.
        for piece in ("diagnostics rounds", "health probes"):
            lines = [r for r in caplog.records if f" {piece} failed" in r.getMessage()]
            assert len(lines) == 1 and lines[0].exc_info is not None, [r.getMessage() for r in lines]
        assert not [e for e in agent.outbox.pending if e.type == "RankExited"]
    finally:
        stop.set()
        result = await asyncio.wait_for(running, 30)
    assert result.exit_code == 143
    assert not agent.supervisor.alive()
    assert all(not _alive(pid) for pid in pids)
    stopped = [e for e in agent.outbox.pending if e.type == "RankExited"]
    assert sorted(e.payload.rank for e in stopped) == [0, 1]
    assert {e.payload.classification for e in stopped} == {"stopped_by_agent"}
    # Ended by itself: no state left for a successor to rejoin from.
    assert not state_path(agent.spec.agent_dir).exists()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def write_slot(node_dir: Path, rank: int, index: int, step: int, payload: bytes) -> None:
    writer = ckpt_slots.SlotWriter(ckpt_slots.slot_path(node_dir, rank, index), len(payload))
    try:
        writer.begin(step, 0)
        writer.payload_view()[: len(payload)] = payload
        writer.complete(step, len(payload), ckpt_slots.sha256_hex(payload), 0)
    finally:
        writer.close()


def test_a_checkpoint_duty_that_raises_leaves_the_others_running(scratch_dir: Path) -> None:
    emitted: list[tuple[EventPayload, str]] = []
    ckpt = NodeCheckpointing(job_id="job", node_id="n00", local_ranks=[0], world_size=1,
                             node_dir=scratch_dir / "slots", agent_dir=scratch_dir / "agent",
                             emit=lambda payload, subject=None: emitted.append((payload, subject or "")),
                             transport=None, persist_root=None, report_interval=timedelta(seconds=0))
    try:
        write_slot(ckpt.node_dir, 0, 0, 3, b"x" * 100)

        def broken(*_: object) -> None:
            raise OSError("the registration broke")

        ckpt._register = broken  # type: ignore[method-assign]
        for second in range(3):
            ckpt.tick(float(second), {0: {"dp": [0], "pp": [0], "tp": [0]}}, {0: 3})
        # What the heartbeat carries of the memory tier is still read (the registration's failure is the
        # only one), and the report round completes on the rank's steps as before.
        assert [(s.rank, s.step) for s in ckpt.holdings()["memory"]] == [(0, 3)]
        assert ckpt.report_due(3.0, {0: 3}, 1.0, timedelta(seconds=1))
        assert ckpt.pieces.failures["registration"].total == 3
        assert set(ckpt.pieces.failures) == {"registration"}
    finally:
        ckpt.close(job_finished=True)
