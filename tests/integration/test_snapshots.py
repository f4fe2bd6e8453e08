"""Deciders' snapshots with real NATS and PostgreSQL: a cold start folds the newest snapshot plus the log
after it and ends in the same state as a full fold; a snapshot of other code or policy, or one that fails
its digest, is not used; `keel replay --verify` folds the log to each snapshot and flags one that differs."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.infra.config import SnapshotSettings
from keel.infra.runner import DeciderRunner
from keel.infra.store import snapshots_table
from keel.kernel.decider import DeciderSession
from keel.kernel.snapshot import encode_state, state_digest
from tests.integration.test_crashes import service_env
from tests.integration.test_replay_cli import fault_sequence, keel, registrations

pytestmark = pytest.mark.integration

EVERY_5 = SnapshotSettings(min_events=5)


async def live_controller(keel_env, policy: ControllerPolicy | None = None,  # type: ignore[no-untyped-def]
                          snapshots: SnapshotSettings = EVERY_5) -> DeciderRunner:
    runner = DeciderRunner(ControllerDecider(policy or ControllerPolicy()), keel_env.bus, keel_env.store,
                           fetch_timeout_s=0.1, snapshots=snapshots)
    await runner.start()
    return runner


async def drain(runner: DeciderRunner, rounds: int = 20) -> None:
    for _ in range(rounds):
        await runner.run_once()


async def full_fold_state(keel_env, policy: ControllerPolicy | None = None):  # type: ignore[no-untyped-def]
    session = DeciderSession(ControllerDecider(policy or ControllerPolicy()))
    session.rebuild([r.event async for r in keel_env.store.read()])
    return session.state


async def test_a_cold_start_folds_the_newest_snapshot_and_only_the_log_after_it(keel_env) -> None:
    await keel_env.start_recorder()
    first = await live_controller(keel_env)
    for event in registrations() + fault_sequence()[:3]:
        await keel_env.bus.publish(event)
    await drain(first)
    assert await keel_env.wait_for_count(24) == 24  # 23 inputs and one eviction (n2)
    await drain(first, 5)  # acknowledge the echo too
    snapshot = await first.snapshot_now()
    assert snapshot is not None and snapshot.events_folded == 24
    for event in fault_sequence()[3:]:
        await keel_env.bus.publish(event)
    await drain(first)
    assert await keel_env.wait_for_count(27) == 27  # two more inputs and n4's eviction

    second = await live_controller(keel_env, snapshots=SnapshotSettings(min_events=1000))
    assert second.stats.snapshot_position == snapshot.position
    assert second.stats.folded == 3  # the log after the snapshot, not all 27
    assert second.stats.emitted == 0
    assert second.session.state == await full_fold_state(keel_env)
    assert second.session.state.job("job1").node("n4").eviction_pending is not None

    env = service_env(keel_env.settings)
    clean = keel(env, "replay", "--verify", "--service", "controller")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "controller: 1 snapshot(s) checked" in clean.stdout


async def test_replay_verify_flags_a_snapshot_the_log_does_not_give(keel_env) -> None:
    await keel_env.start_recorder()
    runner = await live_controller(keel_env)
    for event in registrations() + fault_sequence()[:2]:
        await keel_env.bus.publish(event)
    await drain(runner)
    assert await keel_env.wait_for_count(23) == 23
    await drain(runner, 5)
    snapshot = await runner.snapshot_now()
    assert snapshot is not None
    # A snapshot that holds another state (self-consistent: its digest matches what it holds).
    forged = encode_state(ControllerDecider().initial_state())
    async with keel_env.engine.begin() as conn:
        import zlib

        await conn.execute(sa.update(snapshots_table).values(state=zlib.compress(forged), digest=state_digest(forged)))
    verified = keel(service_env(keel_env.settings), "replay", "--verify", "--service", "controller")
    assert verified.returncode == 1, verified.stdout
    assert f"DIVERGED controller: the log folded to position {snapshot.position} does not give the state" in verified.stdout


async def test_a_snapshot_of_another_policy_or_failing_its_digest_is_not_used(keel_env) -> None:
    await keel_env.start_recorder()
    runner = await live_controller(keel_env)
    for event in registrations() + fault_sequence()[:2]:
        await keel_env.bus.publish(event)
    await drain(runner)
    assert await keel_env.wait_for_count(23) == 23
    await drain(runner, 5)
    assert await runner.snapshot_now() is not None
    await runner._events._sub.unsubscribe()  # type: ignore[union-attr]

    other_policy = ControllerPolicy(max_evictions=7)
    changed = await live_controller(keel_env, other_policy, snapshots=SnapshotSettings(min_events=1000))
    assert changed.stats.snapshot_position == 0 and changed.stats.folded == 23  # the whole log, once
    assert changed.session.state == await full_fold_state(keel_env, other_policy)
    await changed._events._sub.unsubscribe()  # type: ignore[union-attr]

    async with keel_env.engine.begin() as conn:
        await conn.execute(sa.update(snapshots_table).values(digest="0" * 64))
    damaged = await live_controller(keel_env, snapshots=SnapshotSettings(min_events=1000))
    assert damaged.stats.snapshot_position == 0 and damaged.stats.folded == 23
    assert damaged.session.state == await full_fold_state(keel_env)


async def test_a_cold_start_writes_a_snapshot_and_keeps_the_newest_few(keel_env) -> None:
    await keel_env.start_recorder()
    for event in registrations():
        await keel_env.bus.publish(event)
    assert await keel_env.wait_for_count(20) == 20
    runner = await live_controller(keel_env, snapshots=SnapshotSettings(min_events=5, keep=2))
    await drain(runner)  # the registrations were its unacknowledged tail: now acknowledged
    for round_ in range(3):
        for event in registrations(count=5 + round_):
            await keel_env.bus.publish(event.model_copy(update={"id": __import__("uuid").uuid4()}))
        await drain(runner)
        await asyncio.sleep(0.2)
        await drain(runner, 3)
        assert await runner.snapshot_now() is not None
    stored = await keel_env.store.snapshots("controller")
    assert len(stored) == 2  # the newest two of three
    assert stored[0].position > stored[1].position
    assert stored[0].events_folded == await keel_env.store.count()
