"""Shrink instead of stop (issue 19), end to end with real processes: an FSDP2 job on three nodes of a local
cluster loses a node to a fatal XID with no standby in the pool. With ``controller.shrink_without_standby`` on, the
real controller restarts the two nodes left as a job of two ranks; the real checkpoint broker plans every saved
rank's shard for both nodes (the lost rank's from its peer copy); each agent stages all three; each new rank loads
its part resharded. The job finishes with every loss equal, bit for bit, to PyTorch's own path for the same
change: the three-rank job saving that step with ``torch.distributed.checkpoint`` and a two-rank job loading it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel.cluster.local import FaultSpec
from keel.sdk.shard import decode_shard
from tests.integration.test_fsdp_checkpoint import _same
from tests.scenarios.test_checkpoint_resume import losses_of
from tests.scenarios.test_ladder import Stack

pytestmark = pytest.mark.integration

STEPS = 150
TRAIN = ["-m", "keel.workload.fsdp", "--size", "tiny", "--steps", str(STEPS)]


@pytest.fixture
async def stack(keel_env, scratch_dir):  # type: ignore[no-untyped-def]
    await keel_env.start_recorder()
    running = Stack(keel_env, scratch_dir, "shrink")
    try:
        yield running
    finally:
        await asyncio.to_thread(running.stop)


def standalone(directory: Path, nproc: int, *extra: str) -> None:
    """One reference leg under `keel run` on one node, no Keel checkpointing (``extra``: the DCP flags)."""
    env = {**os.environ, "KEEL_HOME": str(directory)}
    env.pop("KEEL_NATS_URL", None)
    result = subprocess.run(
        [sys.executable, "-m", "keel.cli.main", "run", "--standalone", "--nproc-per-node", str(nproc),
         "--keel-agent-dir", str(directory / "agent"), "--keel-no-checkpoint", *TRAIN, *extra],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


async def test_a_node_lost_without_a_standby_shrinks_the_job_and_it_trains_on_as_dcp_would_reshard(
        stack: Stack) -> None:
    final = stack.scratch / "final"
    await asyncio.to_thread(
        stack.start, nodes=3, standby=0, command=[*TRAIN, "--min-step-time", "300ms", "--save-final", str(final)],
        extra={"KEEL_CONTROLLER__SHRINK_WITHOUT_STANDBY": "true", "KEEL_CONTROLLER__STANDBY_MIN": "0"})
    await stack.stepping(8)
    await stack.wait_for(["CheckpointStepCommitted"], lambda e: e.payload.tier == "peer" and e.payload.step >= 5,
                         90, "a peer-tier commit past step 5")

    victim = stack.node_of_rank(1)
    opened, resolved, timeline = await stack.incident([FaultSpec(kind="xid", node=victim, params={"xid": 79})])
    assert opened.payload.kind == "hardware" and opened.payload.node_id == victim
    assert resolved.payload.outcome == "recovered" and resolved.payload.rung == 1, resolved.payload
    [restart] = [e for e in timeline if e.type == "RestartDecided"]
    assert restart.payload.world_size == 2 and restart.payload.promotions == [] and restart.payload.evict == [victim]
    assert "shrink from 3 to 2 ranks on 2 node(s)" in restart.payload.reason
    commands = {e.payload.node_id: (e.payload.node_rank, e.payload.nnodes) for e in timeline
                if e.type == "RanksRestartRequested"}
    survivors = [n for n in ("n00", "n01", "n02") if n != victim]
    assert commands == {survivors[0]: (0, 2), survivors[1]: (1, 2)}, commands
    plan = await stack.wait_for(["CheckpointRestorePlanned"],
                                lambda e: e.payload.generation == restart.payload.generation, 60, "the restore plan")
    assert plan.payload.reshard_from == 3 and plan.payload.step >= 5, plan.payload
    tiers = {s.rank: (s.tier, s.node_id) for s in plan.payload.sources}
    assert tiers[1][0] in ("peer", "disk") and tiers[1][1] != victim, tiers
    restored = plan.payload.step
    print(f"shrink: {victim} lost at step ~{opened.payload.last_step}; restored step {restored} onto 2 ranks ({tiers})")

    await stack.wait_for(["RankExited"], lambda e: e.payload.generation == restart.payload.generation
                         and e.payload.rank == 0 and e.payload.classification == "success", 300, "the end of training")
    await stack.stop_and_verify()

    # PyTorch's own path for the same change: 3 ranks save step `restored` with DCP, 2 ranks load it.
    reference = stack.scratch / "reference"
    dcp_dir = reference / "dcp"
    await asyncio.to_thread(standalone, reference / "three", 3, "--dcp-save-at", str(restored), "--dcp-dir",
                            str(dcp_dir))
    await asyncio.to_thread(standalone, reference / "two", 2, "--dcp-load", "--dcp-dir", str(dcp_dir),
                            "--save-final", str(reference / "final"))
    expected = {s: loss for s, loss in losses_of(
        list((reference / "three" / "agent" / "logs").glob("rank0.g*.stdout"))).items() if s <= restored}
    expected |= losses_of(list((reference / "two" / "agent" / "logs").glob("rank0.g*.stdout")))
    assert sorted(expected) == list(range(STEPS))
    ours = losses_of(list((stack.directory / "nodes" / survivors[0] / "logs").glob("rank0.g*.stdout")))
    assert ours == expected, [s for s in expected if ours.get(s) != expected[s]][:5]
    for rank in range(2):
        mine = decode_shard(Path(f"{final}.rank{rank}").read_bytes())[1]
        theirs = decode_shard(Path(f"{reference / 'final'}.rank{rank}").read_bytes())[1]
        for part in ("model", "optimizer", "scheduler", "sampler"):
            assert _same(mine[part], theirs[part]), f"rank {rank}'s final {part} differs"
