"""The steady-state event budget: shard holdings coalesced into heartbeats, report rounds on a shared step
grid, the heartbeat cadence, the broker folding heartbeat-carried reports (and old shard reports), and
the quiet job clock."""

from __future__ import annotations

from datetime import timedelta

import pytest

from keel.agent.agent import heartbeat_cadence
from keel.agent.checkpointing import report_round_steps
from keel.checkpoint_broker.decider import CheckpointBrokerDecider
from keel.checkpoint_broker.state import heartbeat_reports
from keel.controller.adapter import ROUTINE_INPUTS, Controller, quiet_clock
from keel.events.envelope import Event
from keel.events.types import (
    CheckpointInventoryReported,
    CheckpointShardsStored,
    CheckpointStepCommitted,
    NodeHeartbeat,
    ShardRecord,
)
from keel.infra.clock import tick_event
from keel.infra.config import ControllerSettings, Settings
from keel.kernel.decider import DeciderSession
from tests.factories import T0
from tests.unit.test_checkpoint_broker import JOB, emitted_of, ev, registered_session, shards, topology

# -- report rounds and the heartbeat cadence (agent) ----------------------------------------------------


def test_report_rounds_are_the_smallest_power_of_two_of_at_least_the_period() -> None:
    period = timedelta(seconds=5)
    assert report_round_steps(1, None, period) is None  # no step time yet: no round
    assert report_round_steps(1, 0.0, period) is None
    assert report_round_steps(1, 0.1, period) == 64  # 50 steps wanted: 6.4 s a round
    assert report_round_steps(1, 10.0, period) == 1  # one slow step is a round
    assert report_round_steps(128, 0.1, period) == 128  # never finer than the backup interval
    assert report_round_steps(4, 0.02, timedelta(seconds=1)) == 64
    for step_time in (0.013, 0.1, 0.37, 1.9, 7.0):
        every = report_round_steps(2, step_time, period)
        assert every is not None and every & (every - 1) == 0 and every % 2 == 0
        # Every round to twice the period apart (or one step when a step is longer than that).
        assert every * step_time >= 5.0 or every == 2
        assert every == 2 or (every // 2) * step_time < 5.0


def test_nodes_with_step_times_on_either_side_of_a_boundary_still_share_every_coarser_round() -> None:
    period = timedelta(seconds=5)
    fine, coarse = report_round_steps(1, 0.0785, period), report_round_steps(1, 0.0775, period)
    assert (fine, coarse) == (64, 128)
    # Every multiple of the coarser interval is a round of both: the broker can commit those steps.
    assert all(step % fine == 0 for step in range(0, 10_000, coarse))


def test_heartbeat_cadence_one_per_round_and_a_fallback_at_twice_the_interval() -> None:
    interval = timedelta(seconds=5)
    assert heartbeat_cadence(None, interval, round_done=False, rounds_flowing=False)  # the first one
    assert heartbeat_cadence(timedelta(seconds=0.3), interval, round_done=True, rounds_flowing=True)
    # No rounds (no checkpointing, a standby, a stalled job): every interval, as before.
    assert not heartbeat_cadence(timedelta(seconds=4.9), interval, round_done=False, rounds_flowing=False)
    assert heartbeat_cadence(timedelta(seconds=5), interval, round_done=False, rounds_flowing=False)
    # Rounds flowing: no timer heartbeat in between two rounds, but never more than twice the interval.
    assert not heartbeat_cadence(timedelta(seconds=9.9), interval, round_done=False, rounds_flowing=True)
    assert heartbeat_cadence(timedelta(seconds=10), interval, round_done=False, rounds_flowing=True)


# -- the broker folds heartbeat-carried holdings -----------------------------------------------------------


def records(pairs: list[tuple[int, int]], owner: str = "", send_s: float = 0.0) -> list[ShardRecord]:
    return [ShardRecord(rank=r, step=s, bytes=100, digest=f"{r:02d}{s:062d}", owner_node_id=owner, send_s=send_s)
            for r, s in pairs]


def beat(node: str, memory: list[tuple[int, int]], peer: list[tuple[int, int]] | None = None, owner: str = "",
         at_s: float = 0.0, send_s: float = 0.0) -> Event:
    stored = {"memory": records(memory, send_s=send_s)}
    if peer:
        stored["peer"] = records(peer, owner=owner)
    return ev(NodeHeartbeat(node_id=node, ranks_alive=2, ranks_expected=2, step_time_p50_s=0.1,
                            stored=stored),  # type: ignore[arg-type]
              f"node/{node}", T0 + timedelta(seconds=at_s))


def test_heartbeat_reports_are_one_shard_report_per_tier_in_a_fixed_order() -> None:
    payload = beat("n0", [(0, 64)], [(2, 64)], owner="n1").payload
    assert isinstance(payload, NodeHeartbeat)
    reports = heartbeat_reports(payload)
    assert [(r.tier, [s.rank for s in r.shards]) for r in reports] == [("memory", [0]), ("peer", [2])]
    assert heartbeat_reports(NodeHeartbeat(node_id="n0", ranks_alive=0, ranks_expected=0)) == []


def test_heartbeats_carrying_a_report_round_commit_memory_and_peer_once_each() -> None:
    session = registered_session(topology(2, 2, 1, 2))  # n0: ranks 0, 1; n1: ranks 2, 3
    # n0 holds rounds 64 and 128; n1 backs up n0's ranks (and n0 n1's).
    first = beat("n0", [(0, 64), (1, 64), (0, 128), (1, 128)], [(2, 64), (3, 64)], owner="n1", send_s=0.4)
    assert emitted_of(session, [first], CheckpointStepCommitted) == []
    second = beat("n1", [(2, 64), (3, 64)], [(0, 64), (1, 64)], owner="n0", at_s=2.0)
    commits = emitted_of(session, [second], CheckpointStepCommitted)
    assert sorted((c.tier, c.step, c.ranks) for c in commits) == [("memory", 64, 4), ("peer", 64, 4)]
    # The same holdings again (the next heartbeat before the next round): nothing new.
    assert emitted_of(session, [beat("n1", [(2, 64), (3, 64)], [(0, 64), (1, 64)], owner="n0", at_s=7)],
                      CheckpointStepCommitted) == []
    # Round 128 is complete at 9 s, 7 s after the last commit: held back (one commit per 10 s and tier)
    # until a heartbeat after the period reports it again.
    assert emitted_of(session, [beat("n1", [(2, 128), (3, 128)], at_s=9)], CheckpointStepCommitted) == []
    [later] = emitted_of(session, [beat("n1", [(2, 128), (3, 128)], at_s=12)], CheckpointStepCommitted)
    assert (later.tier, later.step) == ("memory", 128)
    job = session.state.job(JOB)
    assert job.committed == {"memory": 128, "peer": 64}
    assert job.schedule.send_s == {0: 0.4, 1: 0.4}  # the memory records' transfer times still set the schedule


def test_a_peer_copy_on_its_owners_node_never_counts_in_a_heartbeat_either() -> None:
    session = registered_session(topology(2, 2, 1, 2))
    own = beat("n0", [(0, 64), (1, 64)], [(0, 64), (1, 64)], owner="n0")
    other = beat("n1", [(2, 64), (3, 64)], [(2, 64), (3, 64)], owner="n1")
    commits = emitted_of(session, [own, other], CheckpointStepCommitted)
    assert [(c.tier, c.step) for c in commits] == [("memory", 64)]


def test_an_old_log_of_shard_reports_and_a_new_one_of_heartbeats_fold_to_the_same_commits() -> None:
    sites = topology(2, 2, 1, 2)
    old = [shards("n0", "memory", [(0, 64), (1, 64)]), shards("n1", "memory", [(2, 64), (3, 64)]),
           shards("n1", "peer", [(0, 64), (1, 64)], owner="n0"), shards("n0", "peer", [(2, 64), (3, 64)], owner="n1")]
    new = [beat("n0", [(0, 64), (1, 64)], [(2, 64), (3, 64)], owner="n1"),
           beat("n1", [(2, 64), (3, 64)], [(0, 64), (1, 64)], owner="n0")]
    # And a log written across the upgrade: one node's old agent still sends shard reports.
    mixed = [old[0], old[3], new[1]]
    outcomes = []
    for log in (old, new, mixed):
        session = registered_session(sites)
        commits = emitted_of(session, log, CheckpointStepCommitted)
        outcomes.append((sorted((c.tier, c.step) for c in commits), dict(session.state.job(JOB).committed)))
    assert outcomes[0] == outcomes[1] == outcomes[2] == ([("memory", 64), ("peer", 64)], {"memory": 64, "peer": 64})


def test_a_replay_of_a_heartbeat_log_rebuilds_the_same_state() -> None:
    sites = topology(2, 2, 1, 2)
    session = registered_session(sites)
    log = [beat("n0", [(0, 64), (1, 64)], [(2, 64), (3, 64)], owner="n1", send_s=0.2),
           beat("n1", [(2, 64), (3, 64)], [(0, 64), (1, 64)], owner="n0", at_s=1)]
    decided = [e for event in log for e in session.observe(event).emitted]
    replay = DeciderSession(CheckpointBrokerDecider())
    for event in [*registered_log(sites), *log, *decided]:
        replay.state = replay.decider.evolve(replay.state, event)
    assert replay.state.job(JOB).committed == session.state.job(JOB).committed == {"memory": 64, "peer": 64}
    assert replay.state.job(JOB).shards == session.state.job(JOB).shards


def registered_log(sites: list) -> list[Event]:
    from tests.unit.test_checkpoint_broker import registrations

    session = DeciderSession(CheckpointBrokerDecider())
    out: list[Event] = []
    for event in registrations(sites):
        out.append(event)
        out.extend(session.observe(event).emitted)
    return out


def test_old_shard_reports_still_decode_and_commit_for_the_disk_tier() -> None:
    session = registered_session(topology(2, 2, 1, 2))
    disk = [shards("n0", "disk", [(0, 100), (1, 100)]), shards("n1", "disk", [(2, 100), (3, 100)])]
    [commit] = emitted_of(session, disk, CheckpointStepCommitted)
    assert (commit.tier, commit.step) == ("disk", 100)
    assert isinstance(disk[0].payload, CheckpointShardsStored)


# -- the quiet job clock (controller) ------------------------------------------------------------------------


class NoBus:
    """The choice of jobs publishes nothing; a bus that is never touched is enough."""


def quiet(now_s: float, last_tick_s: float | None, busy_s: float | None = None, incident: bool = False) -> bool:
    at = lambda s: None if s is None else T0 + timedelta(seconds=s)  # noqa: E731
    return quiet_clock(at(now_s), last_tick=at(last_tick_s), last_busy_input=at(busy_s),  # type: ignore[arg-type]
                       incident=incident, interval=timedelta(seconds=1), quiet_interval=timedelta(seconds=5),
                       busy_window=timedelta(seconds=60))


def test_quiet_clock_skips_a_quiet_job_between_quiet_intervals_only() -> None:
    assert not quiet(100, None)  # never ticked: tick
    assert quiet(101, 100) and quiet(104, 100)
    assert not quiet(104.5, 100) and not quiet(105, 100)  # due (half a round of slack)
    assert not quiet(101, 100, busy_s=50)  # a recent non-routine input: every interval
    assert quiet(111, 110, busy_s=50)  # ... for the busy window only
    assert not quiet(101, 100, incident=True)  # an incident: every interval
    same = quiet_clock(T0 + timedelta(seconds=1), last_tick=T0, last_busy_input=None, incident=False,
                       interval=timedelta(seconds=1), quiet_interval=timedelta(seconds=1),
                       busy_window=timedelta(seconds=60))
    assert not same  # a quiet interval no longer than the interval turns it off


def test_routine_inputs_are_the_steady_state_reports() -> None:
    assert {"NodeHeartbeat", "TimerTicked", "CheckpointShardsStored", "CheckpointStepCommitted"} <= ROUTINE_INPUTS
    assert "CheckpointInventoryReported" not in ROUTINE_INPUTS and "RankExited" not in ROUTINE_INPUTS


@pytest.mark.parametrize("routine", [True, False])
def test_the_controller_ticks_a_quiet_job_every_quiet_interval_and_a_busy_one_every_round(routine: bool) -> None:
    now = [T0]
    settings = Settings(controller=ControllerSettings(clock_quiet_interval="5s", clock_busy_window="60s"))  # type: ignore[arg-type]
    controller = Controller(NoBus(), None, settings, clock=lambda: now[0])  # type: ignore[arg-type]
    heartbeat = beat("n0", [(0, 64)])
    inventory = Event.create(CheckpointInventoryReported(node_id="n0", generation=1, entries=[]), job_id=JOB,
                             subject="node/n0", producer="node-agent", occurred_at=T0)
    controller._note_input(heartbeat if routine else inventory)
    ticked: list[int] = []
    intervals: set[float] = set()
    for second in range(0, 30):
        now[0] = T0 + timedelta(seconds=second)
        if second % 3 == 0:
            controller._note_input(tick_event(JOB, now[0]))
            controller._note_input(beat("n0", [(0, 64)]))  # routine reports keep coming
        if controller.jobs_to_tick() == [JOB]:
            ticked.append(second)
            intervals.add(controller.tick_interval(JOB).total_seconds())
    if routine:
        assert ticked == [0, 5, 10, 15, 20, 25]
        assert intervals == {5.0}  # each tick says it stands for 5 s: a slower clock, not a gap in it
    else:
        assert ticked == list(range(30))  # within the busy window of the inventory: every round
        assert intervals == {1.0}


# -- the schedule does not flap with the step time (broker) ----------------------------------------------------


def test_the_backup_interval_in_force_is_kept_while_it_fits_within_the_margin() -> None:
    from keel.checkpoint_broker.schedule import kept_backup_interval

    assert kept_backup_interval(None, 16, 9.0) == 16  # nothing in force: the wanted one
    assert kept_backup_interval(16, 8, 7.5) == 16  # 8 would do, but only just: keep 16
    assert kept_backup_interval(16, 8, 5.9) == 8  # half fits with the margin to spare: finer
    assert kept_backup_interval(16, 32, 19.0) == 16  # 19 steps needed: within 25 % over 16
    assert kept_backup_interval(16, 32, 20.5) == 32  # past the margin: coarser
    assert kept_backup_interval(16, 16, 12.0) == 16


def test_jittering_step_times_announce_one_schedule_not_one_per_heartbeat() -> None:
    from keel.events.types import CheckpointScheduleSet
    from tests.unit.test_checkpoint_broker import heartbeat

    session = DeciderSession(CheckpointBrokerDecider())
    stored = ev(CheckpointShardsStored(node_id="n0", tier="memory", shards=records([(0, 5)], send_s=0.1)), "node/n0")
    announced = emitted_of(session, [heartbeat("n0", 0.11, T0), stored], CheckpointScheduleSet)
    # The bench's step times on a busy two-core host: 0.10 to 0.14 s.
    jitter = [0.11, 0.1, 0.14, 0.12, 0.1, 0.13, 0.102, 0.141, 0.11, 0.125]
    later = emitted_of(session, [heartbeat("n0", t, T0 + timedelta(seconds=5 * (i + 1))) for i, t in enumerate(jitter)],
                       CheckpointScheduleSet)
    # The first transfer (0.1 s: 9.1 steps within the duty) keeps the 8 the period floor set: within 25 %.
    assert [(s.every_k_steps, s.backup_every_k_steps) for s in announced] == [(1000, 8)]
    assert later == [], [(s.every_k_steps, s.backup_every_k_steps) for s in later]


def test_a_schedule_change_waits_a_minute_unless_the_backup_interval_must_go_coarser() -> None:
    from keel.events.types import CheckpointScheduleSet
    from tests.unit.test_checkpoint_broker import heartbeat

    session = DeciderSession(CheckpointBrokerDecider())
    [first] = emitted_of(session, [heartbeat("n0", 2.0, T0)], CheckpointScheduleSet)
    assert first.every_k_steps == 190
    # The step time halves: K doubles, an efficiency change: not within the minute...
    assert emitted_of(session, [heartbeat("n0", 1.0, T0 + timedelta(seconds=10))], CheckpointScheduleSet) == []
    # ...but transfers that exceed the duty of the backup interval in force cannot wait.
    slow = ev(CheckpointShardsStored(node_id="n0", tier="memory", shards=records([(0, 5)], send_s=0.5)), "node/n0",
              T0 + timedelta(seconds=20))
    [coarser] = emitted_of(session, [slow], CheckpointScheduleSet)
    assert coarser.backup_every_k_steps == 8 and coarser.every_k_steps == 380
    later = emitted_of(session, [heartbeat("n0", 2.0, T0 + timedelta(seconds=50))], CheckpointScheduleSet)
    assert later == []
    [after] = emitted_of(session, [heartbeat("n0", 2.0, T0 + timedelta(seconds=81))], CheckpointScheduleSet)
    assert after.every_k_steps == 190


def test_a_restore_plan_lets_the_next_heartbeat_commit_at_once() -> None:
    from keel.events.types import CheckpointRestorePlanned

    session = registered_session(topology(2, 2, 1, 2))
    commits = emitted_of(session, [beat("n0", [(0, 64), (1, 64)]), beat("n1", [(2, 64), (3, 64)], at_s=1)],
                         CheckpointStepCommitted)
    assert [(c.tier, c.step) for c in commits] == [("memory", 64)]
    planned = ev(CheckpointRestorePlanned(generation=1, step=64, sources=[], reason="test"), f"job/{JOB}",
                 T0 + timedelta(seconds=2), producer="checkpoint-broker")
    session.observe(planned)
    assert "memory" not in session.state.job(JOB).committed_at
    again = emitted_of(session, [beat("n0", [(0, 64), (1, 64)], at_s=3), beat("n1", [(2, 64), (3, 64)], at_s=4)],
                       CheckpointStepCommitted)
    assert [(c.tier, c.step) for c in again] == [("memory", 64)]  # the resumed history's step, 3 s later
    # Old shard-report events are never held back (older logs replay as they were decided).
    old = emitted_of(session, [shards("n0", "memory", [(0, 128), (1, 128)], at=T0 + timedelta(seconds=5)),
                               shards("n1", "memory", [(2, 128), (3, 128)], at=T0 + timedelta(seconds=5))],
                     CheckpointStepCommitted)
    assert [(c.tier, c.step) for c in old] == [("memory", 128)]


def test_the_new_broker_state_survives_a_decider_snapshot() -> None:
    from dataclasses import replace

    from keel.checkpoint_broker.state import BrokerState, JobState, ScheduleState
    from keel.kernel.snapshot import decode_state, encode_state

    job = replace(JobState(), committed={"memory": 64}, committed_at={"memory": T0, "peer": T0 + timedelta(seconds=3)},
                  schedule=replace(ScheduleState(), announced_at=T0))
    state = BrokerState(jobs={JOB: job})
    assert decode_state(encode_state(state)) == state
