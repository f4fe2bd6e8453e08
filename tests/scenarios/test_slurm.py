"""Keel on a real Slurm (Debian's slurmctld, slurmd and munge, started here by ``keel.cluster.slurm_local``):
the example GPT (DP 2 x PP 2, 2 nodes x 2 ranks) runs under ``srun`` on an allocation of three Slurm nodes,
``keel run --nnodes 2`` on each: the third node starts as the job's warm standby. The control plane
(controller, broker, analyzer; the actuator with ``actuator.kind: slurm``) runs beside it.

A node's GPU reports a fatal XID: Keel detects it, the controller evicts the node, the Slurm actuator drains
it in Slurm with Keel's reason, the standby takes its ranks and training resumes from memory and the peer
copy; a refill asks Slurm for a new standby (a job of its own on the fourth, idle node). The job finishes
with every step's loss and the final state bitwise equal to an uninterrupted run's; ``keel replay
--verify`` is clean.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from keel.cluster import slurm_local
from keel.cluster.local import (
    FaultSpec,
    NodeInfo,
    apply_fault,
    ensure_private_dir,
    rendezvous_base_port,
    seed_overlay_root,
)
from keel.infra.config import credentials_path
from keel.infra.shard_ca import issue_node_certificate
from keel.infra.signing import keyring_path
from tests.scenarios.test_checkpoint_resume import TRAIN, assert_equal_to_reference, reference_run
from tests.scenarios.test_ladder import Stack

pytestmark = pytest.mark.integration

SLURM_NODES = ["n1", "n2", "n3", "n4"]
JOB = "slurmjob"


@pytest.fixture
def slurm() -> Iterator[slurm_local.SlurmCluster]:
    try:
        cluster = slurm_local.start_cluster(SLURM_NODES)
    except slurm_local.SlurmUnavailable as exc:
        if "root" in str(exc):
            print(f"SKIPPED: {exc}")
            pytest.skip(str(exc))  # CI runs as root
        raise
    try:
        yield cluster
    finally:
        cluster.stop()  # cancels the jobs first: their agents and ranks end with them


class SlurmStack(Stack):
    """The ladder's stack, its nodes' shared-memory folders in one place the test removes."""

    def __init__(self, keel_env, scratch: Path, job: str) -> None:  # type: ignore[no-untyped-def]
        super().__init__(keel_env, scratch, job)
        self.shm = Path("/dev/shm") / f"keel-slurm-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def stack(keel_env, scratch_dir) -> AsyncIterator[SlurmStack]:  # type: ignore[no-untyped-def]
    await keel_env.start_recorder()
    running = SlurmStack(keel_env, scratch_dir, JOB)
    try:
        yield running
    finally:
        await asyncio.to_thread(running.stop)
        shutil.rmtree(running.shm, ignore_errors=True)


def node_launcher(stack: SlurmStack, train: list[str]) -> Path:
    """The task every Slurm node runs (``srun`` starts one per node): ``keel run`` with this node's folders,
    named after ``$SLURMD_NODENAME``; node rank, node id and the standby role come from Slurm's variables.
    ``standby`` as its argument: a standby of a refill job (its own allocation, where it is node 0)."""
    base = stack.scratch / "slurm-nodes"
    shm = stack.shm
    tls_cases = []
    for node in SLURM_NODES:  # each node's folders and shard-store certificate, as a prolog would make them
        agent_dir = ensure_private_dir(base / node)
        seed_overlay_root(agent_dir / "root", gpus=2)
        tls = issue_node_certificate(credentials_path(stack.settings), JOB, node, hosts=("127.0.0.1",))
        tls_cases.append(f"  {node}) TLS=(--keel-tls-cert {tls.cert} --keel-tls-key {tls.key} --keel-tls-ca {tls.ca});;")
    script = stack.scratch / "keel-node.sh"
    keel_run = [sys.executable, "-m", "keel.cli.main", "run", "--nnodes", "2", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(rendezvous_base_port()), "--keel-job-id", JOB,
                "--keel-heartbeat-interval", "2s", "--keel-persist-root", str(stack.scratch / "checkpoints"),
                "--keel-store-address", "127.0.0.1:0", "--keel-fault-injection"]
    cases = "\n".join(tls_cases)
    script.write_text(f"""#!/bin/bash
# One Slurm node's Keel agent (srun runs this once per node).
set -eu
N="$SLURMD_NODENAME"
case "$N" in
{cases}
  *) echo "no certificate for node $N" >&2; exit 2;;
esac
STANDBY=()
if [ "${{1:-}}" = standby ]; then STANDBY=(--keel-standby); fi
exec {shlex.join(keel_run)} "${{STANDBY[@]}}" "${{TLS[@]}}" \\
  --keel-fault-domain "domain-$N" --keel-agent-dir {base}/"$N" --keel-root {base}/"$N"/root \\
  --keel-ckpt-dir {shm}/"$N" {shlex.join(train)}
