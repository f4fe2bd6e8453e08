"""Hot-update end to end, with real processes: `keel deploy` of a version directory, the hot-update service
and the controller deciding, agents restarting their ranks in place on the version, and the checkpoint
broker restoring them from memory.

1. A lazy version whose code raises at step k, forced at its deadline: it crashes, the restart in place
   fails again, rung 4 rolls back to the last stable version (the launch command), training continues from
   the in-memory checkpoint, and every step's loss equals a run that never saw the bad version.
2. A lazy faster version: nothing happens until an injected failure, whose restart applies it; the step
   time in the job's heartbeats drops.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.cluster.local import FaultSpec
from tests.integration.test_crashes import service_env
from tests.scenarios.test_checkpoint_resume import losses_of
from tests.scenarios.test_ladder import Stack

pytestmark = pytest.mark.integration

JOB = "hotupd"
STEPS = 200

# A version of the training code: the example workload with this version's change (a bug at one step, or
# faster steps) expressed as its own arguments, as a real change would be expressed in its code.
VERSION = """\
import runpy
import sys

sys.argv += {extra!r}
runpy.run_module("keel.workload.train", run_name="__main__", alter_sys=True)
"""


def write_version(directory: Path, extra: list[str]) -> Path:
    directory.mkdir(parents=True)
    (directory / "train.py").write_text(VERSION.format(extra=extra))
    return directory


def deploy(stack: Stack, directory: Path, *args: str) -> subprocess.CompletedProcess:
    """``keel deploy`` by operator ``ana``: her signing key (created on first use) signs the registration, so
    the event's ``by`` is her identity, not a name typed on the command line."""
    env = {**service_env(stack.settings), **stack.knobs, "KEEL_SIGNING__OPERATOR": "ana"}
    return subprocess.run([sys.executable, "-m", "keel.cli.main", "deploy", str(directory), "--job", stack.job,
                           *args], env=env, capture_output=True, text=True, timeout=120)


