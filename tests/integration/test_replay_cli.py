"""A live decider through the shared runner, then `keel replay --verify` and `keel events` on its log."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import timedelta

import pytest

from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.events.envelope import Event
from keel.events.types import NodeEvictionDecided, NodeRegistered
from keel.infra.runner import DeciderRunner
from tests.factories import T0, health_event
from tests.integration.test_crashes import service_env

pytestmark = pytest.mark.integration


def keel(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "keel.cli.main", *args], env=env, capture_output=True, text=True, timeout=60)


async def run_controller_live(keel_env, policy: ControllerPolicy) -> DeciderRunner:
    runner = DeciderRunner(ControllerDecider(policy), keel_env.bus, keel_env.store, fetch_timeout_s=0.1)
    await runner.start()
    stop = asyncio.Event()
    keel_env.stops.append(stop)
    keel_env.tasks.append(asyncio.create_task(runner.run(stop)))
    return runner


def registrations(count: int = 20) -> list:
    """The job's nodes announce themselves (the controller ignores health events of nodes it never saw);
    20 of them, so the eviction breaker's 10 % allows the two evictions below."""
    return [Event.create(NodeRegistered(node_id=f"n{i}", host=f"h{i}"), job_id="job1", subject=f"node/n{i}",
                         producer="node-agent", occurred_at=T0 - timedelta(minutes=1)) for i in range(1, count + 1)]


def fault_sequence() -> list:
    return [
        health_event("n1", status="degraded", at=T0),
        health_event("n2", status="failed", fatal=True, confidence="high", component="gpu", detail="XID 79",
                     at=T0 + timedelta(seconds=1)),
        health_event("n3", status="failed", fatal=False, confidence="medium", component="nic", at=T0 + timedelta(seconds=2)),
        health_event("n2", status="failed", fatal=True, confidence="high", component="gpu", detail="XID 79 again",
                     at=T0 + timedelta(seconds=3)),
        health_event("n4", status="failed", fatal=True, confidence="high", component="disk", at=T0 + timedelta(seconds=4)),
    ]


async def test_live_decisions_are_recorded_and_replay_verifies_clean_then_flags_a_policy_change(keel_env) -> None:
    runner = await run_controller_live(keel_env, ControllerPolicy(command_ttl=timedelta(minutes=5)))
    await keel_env.start_recorder()
    inputs = registrations() + fault_sequence()
    for event in inputs:
        await keel_env.bus.publish(event)
    # 20 registrations + 5 inputs + 2 evictions (n2 once, n4 once).
    assert await keel_env.wait_for_count(27) == 27
    await asyncio.sleep(0.3)
    assert await keel_env.store.count() == 27
    assert runner.stats.emitted == 2
    decisions = [r.event async for r in keel_env.store.read(types=["NodeEvictionDecided"])]
    assert sorted(d.payload.node_id for d in decisions) == ["n2", "n4"]
    for decision in decisions:
        assert isinstance(decision.payload, NodeEvictionDecided)
        assert decision.causation_id in {e.id for e in inputs}
        assert "rung 1" in decision.payload.reason

    env = service_env(keel_env.settings)
    clean = keel(env, "replay", "--verify")
    assert clean.returncode == 0, clean.stderr
    assert "controller: folded 27 events, 2 recorded decisions, 2 replayed: clean" in clean.stdout

    changed = keel({**env, "KEEL_CONTROLLER__COMMAND_TTL": "10m"}, "replay", "--verify", "--service", "controller")
    assert changed.returncode == 1
    assert "2 divergence(s)" in changed.stdout
    assert "CHANGED NodeEvictionDecided" in changed.stdout and "payload.expires_at" in changed.stdout

    observe = keel({**env, "KEEL_CONTROLLER__OBSERVE_ONLY": "true"}, "replay", "--job", "job1")
    assert observe.returncode == 0  # without --verify a divergence is reported, not failed
    assert "payload.observe_only: recorded False -> replayed True" in observe.stdout

    unknown = keel(env, "replay", "--service", "controller", "--service", "nope")
    assert unknown.returncode == 2 and "no decider named 'nope'" in unknown.stderr
    two = keel(env, "replay", "--verify", "--service", "controller", "--service", "analyzer")
    assert two.returncode == 0, two.stderr
    assert [line.split(":")[0] for line in two.stdout.splitlines() if "folded" in line] == ["controller", "analyzer"]


async def test_controller_cold_start_rebuilds_from_the_log_and_does_not_decide_twice(keel_env) -> None:
    first = await run_controller_live(keel_env, ControllerPolicy())
    await keel_env.start_recorder()
    for event in registrations():
        await keel_env.bus.publish(event)
    await keel_env.bus.publish(fault_sequence()[1])
    assert await keel_env.wait_for_count(22) == 22
    assert first.stats.emitted == 1
    await keel_env.shutdown()
    keel_env.tasks.clear()
    keel_env.stops.clear()

    # A new controller process: same durable consumer, state folded from Postgres.
    await keel_env.bus.js.delete_consumer(keel_env.settings.bus.stream, "controller")  # force full redelivery
    second = await run_controller_live(keel_env, ControllerPolicy())
    await keel_env.start_recorder()
    assert second.session.state.job("job1").node("n2").eviction_pending is not None
    await keel_env.bus.publish(fault_sequence()[3])  # n2 again: an eviction is already pending
    await keel_env.bus.publish(fault_sequence()[4])  # n4: new
    assert await keel_env.wait_for_count(25) == 25
    await asyncio.sleep(0.3)
    assert second.stats.emitted == 1 and second.stats.skipped_redelivered >= 2
    assert [r.event.payload.node_id async for r in keel_env.store.read(types=["NodeEvictionDecided"])] == ["n2", "n4"]


async def test_events_tail_and_show(keel_env) -> None:
    inputs = fault_sequence()[:3]
    for event in inputs:
        await keel_env.bus.publish(event)
    await keel_env.start_recorder()
    await keel_env.wait_for_count(3)
    env = service_env(keel_env.settings)
    tail = keel(env, "events", "tail", "-n", "2")
    assert tail.returncode == 0, tail.stderr
    lines = tail.stdout.strip().splitlines()
    assert len(lines) == 2 and "node/n2" in lines[0] and "node/n3" in lines[1]
    show = keel(env, "events", "show", str(inputs[1].id))
    assert show.returncode == 0 and '"detail": "XID 79"' in show.stdout and '"js_seq"' in show.stdout
    missing = keel(env, "events", "show", "00000000-0000-0000-0000-000000000000")
    assert missing.returncode == 2 and "no event" in missing.stderr
    garbage = keel(env, "events", "show", "xyz")
    assert garbage.returncode == 2 and "not an event id" in garbage.stderr


def test_schema_check_and_bad_config_at_start(scratch_dir) -> None:
    import os

    check = keel(dict(os.environ), "events", "schema", "--check")
    assert check.returncode == 0, check.stderr
    bad = scratch_dir / "bad.yaml"
    bad.write_text("bus:\n  max_age: 30\n")
    result = keel(dict(os.environ), "--config", str(bad), "status")
    assert result.returncode == 2
    assert "bus.max_age: duration needs a unit" in result.stderr and str(bad) in result.stderr
