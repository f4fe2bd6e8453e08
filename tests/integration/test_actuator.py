"""The local actuator against a real local cluster: evictions carried out (and refused when expired),
standbys provisioned by refill requests, outcomes reported as events. Plus its pure outcome rules."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from keel.actuator.adapter import ActuatorService
from keel.actuator.core import eviction_outcome, refill_count
from keel.actuator.local import LocalActuator, _standby_argv
from keel.cluster.local import alive, cluster_down, cluster_up, load_cluster
from keel.events.envelope import Event, now_utc
from keel.events.types import NodeEvictionDecided, StandbyPromotionRequested, StandbyRefillRequested
from tests.integration.test_crashes import service_env

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)


def eviction(node: str, expires_at: datetime, observe_only: bool = False) -> NodeEvictionDecided:
    return NodeEvictionDecided(node_id=node, rung=1, reason="test", expires_at=expires_at, observe_only=observe_only)


def test_eviction_outcomes_follow_expiry_and_observe_mode() -> None:
    assert eviction_outcome(eviction("n1", T0 + timedelta(minutes=5)), T0) is None
    expired = eviction_outcome(eviction("n1", T0), T0 + timedelta(seconds=1))
    assert expired is not None and expired.outcome == "expired" and "expired at" in expired.detail
    observe = eviction_outcome(eviction("n1", T0 + timedelta(minutes=5), observe_only=True), T0)
    assert observe is not None and observe.outcome == "skipped_observe_only"


def test_refill_is_idempotent_towards_its_target() -> None:
    command = StandbyRefillRequested(count=2, target=2, reason="r", expires_at=T0 + timedelta(minutes=5))
    assert refill_count(command, T0, 0)[0] == 2
    assert refill_count(command, T0, 1)[0] == 1
    count, why = refill_count(command, T0, 2)
    assert count == 0 and "nothing to start" in why
    assert refill_count(command, T0 + timedelta(hours=1), 0)[0] == 0


def test_a_standby_command_line_keeps_the_training_command_under_its_own_identity() -> None:
    worker = ["python", "-m", "keel.cli.main", "run", "--node-rank", "1", "--keel-node-id", "n01",
              "--keel-agent-dir", "/c/nodes/n01", "--keel-root", "/c/nodes/n01/root", "--keel-ckpt-dir", "/shm/n01",
              "--keel-fault-domain", "domain-1", "--keel-tls-cert", "/cred/n01/cert.pem",
              "--keel-tls-key", "/cred/n01/key.pem", "--keel-tls-ca", "/cred/n01/ca.pem",
              "-m", "keel.workload.train", "--steps", "9"]
    argv = _standby_argv(worker, node_id="s03", agent_dir=Path("/c/nodes/s03"), root=Path("/c/nodes/s03/root"),
                         ckpt_dir=Path("/shm/s03"), fault_domain="domain-s03")
    assert argv[argv.index("--keel-node-id") + 1] == "s03" and "n01" not in " ".join(argv)
    assert argv[argv.index("run") + 1] == "--keel-standby" and argv.count("--keel-standby") == 1
    assert argv[-4:] == ["-m", "keel.workload.train", "--steps", "9"]
    # The worker's certificate names the worker: the standby's agent issues its own.
    assert not [a for a in argv if a.startswith("--keel-tls-") or a.startswith("/cred/")]


@pytest.mark.integration
async def test_local_actuator_evicts_refuses_stale_commands_and_refills_the_pool(keel_env, scratch_dir) -> None:
    await keel_env.start_recorder()
    directory = scratch_dir / "cluster"
    env = {k: v for k, v in service_env(keel_env.settings).items() if k.startswith("KEEL_")}
    await asyncio.to_thread(
        cluster_up, keel_env.settings, directory, nodes=2, standby=0, nproc_per_node=1, job_id="act",
        command=["-m", "keel.workload.train", "--size", "tiny", "--steps", "1000000"],
        nats_url=keel_env.settings.nats_url, extra_env=env, heartbeat_interval="2s")
    service = ActuatorService(keel_env.bus, LocalActuator(directory, grace_s=5))
    await service.start()
    stop = asyncio.Event()
    keel_env.stops.append(stop)
    keel_env.tasks.append(asyncio.create_task(service.run(stop)))
    try:
        pids = {n["node_id"]: n["pid"] for n in load_cluster(directory)["nodes"]}
        # A stale command (a cold start replaying an old decision) is refused; a live one carried out.
        for node, expires in (("n00", now_utc() - timedelta(seconds=1)), ("n01", now_utc() + timedelta(minutes=5))):
            await keel_env.bus.publish(Event.create(eviction(node, expires), job_id="act", subject=f"node/{node}",
                                                    producer="controller", occurred_at=now_utc()))
        reports = await wait_events(keel_env, "act", ["NodeEvicted"], 2, 60)
        outcomes = {e.payload.node_id: e.payload.outcome for e in reports}
        assert outcomes == {"n00": "expired", "n01": "evicted"}, [e.payload for e in reports]
        assert alive(pids["n00"]) and not alive(pids["n01"])
        assert {n["node_id"]: n.get("evicted", False) for n in load_cluster(directory)["nodes"]} == {
            "n00": False, "n01": True}
        # A refill towards 1 standby starts one, which registers itself as a standby; a second request
        # for the same target starts nothing more.
        for _ in range(2):
            refill = StandbyRefillRequested(count=1, target=1, reason="test", expires_at=now_utc() + timedelta(minutes=5))
            await keel_env.bus.publish(Event.create(refill, job_id="act", subject="job/act", producer="controller",
                                                    occurred_at=now_utc()))
            await asyncio.sleep(1.0)
        registered = await wait_events(keel_env, "act", ["NodeRegistered"], 1, 60, lambda e: e.payload.standby)
        await asyncio.sleep(2.0)  # time for a second standby to register, had the refill not been idempotent
        registered = [r.event async for r in keel_env.store.read(job_id="act", types=["NodeRegistered"])]
        assert [e.payload.node_id for e in registered if e.payload.standby] == ["s00"]
        assert [n["node_id"] for n in load_cluster(directory)["nodes"] if n["standby"]] == ["s00"]
        # s00 is promoted into n01's slice: it leaves the pool, and the refill that follows in the same
        # decision starts another standby.
        promote = StandbyPromotionRequested(node_id="s00", replaces_node_id="n01", node_rank=1, ranks=[1],
                                            generation=1, reason="test", expires_at=now_utc() + timedelta(minutes=5))
        refill = StandbyRefillRequested(count=1, target=1, reason="test", expires_at=now_utc() + timedelta(minutes=5))
        for payload, subject in ((promote, "node/s00"), (refill, "job/act")):
            await keel_env.bus.publish(Event.create(payload, job_id="act", subject=subject, producer="controller",
                                                    occurred_at=now_utc()))
        await wait_events(keel_env, "act", ["NodeRegistered"], 2, 60, lambda e: e.payload.standby)
        nodes = {n["node_id"]: n for n in load_cluster(directory)["nodes"]}
        assert nodes["s00"]["promoted"] and not nodes["s00"]["standby"] and nodes["s01"]["standby"]
    finally:
        await asyncio.to_thread(cluster_down, directory)


async def wait_events(keel_env, job: str, types: list[str], count: int, timeout_s: float,  # type: ignore[no-untyped-def]
                      predicate=lambda e: True) -> list[Event]:
    """The job's events of ``types`` once at least ``count`` of them match ``predicate``."""
    deadline = time.monotonic() + timeout_s
    found: list[Event] = []
    while time.monotonic() < deadline:
        found = [r.event async for r in keel_env.store.read(job_id=job, types=types)]
        if sum(1 for e in found if predicate(e)) >= count:
            return found
        await asyncio.sleep(0.2)
    raise AssertionError(f"{count} {types} within {timeout_s}s: got {[e.payload for e in found]}")
