"""The node-local channel and folders against another local process: real agents, real rank processes, real
senders. A process that is not a rank cannot fail a rank; an agent folder someone else created stops
``keel run`` before it starts, with the folder, its owner and the fix; a restore plan that is a link is
refused by the rank."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from keel.agent.agent import NodeAgent
from keel.agent.inspector_adapter import classify
from keel.agent.launch_spec import LaunchSpec
from keel.cluster.local import alive, rendezvous_base_port
from keel.infra.config import BusSettings
from keel.infra.outbox import Outbox
from keel.protocol import node_local_pb2

pytestmark = pytest.mark.integration

NOBODY = 65534
SLEEPER = ("-c", "import time; time.sleep(120)")
FORGE = ("import socket, sys\n"
         "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
         "for _ in range(5): s.sendto(bytes.fromhex(sys.argv[2]), sys.argv[1])\n")
"""A local process (not a rank) sending a datagram five times."""


async def test_a_failure_sent_by_a_process_that_is_not_the_rank_kills_nothing(scratch_dir: Path) -> None:
    spec = LaunchSpec(nnodes=1, nproc_per_node=2, node_rank=0, master_addr="127.0.0.1",
                      master_port=rendezvous_base_port(), command=SLEEPER, job_id="job", node_id="n00",
                      agent_dir=scratch_dir / "n00", heartbeat_interval=timedelta(seconds=0.2),
                      probe_interval=timedelta(seconds=0.1), ckpt_dir=None, warm_ranks=False)
    agent = NodeAgent(spec, outbox=Outbox("nats://127.0.0.1:1", BusSettings(), name="test"), watcher=None,
                      classify=classify(spec), supervised=True)
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))

    async def until(condition: Callable[[], bool]) -> None:
        for _ in range(600):  # 30 s
            if condition():
                return
            assert not running.done(), running
            await asyncio.sleep(0.05)
        raise AssertionError("timed out")

    try:
        await until(lambda: len(agent.supervisor.alive()) == 2)
        victim = agent.supervisor.ranks[0]
        # Everything a rank's own report of failure says, rank and pid included: only the sender differs.
        forged = node_local_pb2.RankReport(rank=0, local_rank=0, pid=victim.pid, generation=0, seq=1, step=3,
                                           phase=node_local_pb2.PHASE_FAILED, error="RuntimeError: forged")
        await asyncio.to_thread(subprocess.run, [sys.executable, "-c", FORGE, str(agent.channel.path),
                                                 forged.SerializeToString().hex()], check=True, timeout=60)
        await until(lambda: agent.channel.rejected == 5)
        await asyncio.sleep(0.5)  # several ticks: a report taken would have killed the rank by now
        assert alive(victim.pid) and len(agent.supervisor.alive()) == 2
        assert agent.channel.ranks == {} and not victim.reported_failure
        assert agent.outbox is not None and not [e for e in agent.outbox.pending if e.type == "RankExited"]
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)


def _keel_run(agent_dir: Path, scratch_dir: Path) -> subprocess.CompletedProcess[str]:
    script = scratch_dir / "rank.py"
    script.write_text("print('a rank ran')\n")
    argv = [sys.executable, "-m", "keel.cli.main", "run", "--standalone",
            "--keel-agent-dir", str(agent_dir), "--keel-ckpt-dir", str(scratch_dir / "slots"), "--keel-no-warm-ranks",
            str(script)]
    env = {k: v for k, v in os.environ.items() if k != "KEEL_NATS_URL"} | {"KEEL_HOME": str(scratch_dir / "home")}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can hand a folder to another user (CI runs as root)")
def test_an_agent_folder_someone_else_created_stops_keel_run_with_a_clear_error(scratch_dir: Path) -> None:
    planted = scratch_dir / "keel-agent-n00"
    planted.mkdir(mode=0o777)
    os.chown(planted, NOBODY, NOBODY)
    done = _keel_run(planted, scratch_dir)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert f"keel run: refusing to start: folder {planted} is owned by" in done.stderr, done.stderr[-2000:]
    assert f"uid {NOBODY}" in done.stderr and "--keel-agent-dir" in done.stderr, done.stderr[-2000:]
    assert list(planted.iterdir()) == []  # no socket, no lock, no log written into it
    # The same launch in a folder of this user's own runs.
    mine = scratch_dir / "agent"
    ok = _keel_run(mine, scratch_dir)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "a rank ran" in (mine / "logs" / "rank0.g0.stdout").read_text()
    assert os.stat(mine).st_mode & 0o777 == 0o700


def test_a_slot_folder_that_is_a_link_stops_keel_run(scratch_dir: Path) -> None:
    target = scratch_dir / "elsewhere"
    target.mkdir()
    (scratch_dir / "slots").symlink_to(target)
    done = _keel_run(scratch_dir / "agent", scratch_dir)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert f"folder {scratch_dir / 'slots'} is a symbolic link" in done.stderr and "--keel-ckpt-dir" in done.stderr
    assert list(target.iterdir()) == []


def test_a_restore_plan_that_is_a_link_is_refused_by_the_rank(scratch_dir: Path) -> None:
    # The plan names the file to load and whether it was verified; a planted link must not be followed.
    real = scratch_dir / "real.json"
    real.write_text(json.dumps({"generation": 1, "step": -1, "shards": {}}))
    plan = scratch_dir / "g1.json"
    plan.symlink_to(real)
    script = ("import torch, keel.sdk\n"
              "ckpt = keel.sdk.Checkpointer(model=torch.nn.Linear(2, 2), rank=0, world_size=1)\n"
              "try:\n    ckpt.restore()\nexcept keel.sdk.CheckpointError as exc:\n    print(exc)\n    raise SystemExit(3)\n")
    env = dict(os.environ, KEEL_RESTORE_PLAN=str(plan), KEEL_RESTORE_TIMEOUT="5s")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "is a symbolic link" in done.stdout, done.stdout
