"""The FSDP2 example workload (``keel.workload.fsdp``, issue 19 item 6) on a local cluster of two nodes, with the
real checkpoint broker: every parameter and AdamW moment is a DTensor shard spread over both nodes. A rank
SIGKILLed mid-run is restored from its node's memory; a whole node lost (processes and shared memory) and
replaced comes back from the copy of its shard its peer holds (or the persistent tier, when that is newer). The
job finishes with every step's loss and both final shards bitwise equal to an uninterrupted run's."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from keel.cluster.local import cluster_up
from tests.integration.test_crashes import service_env
from tests.scenarios.test_checkpoint_resume import (
    Run,
    broker_run,
    kill_a_rank_and_restart,
    lose_and_replace_node,
    losses_of,
)

pytestmark = pytest.mark.integration

STEPS = 160
NODES = ["n00", "n01"]
TRAIN = ["-m", "keel.workload.fsdp", "--size", "tiny", "--steps", str(STEPS), "--min-step-time", "200ms"]


def reference_run(directory: Path) -> None:
    """The uninterrupted run: the same 2 ranks under `keel run` on one node, no checkpointing."""
    env = {**os.environ, "KEEL_HOME": str(directory)}
    env.pop("KEEL_NATS_URL", None)
    result = subprocess.run(
        [sys.executable, "-m", "keel.cli.main", "run", "--standalone", "--nproc-per-node", "2",
         "--keel-agent-dir", str(directory / "agent"), "--keel-no-checkpoint", *TRAIN,
         "--min-step-time", "0s", "--save-final", str(directory / "final")],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture
async def run(keel_env, scratch_dir):  # type: ignore[no-untyped-def]
    async with broker_run(keel_env, scratch_dir, NODES) as running:
        yield running


async def test_an_fsdp2_job_on_a_local_cluster_survives_a_killed_rank_and_a_lost_node_bitwise(
        run: Run, scratch_dir: Path) -> None:
    rng = random.Random(int(os.environ.get("KEEL_TEST_SEED", "19")))
    reference = asyncio.create_task(asyncio.to_thread(reference_run, scratch_dir / "reference"))
    env = {k: v for k, v in service_env(run.settings).items() if k.startswith("KEEL_")}
    env["KEEL_INSPECTOR__STEP_TIMEOUT_FLOOR"] = "60s"
    await asyncio.to_thread(
        cluster_up, run.settings, scratch_dir / "cluster", nodes=2, standby=0, nproc_per_node=1, job_id="ckpt",
        command=[*TRAIN, "--save-final", str(scratch_dir / "final")], nats_url=run.settings.nats_url,
        extra_env=env, heartbeat_interval="2s", persist_root=scratch_dir / "cluster" / "checkpoints")

    # 1. One rank SIGKILLed at a random step: both ranks restored from their nodes' memory.
    await run.wait_step(rng.randint(6, 14))
    victim = rng.choice(NODES)
    plan = await kill_a_rank_and_restart(run, scratch_dir, victim)
    first_restore = plan.payload.step
    await run.wait_step(first_restore + 8)
    await run.wait_peer_commit_after(plan)

    # 2. A whole node lost and replaced by a fresh machine: its shard comes back from its peer's copy, or from
    #    the persistent tier when that holds a newer step for both ranks.
    lost = rng.choice(NODES)
    plan = await lose_and_replace_node(run, scratch_dir, lost)
    tiers = {s.rank: s.tier for s in plan.payload.sources}
    lost_rank = NODES.index(lost)
    assert plan.payload.step > first_restore, plan.payload
    assert tiers[lost_rank] in ("peer", "disk"), (tiers, await run.inventories())
    print(f"FSDP2 on a local cluster: rank on {victim} killed, restored step {first_restore} from memory; node {lost} "
          f"lost, restored step {plan.payload.step} ({tiers})")

    # The job finishes; every step's loss and both final shards equal the uninterrupted run, bit for bit.
    await run.wait_for(["RankExited"], lambda e: e.payload.generation == run.generation and e.payload.rank == 0
                       and e.payload.classification == "success", 240, "the end of training")
    await reference
    reference_losses = losses_of(list((scratch_dir / "reference" / "agent" / "logs").glob("rank0.g*.stdout")))
    assert sorted(reference_losses) == list(range(STEPS))
    assert losses_of(run.rank0_stdout()) == reference_losses
    for rank in range(2):
        final = Path(f"{scratch_dir / 'final'}.rank{rank}").read_bytes()
        assert final == Path(f"{scratch_dir / 'reference' / 'final'}.rank{rank}").read_bytes(), f"rank {rank}"