def reference_losses(directory: Path, train: list[str]) -> dict[int, str]:
    """The run that never saw a bad version: the same 2 ranks under `keel run` on one node, no checkpoints."""
    env = {**os.environ, "KEEL_HOME": str(directory)}
    env.pop("KEEL_NATS_URL", None)
    result = subprocess.run(
        [sys.executable, "-m", "keel.cli.main", "run", "--standalone", "--nproc-per-node", "2",
         "--keel-agent-dir", str(directory / "agent"), "--keel-no-checkpoint",
         *train], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses_of(list((directory / "agent" / "logs").glob("rank0.g*.stdout")))


@pytest.fixture
async def stack(keel_env, scratch_dir):  # type: ignore[no-untyped-def]
    await keel_env.start_recorder()
    running = Stack(keel_env, scratch_dir, JOB)
    try:
        yield running
    finally:
        await asyncio.to_thread(running.stop)


def knobs(stack: Stack, **extra: str) -> dict[str, str]:
    return {"KEEL_HOT_UPDATE__VERSIONS_DIR": str(stack.scratch / "versions"), **extra}


def newest_step(stack: Stack) -> int:
    """Rank 0's newest step line (heartbeats lag by up to their interval)."""
    return max(losses_of(list((stack.directory / "nodes").glob("*/logs/rank0.g*.stdout"))), default=-1)


async def test_a_bad_lazy_version_crashes_twice_and_rung4_rolls_back_to_the_last_stable_one(stack: Stack) -> None:
    train = ["-m", "keel.workload.train", "--size", "tiny", "--steps", str(STEPS)]
    reference = asyncio.create_task(asyncio.to_thread(reference_losses, stack.scratch / "reference", train))
    # Stability by time (8 s without an incident): the launch code earns it before the deploy; the bad
    # version crashes well within 8 s of running.
    await asyncio.to_thread(stack.start, nodes=2, standby=0, command=[*train, "--min-step-time", "100ms"],
                            more_services=("hot-update",),
                            extra=knobs(stack, KEEL_HOT_UPDATE__STABLE_STEPS="100000", KEEL_HOT_UPDATE__STABLE_TIME="8s"))
    stable = await stack.wait_for(["CodeVersionStable"], lambda e: True, 120, "the launch code to become stable")
    assert stable.payload.version_id == "launch", stable.payload
    at = newest_step(stack)
    bug_at = at + 60  # past where the forced rollout restores (about 1 to 2 s of 100 ms steps later)
    assert bug_at + 20 < STEPS, f"the job got too far ({at}) before the deploy"
    bad = write_version(stack.scratch / "src-bad", ["--bug-at-step", str(bug_at), "--bug-rank", "-1"])
    deployed = await asyncio.to_thread(deploy, stack, bad, "--lazy", "--deadline", "1s", "--why", "new data mix")
    assert deployed.returncode == 0, deployed.stderr
    [registered] = await stack.events(["CodeVersionRegistered"])
    version = registered.payload.version_id
    assert registered.payload.mode == "lazy" and registered.payload.by == "ana"

    # Forced at its deadline (nothing else restarts the job): a planned restart onto it, in place.
    request = await stack.wait_for(["CodeRolloutRequested"], lambda e: True, 30, "the deadline's rollout")
    assert request.payload.trigger == "deadline" and request.payload.version_id == version
    await stack.wait_for(["CodeVersionApplied"], lambda e: e.payload.version_id == version, 60, "the version running")
    # It raises at bug_at, then again after the restart in place: rung 4 rolls back to the launch code.
    rollback = await stack.wait_for(["RollbackDecided"], lambda e: True, 120, "the rollback")
    assert rollback.payload.to_version == "launch" and "2 times in a row" in rollback.payload.reason, rollback.payload
    resolved = await stack.wait_for(["IncidentResolved"], lambda e: e.payload.incident_id == rollback.payload.incident_id,
                                    90, "the rolled-back generation stepping")
    assert "resolved it: the cause was the user's code" in resolved.payload.reason, resolved.payload.reason
    assert resolved.payload.rung == 4 and resolved.payload.outcome == "recovered"
    applied = [e for e in await stack.events(["CodeVersionApplied"]) if e.payload.version_id == "launch"]
    assert {e.payload.node_id for e in applied} == {"n00", "n01"}, applied
    plan = await stack.wait_for(["CheckpointRestorePlanned"], lambda e: e.payload.generation == applied[0].payload.generation,
                                30, "the rollback's restore plan")
    assert plan.payload.step == bug_at - 1 and set(plan.payload.tiers) == {"memory"}, plan.payload
    # Nothing but the launch code afterwards: the job finishes, its losses those of a run without the bad code.
    await stack.wait_for(["RankExited"], lambda e: e.payload.classification == "success", 120, "the job's end")
    kinds = [e.payload.kind for e in await stack.events(["IncidentOpened"])]
    assert kinds == ["code_update", "user_code", "user_code"], kinds
    losses = losses_of(list((stack.directory / "nodes").glob("*/logs/rank0.g*.stdout")))
    expected = await reference
    assert sorted(expected) == list(range(STEPS))
    assert losses[STEPS - 1] == expected[STEPS - 1]  # the final loss, bitwise
    assert {step: expected[step] for step in losses} == losses  # and every step's that rank 0 printed
    # A rank stopped for a restart may have snapshotted a step without printing its line: only restore
    # points (never recomputed: the restored ranks go on after them) may be missing.
    restored = {e.payload.step for e in await stack.events(["CheckpointRestorePlanned"])}
    assert set(expected) - set(losses) <= restored, (sorted(set(expected) - set(losses)), restored)
    # `keel versions` tells the story.
    shown = subprocess.run([sys.executable, "-m", "keel.cli.main", "versions", "--job", stack.job],
                           env={**service_env(stack.settings), **stack.knobs}, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and f"rolled back {version}" in shown.stdout and "stable launch" in shown.stdout, shown.stdout
    await stack.stop_and_verify()


async def test_a_faster_lazy_version_waits_for_the_next_failure_which_applies_it(stack: Stack) -> None:
    train = ["-m", "keel.workload.train", "--size", "tiny", "--steps", "100000"]
    await asyncio.to_thread(stack.start, nodes=2, standby=0, command=[*train, "--min-step-time", "300ms"],
                            more_services=("hot-update",), extra=knobs(stack))
    await stack.stepping(10)
    faster = write_version(stack.scratch / "src-fast", ["--min-step-time", "60ms"])
    deployed = await asyncio.to_thread(deploy, stack, faster, "--why", "fused kernel")
    assert deployed.returncode == 0, deployed.stderr
    [registered] = await stack.events(["CodeVersionRegistered"])
    version = registered.payload.version_id
    await asyncio.sleep(6)  # lazy: nothing restarts for it
    assert await stack.events(["RestartDecided"]) == [] and await stack.events(["CodeRolloutRequested"]) == []
    slow = [e.payload.step_time_p50_s for e in await stack.events(["NodeHeartbeat"])
            if e.payload.step_time_p50_s is not None and not e.payload.standby]
    assert slow and min(slow[-2:]) >= 0.29, slow
    # A failure: its restart carries the version.
    opened, resolved, timeline = await stack.incident([FaultSpec(kind="crash", node="n01", rank=1)])
    assert resolved.payload.outcome == "recovered"
    [restart] = [e for e in timeline if e.type == "RestartDecided"]
    assert restart.payload.code_version == version and restart.payload.code_changed, restart.payload
    applied = await stack.wait_for(["CodeVersionApplied"], lambda e: e.payload.version_id == version, 30, "the version")
    # The throughput step, in the job's own metrics.
    start = time.monotonic()
    fast: list[float] = []
    while len(fast) < 4:
        assert time.monotonic() - start < 60, "no heartbeats of the new generation"
        await asyncio.sleep(1)
        fast = [e.payload.step_time_p50_s for e in await stack.events(["NodeHeartbeat"])
                if e.occurred_at > applied.occurred_at and e.payload.step_time_p50_s is not None
                and not e.payload.standby]
    assert max(fast[-2:]) < 0.6 * min(slow[-2:]), (slow, fast)
    await stack.stop_and_verify()