""")
    script.chmod(0o755)
    return script


async def test_a_node_fault_under_srun_drains_the_node_in_slurm_and_the_standby_resumes_bitwise(
        slurm: slurm_local.SlurmCluster, stack: SlurmStack, scratch_dir: Path) -> None:
    reference = asyncio.create_task(asyncio.to_thread(reference_run, scratch_dir / "reference"))
    train = [*TRAIN, "--save-final", str(scratch_dir / "final")]
    env = await asyncio.to_thread(stack.start_services)
    # What srun hands every task (sbatch exports the submitting environment): the control plane's address and
    # credentials, and the keyring the agents check the controller's signatures against.
    agent_env = {**slurm.env(), **env, "OMP_NUM_THREADS": "1",
                 "KEEL_SIGNING__KEYRING": str(keyring_path(stack.settings))}
    launcher = node_launcher(stack, train)

    # The training job: 3 nodes, one task each; keel run --nnodes 2 makes the third a warm standby.
    submitted = await asyncio.to_thread(lambda: slurm.run(
        "sbatch", "--parsable", "-J", f"keel-{JOB}", "-N", "3", "--ntasks-per-node=1", "-o", str(scratch_dir / "slurm-%j.out"),
        "--wrap", f"srun --ntasks-per-node=1 --kill-on-bad-exit=0 {launcher}", env=agent_env))
    slurm_job = submitted.stdout.strip()
    # The actuator acts on Slurm: the allocation's nodes past its 2 workers are standbys; a refill submits
    # the same launcher as a standby job.
    await asyncio.to_thread(stack.start_service, "actuator", ["--job", JOB], {
        "KEEL_ACTUATOR__KIND": "slurm", "KEEL_ACTUATOR__SLURM__CONF": str(slurm.conf),
        "KEEL_ACTUATOR__SLURM__PARTITION": slurm.partition, "KEEL_ACTUATOR__SLURM__JOB_ID": slurm_job,
        "KEEL_ACTUATOR__SLURM__WORKERS": "2",
        "KEEL_ACTUATOR__SLURM__STANDBY_COMMAND": json.dumps(["srun", "--ntasks-per-node=1", str(launcher), "standby"]),
        "SLURM_CONF": str(slurm.conf), "OMP_NUM_THREADS": "1",
        "KEEL_SIGNING__KEYRING": str(keyring_path(stack.settings))})

    standby_check = await stack.wait_for(["StandbyChecked"], lambda e: e.payload.passed, 150, "the standby's self-check")
    assert standby_check.payload.node_id == "n3"  # Slurm's third node, past --nnodes 2
    await stack.stepping(8)
    await stack.wait_for(["CheckpointStepCommitted"], lambda e: e.payload.tier == "peer" and e.payload.step >= 5,
                         90, "a peer-tier commit past step 5")
    registered = {e.payload.node_id for e in await stack.events(["NodeRegistered"])}
    assert {"n1", "n2", "n3"} <= registered, registered

    # A fatal XID on n2's GPU (the overlay file the agent's NVML probe reads).
    seen = {e.id for e in await stack.events(["IncidentOpened"])}
    node = NodeInfo("n2", False, stack.scratch / "slurm-nodes" / "n2", stack.scratch / "slurm-nodes" / "n2" / "root", 0)
    apply_fault(node, FaultSpec(kind="xid", node="n2", params={"xid": 79}), str(uuid.uuid4()))
    opened = await stack.wait_for(["IncidentOpened"], lambda e: e.id not in seen, 90, "an incident for n2")
    assert opened.payload.node_id == "n2" and opened.payload.kind == "hardware", opened.payload
    resolved = await stack.wait_for(["IncidentResolved"], lambda e: e.payload.incident_id == str(opened.id), 180,
                                    "the incident's resolution")
    assert resolved.payload.outcome == "recovered", resolved.payload
    [restart] = [e for e in await stack.events(["RestartDecided"]) if e.correlation_id == opened.id]
    [promotion] = restart.payload.promotions
    assert restart.payload.evict == ["n2"] and promotion.standby_node_id == "n3" and promotion.ranks == [2, 3]

    # Drained in Slurm with Keel's reason; the job (and its other nodes) kept running.
    evicted = await stack.wait_for(["NodeEvicted"], lambda e: e.payload.node_id == "n2", 60, "the eviction")
    assert evicted.payload.actuator == "slurm" and evicted.payload.outcome == "evicted", evicted.payload
    reason = slurm.run("sinfo", "-h", "-n", "n2", "-o", "%E").stdout.strip()
    assert reason.startswith("keel:"), reason
    assert slurm.states()["n2"] in ("drng", "drain"), slurm.states()
    assert slurm.run("squeue", "-h", "-j", slurm_job, "-o", "%T").stdout.strip() == "RUNNING"

    # The refill: Slurm runs a standby job on the idle fourth node, whose agent checks itself and joins the pool.
    refill = await stack.wait_for(["StandbyChecked"], lambda e: e.payload.node_id == "n4", 180, "the refilled standby")
    assert refill.payload.passed, refill.payload
    standby_jobs = slurm.run("squeue", "-h", "-n", f"keel-standby-{JOB}", "-o", "%T %N").stdout.split()
    assert standby_jobs == ["RUNNING", "n4"], standby_jobs

    # The job finishes on n1 and n3; every step's loss and the final state equal the uninterrupted run's.
    await stack.wait_for(["RankExited"], lambda e: e.payload.generation == restart.payload.generation
                         and e.payload.rank == 0 and e.payload.classification == "success", 240, "the end of training")
    await reference
    await assert_equal_to_reference(scratch_dir, list((stack.scratch / "slurm-nodes").glob("*/logs/rank0.g*.stdout")))
    await stack.stop_and_verify()
