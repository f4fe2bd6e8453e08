"""The Slurm actuator against a real Slurm (Debian's slurmctld, slurmd and munge, started here by
``keel.cluster.slurm_local``): drains with Keel's reason, leaves a human's drain alone, does nothing twice,
finds its standbys in the job's allocation and requests new ones with ``sbatch``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from keel.actuator.core import ActuatorError, refill_count
from keel.actuator.slurm import STANDBY_JOB_PREFIX, SlurmActuator, SlurmCommands
from keel.cluster import slurm_local
from keel.events.envelope import now_utc
from keel.events.types import StandbyRefillRequested

NODES = ["n1", "n2", "n3", "n4"]


@pytest.fixture(scope="module")
def slurm() -> Iterator[slurm_local.SlurmCluster]:
    try:
        cluster = slurm_local.start_cluster(NODES)
    except slurm_local.SlurmUnavailable as exc:
        if "root" in str(exc):
            pytest.skip(str(exc))  # CI runs as root; only a developer's unprivileged run gets here
        raise
    try:
        yield cluster
    finally:
        cluster.stop()


def wait_for(what: str, predicate, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        found = predicate()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def reason_of(cluster: slurm_local.SlurmCluster, node: str) -> str:
    return cluster.run("sinfo", "-h", "-n", node, "-o", "%E").stdout.strip()


def reason_line(cluster: slurm_local.SlurmCluster, node: str) -> str:
    """The node's reason with Slurm's [user@time] suffix: changes whenever anyone sets a reason."""
    line = cluster.run("scontrol", "show", "node", "-o", node).stdout
    return line.partition(" Reason=")[2].strip()


def test_evict_drains_standbys_and_refill_against_a_real_slurm(slurm: slurm_local.SlurmCluster, tmp_path: Path) -> None:
    # The training job: an allocation of 3 nodes, 2 of them workers (keel run starts the third as a standby).
    job = slurm.run("sbatch", "--parsable", "-J", "keel-train", "-N", "3", "--ntasks-per-node=1", "-o", "/dev/null",
                    "--wrap", "sleep 600").stdout.strip()
    allocation = wait_for("the training allocation running",
                          lambda: slurm.run("squeue", "-h", "-j", job, "-o", "%T %N").stdout.split() == ["RUNNING", "n[1-3]"])
    assert allocation
    try:
        actuator = SlurmActuator(SlurmCommands(slurm.conf), keel_job_id="job-s", state_dir=tmp_path, partition=slurm.partition,
                                 allocation_job_id=job, workers=2, standby_command=["sleep", "600"])
        assert actuator.standbys() == ["n3"]

        # Evict: drained with Keel's reason; the job's step keeps running (a drain starts nothing new, kills nothing).
        detail = actuator.evict("n2", "gpu_lost on GPU 1 (incident 1c2d)")
        assert "n2 drained in Slurm" in detail
        assert reason_of(slurm, "n2") == "keel: gpu_lost on GPU 1 (incident 1c2d)"
        assert slurm.states()["n2"] in ("drng", "drain")  # draining: the training job still holds it
        assert slurm.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() == "RUNNING"

        # The same command again (a redelivery): nothing is written twice (Slurm's reason stamp unchanged).
        stamped = reason_line(slurm, "n2")
        time.sleep(1.1)  # the stamp has a resolution of one second
        assert "already drained by Keel" in actuator.evict("n2", "gpu_lost on GPU 1 (incident 1c2d)")
        assert reason_line(slurm, "n2") == stamped

        # A human's drain is left as it is: reason kept, never resumed.
        slurm.run("scontrol", "update", "nodename=n1", "state=drain", "reason=swap the PSU")
        assert "does not write over" in actuator.evict("n1", "nic link_down")
        assert reason_of(slurm, "n1") == "swap the PSU"

        # The standby is promoted: no standby left; a refill asks Slurm for one node, which runs on idle n4.
        actuator.mark_promoted("n3")
        assert actuator.standbys() == []
        command = StandbyRefillRequested(count=1, target=1, reason="test", expires_at=now_utc() + timedelta(minutes=5))
        count, _ = refill_count(command, now_utc(), len(actuator.standbys()))
        started = actuator.provision_standbys(count)
        assert len(started) == 1 and started[0].startswith("slurm-job-")
        # Pending or running, it counts: the same refill redelivered starts nothing more.
        assert refill_count(command, now_utc(), len(actuator.standbys()))[0] == 0
        assert wait_for("the standby job on n4", lambda: actuator.standbys() == ["n4"])
        jobs = slurm.run("squeue", "-h", "-n", STANDBY_JOB_PREFIX + "job-s", "-o", "%T %N").stdout.split()
        assert jobs == ["RUNNING", "n4"]

        # The bookkeeping survives a restart of the actuator (a new process, the same state folder).
        again = SlurmActuator(SlurmCommands(slurm.conf), keel_job_id="job-s", state_dir=tmp_path,
                              allocation_job_id=job, workers=2)
        assert again.standbys() == ["n4"]

        # A standby drained by anyone is no standby.
        slurm.run("scontrol", "update", "nodename=n4", "state=drain", "reason=bad DIMM")
        assert again.standbys() == []
    finally:
        slurm.run("scancel", "-n", "keel-train", check=False)
        slurm.run("scancel", "-n", STANDBY_JOB_PREFIX + "job-s", check=False)
        for node in NODES:
            slurm.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)


def test_bad_commands_fail_clearly_and_change_nothing(slurm: slurm_local.SlurmCluster, tmp_path: Path) -> None:
    wait_for("every node idle", lambda: all(state == "idle" for state in slurm.states().values()))
    actuator = SlurmActuator(SlurmCommands(slurm.conf), keel_job_id="job-b", state_dir=tmp_path)
    with pytest.raises(ActuatorError, match="not a node of this Slurm cluster"):
        actuator.evict("gpu-node-99", "test")
    with pytest.raises(ActuatorError, match="no standby command is configured"):
        actuator.provision_standbys(1)
    assert actuator.standbys() == []
    assert all(state == "idle" for state in slurm.states().values())
    # A controller that cannot be reached is an error that says so, not a hang.
    broken = SlurmActuator(SlurmCommands(tmp_path / "missing.conf", timeout_s=10), keel_job_id="job-b", state_dir=tmp_path)
    with pytest.raises(ActuatorError):
        broken.evict("n1", "test")
