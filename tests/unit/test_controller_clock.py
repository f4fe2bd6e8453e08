"""Time from one place (issue 14): the controller judges liveness, deadlines and command expiry on its
recorded clock - when events arrive, between two job-clock ticks in the log - never on producers'
timestamps. A producer's clock skew is reported (``NodeClockSkewed``), never acted on as silence.

Pure: a ``DeciderSession`` fed the log a live run records (agents' events stamped by their own clocks,
the job clock's v2 ticks), and ``keel replay --verify``'s ``verify`` over it. The same inputs with v1
ticks (a log recorded before) are still judged on producers' timestamps, as they were.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from keel.agent.clock import CLOCK_OFFSET_ENV, agent_clock, clock_offset
from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CLOCK_PRODUCER,
    NodeHeartbeat,
    NodeRegistered,
    RankExited,
    RankStarted,
    TimerTicked,
)
from keel.kernel.decider import DeciderSession
from keel.kernel.replay import verify

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
TEN_MIN = timedelta(minutes=10)
SILENCE = timedelta(seconds=30)


class Clocked:
    """A job of ``nodes`` single-rank nodes whose agents stamp events with their own (possibly skewed)
    clocks, and the job clock ticking every second on the controller's host (``now``)."""

    def __init__(self, nodes: int = 3, *, skews: dict[str, timedelta] | None = None, legacy: bool = False,
                 policy: ControllerPolicy | None = None) -> None:
        self.decider = ControllerDecider(policy or ControllerPolicy(node_silence_timeout=SILENCE))
        self.session = DeciderSession(self.decider)
        self.log: list[Event] = []
        self.now = T0
        self.count = 0
        self.legacy = legacy
        self.nodes = [f"n{i}" for i in range(nodes)]
        self.skews = dict(skews or {})
        self.step = 0
        for i, node in enumerate(self.nodes):
            self.feed(NodeRegistered(node_id=node, host=node), f"node/{node}", node=node)
            self.feed(RankStarted(node_id=node, rank=i, local_rank=0, world_size=nodes, pid=100 + i, generation=0),
                      f"rank/{i}", node=node)
        self.tick()

    def feed(self, payload: EventPayload, subject: str, *, node: str | None = None, producer: str = "agent",
             at: datetime | None = None) -> list[Event]:
        self.count += 1
        stamp = at or (self.now + self.skews.get(node or "", timedelta(0)))
        event = Event.create(payload, job_id="job1", subject=subject, producer=producer, occurred_at=stamp,
                             event_id=uuid.uuid5(uuid.NAMESPACE_OID, f"clock-input-{self.count}"))
        self.log.append(event)
        result = self.session.observe(event)
        self.log.extend(result.emitted)
        return result.emitted

    def tick(self) -> list[Event]:
        interval = None if self.legacy else 1.0
        return self.feed(TimerTicked(now=self.now, interval_s=interval), "clock/job1", producer=CLOCK_PRODUCER,
                         at=self.now)

    def beat(self, node: str) -> list[Event]:
        return self.feed(NodeHeartbeat(node_id=node, ranks_alive=1, ranks_expected=1, last_step=self.step),
                         f"node/{node}", node=node)

    def run(self, seconds: int, *, silent: frozenset[str] = frozenset(), every: int = 5,
            ticking: bool = True) -> list[Event]:
        """``seconds`` of the job: heartbeats every ``every`` s from every node not ``silent``, a tick each
        second (none while not ``ticking``: the clock host is down)."""
        out: list[Event] = []
        for _ in range(seconds):
            self.now += timedelta(seconds=1)
            self.step += 1
            if int((self.now - T0).total_seconds()) % every == 0:
                for node in self.nodes:
                    if node not in silent:
                        out += self.beat(node)
            if ticking:
                out += self.tick()
        return out

    def of(self, type_: str) -> list[Event]:
        return [e for e in self.log if e.type == type_ and e.producer == "controller"]


def evicted(events: list[Event]) -> list[str]:
    return [e.payload.node_id for e in events if e.type == "NodeEvictionDecided"]


def test_nodes_ten_minutes_ahead_and_behind_are_not_evicted_a_silent_one_is_and_the_skew_is_reported() -> None:
    job = Clocked(skews={"n0": TEN_MIN, "n1": -TEN_MIN})
    assert evicted(job.run(120)) == []
    skewed = {e.payload.node_id: e.payload for e in job.of("NodeClockSkewed")}
    assert set(skewed) == {"n0", "n1"}, skewed  # once per crossing: two minutes of heartbeats, one report each
    assert len(job.of("NodeClockSkewed")) == 2
    assert skewed["n0"].skewed and 595 <= skewed["n0"].skew_s <= 600, skewed["n0"]
    assert skewed["n1"].skewed and -601 <= skewed["n1"].skew_s <= -595, skewed["n1"]
    assert "ahead of" in skewed["n0"].reason and "behind" in skewed["n1"].reason

    # The honest node goes silent: it alone is evicted, after the silence timeout on the recorded clock.
    silent_since = job.now
    decided = job.run(45, silent=frozenset({"n2"}))
    assert evicted(decided) == ["n2"], [e.type for e in decided]
    [eviction] = [e for e in decided if e.type == "NodeEvictionDecided"]
    assert SILENCE < eviction.occurred_at - silent_since <= SILENCE + timedelta(seconds=7)
    # Its command expires a TTL after the tick it was decided on, never after anyone's own clock.
    assert eviction.payload.expires_at == eviction.occurred_at + ControllerPolicy().command_ttl
    assert "recorded clock" in eviction.payload.reason
    # The whole log replays to the same decisions (keel replay --verify).
    report = verify(ControllerDecider(ControllerPolicy(node_silence_timeout=SILENCE)), job.log)
    assert report.clean, report.details()


def test_the_same_inputs_with_v1_ticks_are_judged_on_timestamps_as_old_logs_were() -> None:
    """What the recorded clock fixes, shown on a log of v1 ticks (which a replay still judges the old way):
    the node whose clock lags 10 minutes is evicted while it heartbeats."""
    job = Clocked(skews={"n1": -TEN_MIN}, legacy=True)
    job.run(10)
    assert evicted(job.log) == ["n1"]
    assert job.of("NodeClockSkewed") == []
    assert verify(ControllerDecider(ControllerPolicy(node_silence_timeout=SILENCE)), job.log).clean


def test_a_clock_back_within_the_allowance_is_reported_once() -> None:
    job = Clocked(skews={"n0": TEN_MIN})
    job.run(20)
    job.skews["n0"] = timedelta(seconds=1)  # NTP fixed it
    job.run(20)
    reports = [(e.payload.node_id, e.payload.skewed) for e in job.of("NodeClockSkewed")]
    assert reports == [("n0", True), ("n0", False)]
    assert job.session.state.job("job1").node("n0").clock_skewed is False


def test_a_future_dated_event_yields_commands_that_expire_and_deadlines_that_come() -> None:
    job = Clocked()
    job.run(10)
    tick_at = job.now
    a_day = timedelta(days=1)
    decided = job.feed(RankExited(node_id="n1", rank=1, pid=1, generation=0, exit_code=1, classification="infrastructure",
                                  error_type="RuntimeError", stderr_tail="RuntimeError: gloo"),
                       "rank/1", node="n1", at=job.now + a_day)
    [request] = [e for e in decided if e.type == "DiagnosticsRequested"]
    assert request.occurred_at == tick_at  # the decision's time is the latest tick, not the producer's stamp
    assert request.payload.expires_at == tick_at + ControllerPolicy().command_ttl
    # The round's deadline counts from the recorded clock: it concludes (nobody reported: every node
    # timed out, and the eviction breaker stops the job) a minute later, not a day.
    for node in job.nodes:
        job.beat(node)  # the agents acknowledge the request
    decided = job.run(62)
    [resolved] = [e for e in decided if e.type == "IncidentResolved"]
    assert resolved.occurred_at == tick_at + ControllerPolicy().diagnostics_timeout
    assert verify(ControllerDecider(ControllerPolicy(node_silence_timeout=SILENCE)), job.log).clean


def test_an_event_delivered_long_after_it_occurred_yields_commands_still_valid() -> None:
    job = Clocked()
    job.run(10)
    late = job.now - timedelta(hours=1)  # occurred an hour ago; an outbox delivered it only now
    decided = job.feed(RankExited(node_id="n1", rank=1, pid=1, generation=0, exit_code=1, classification="infrastructure",
                                  error_type="RuntimeError", stderr_tail="RuntimeError: gloo"),
                       "rank/1", node="n1", at=late)
    [request] = [e for e in decided if e.type == "DiagnosticsRequested"]
    assert request.payload.expires_at == job.now + ControllerPolicy().command_ttl > job.now
    assert request.occurred_at == job.now
    for node in job.nodes:
        job.beat(node)  # the agents acknowledge the request
    # The round waits its timeout from now: the next ticks do not conclude it at once.
    assert not [e for e in job.run(30) if e.type in ("RestartDecided", "NodeEvictionDecided", "IncidentResolved")]
    assert [e.type for e in job.run(31) if e.type == "IncidentResolved"] == ["IncidentResolved"]


def test_no_node_is_judged_silent_over_a_gap_in_the_clock() -> None:
    job = Clocked()
    job.run(10)
    # The clock host is down for two minutes and the agents' heartbeats pile up in the stream; when it
    # is back, they arrive (a backlog) before its first tick: every node is credited, nobody is evicted.
    job.run(120, ticking=False)
    assert evicted(job.run(40)) == []
    # Down again, and this time nothing is heard during the gap (NATS itself was down): the first tick
    # after the gap starts a new run, so nobody is silent for longer than the host listened.
    job.run(120, ticking=False, silent=frozenset(job.nodes))
    first = job.run(1, silent=frozenset(job.nodes))
    assert evicted(first) == []
    # A node that stays silent for the timeout after the gap is lost all the same.
    assert evicted(job.run(40, silent=frozenset({"n0"}))) == ["n0"]
    assert verify(ControllerDecider(ControllerPolicy(node_silence_timeout=SILENCE)), job.log).clean


def test_a_late_tick_counts_as_a_gap_and_an_unheard_node_is_credited_from_it() -> None:
    job = Clocked()
    job.run(10)
    state = job.session.state.job("job1")
    assert state.clock_since == T0 and state.recorded_clock
    job.now += timedelta(seconds=20)  # a tick 20 s after the previous one: more than 1 s + the 5 s allowance
    job.tick()
    state = job.session.state.job("job1")
    assert state.clock_since == job.now
    assert state.silence(state.node("n0"), job.now) == timedelta(0)


@pytest.mark.parametrize(("text", "offset"), [("", timedelta(0)), ("600s", TEN_MIN), ("-10m", -TEN_MIN),
                                              ("+1.5h", timedelta(hours=1.5))])
def test_the_agent_clock_fault_hook_shifts_the_agents_clock(text: str, offset: timedelta) -> None:
    assert clock_offset({CLOCK_OFFSET_ENV: text}) == offset
    clock = agent_clock({CLOCK_OFFSET_ENV: text})
    shifted = clock() - datetime.now(UTC)
    assert abs(shifted - offset) < timedelta(seconds=5)


@pytest.mark.parametrize("text", ["600", "-ten minutes", "400d"])
def test_the_agent_clock_fault_hook_refuses_what_it_cannot_read(text: str) -> None:
    with pytest.raises(ValueError, match=CLOCK_OFFSET_ENV):
        clock_offset({CLOCK_OFFSET_ENV: text})


def test_a_commands_age_is_taken_from_the_agents_clock_only_when_plausible() -> None:
    from keel.agent.clock import plausible_age_s

    issued = T0
    assert plausible_age_s(T0 + timedelta(seconds=3), issued, 45) == 3.0  # a command 3 s in transit
    # A node 10 minutes ahead would see every command as 10 minutes old (its diagnostics round cut to the
    # 5 s floor); one 10 minutes behind, as issued in the future: both count as just issued.
    assert plausible_age_s(T0 + TEN_MIN, issued, 45) == 0.0
    assert plausible_age_s(T0 - TEN_MIN, issued, 45) == 0.0


def test_keel_incidents_lists_the_clocks_still_off() -> None:
    from keel.reports.incidents import format_skewed_clocks, skewed_clocks

    job = Clocked(skews={"n0": TEN_MIN, "n1": -TEN_MIN})
    job.run(20)
    job.skews["n0"] = timedelta(0)
    job.run(20)
    clocks = skewed_clocks(job.log)
    assert [c.node_id for c in clocks] == ["n1"] and -601 < clocks[0].skew_s < -595  # n0 came back within
    text = format_skewed_clocks(clocks)
    assert "n1" in text and "behind" in text and "n0" not in text
    assert format_skewed_clocks([]) == ""


def test_the_recorded_clock_survives_a_snapshot_of_the_controllers_state() -> None:
    """Cold starts begin from a snapshot (keel.kernel.snapshot): the clock's fields round-trip exactly."""
    from keel.kernel.snapshot import decode_state, encode_state

    job = Clocked(skews={"n0": TEN_MIN})
    job.run(12)
    job.beat("n1")  # heard since the latest tick: pending credit
    state = job.session.state
    assert state.job("job1").heard and state.job("job1").skews is not None
    assert decode_state(encode_state(state)) == state


def test_a_node_that_registers_again_gets_its_skew_reported_again() -> None:
    """A restarted agent learns how far its clock is off only from a new report (it judges commands'
    expiries net of it)."""
    job = Clocked(skews={"n0": TEN_MIN})
    job.run(12)  # two heartbeats' windows confirmed (``SKEW_SIGHTINGS``)
    job.feed(NodeRegistered(node_id="n0", host="n0"), "node/n0", node="n0")
    job.run(12)  # again: a new agent's clock is judged afresh
    assert [(e.payload.node_id, e.payload.skewed) for e in job.of("NodeClockSkewed")] == [("n0", True), ("n0", True)]


def test_a_lost_nodes_last_heartbeat_just_before_a_diagnostics_request_is_no_acknowledgement() -> None:
    """The node's agent dies right after a heartbeat; a peer's crash then asks for diagnostics. That heartbeat
    is credited at the next tick (after the request), but it came before it in the log: the node did not
    acknowledge, so the round ends after the acknowledgement timeout instead of waiting out the all-gather
    (the recovery benchmark's lost-node trials took 42 s instead of about 2.5 s)."""
    job = Clocked(nodes=4)
    job.run(10)
    job.now += timedelta(milliseconds=300)
    job.beat("n3")  # n3's last words, then its machine is gone
    decided = job.feed(RankExited(node_id="n1", rank=1, pid=1, generation=0, exit_code=1,
                                  classification="infrastructure", error_type="RuntimeError",
                                  stderr_tail="RuntimeError: gloo"), "rank/1", node="n1")
    [request] = [e for e in decided if e.type == "DiagnosticsRequested"]
    for node in ("n0", "n1", "n2"):
        job.beat(node)  # the agents acknowledge the request on receipt
    concluded = job.run(3, silent=frozenset({"n3"}))
    [eviction] = [e for e in concluded if e.type == "NodeEvictionDecided"]  # (no standby: the restart is held)
    assert eviction.payload.node_id == "n3"
    assert "n3 did not acknowledge the request within 2 s" in eviction.payload.reason
    assert eviction.occurred_at - request.occurred_at <= timedelta(seconds=3)
    assert verify(ControllerDecider(ControllerPolicy(node_silence_timeout=SILENCE)), job.log).clean


def test_a_round_asked_for_while_catching_up_after_a_gap_is_not_overdue_at_the_first_tick_after_it() -> None:
    """The controller's host is cut off for 90 s (no ticks; the agents' heartbeats and a crash pile up in the
    stream). Working off the backlog, it asks for diagnostics, stamped with its last tick before the gap. The
    first tick after the gap must not find that round overdue (one agent has answered, the others had no time
    to): the gap counts against no deadline, so nobody is evicted for it."""
    job = Clocked(nodes=4)
    job.run(10)
    last_tick = job.now
    job.run(90, ticking=False)
    decided = job.feed(RankExited(node_id="n1", rank=1, pid=1, generation=0, exit_code=1,
                                  classification="infrastructure", error_type="RuntimeError",
                                  stderr_tail="RuntimeError: gloo"), "rank/1", node="n1")
    [request] = [e for e in decided if e.type == "DiagnosticsRequested"]
    assert request.occurred_at == last_tick
    job.beat("n0")  # one agent answers at once; the others' answers are on their way
    first = job.tick()
    assert not [e for e in first if e.type in ("NodeEvictionDecided", "RestartDecided", "IncidentResolved")], \
        [(e.type, getattr(e.payload, "reason", "")) for e in first]
    for node in ("n1", "n2", "n3"):
        job.beat(node)
    assert evicted(job.run(20)) == []
    # The round's deadline still comes, a diagnostics timeout after the first tick past the gap.
    concluded = job.run(45)
    assert [e.type for e in concluded if e.type == "IncidentResolved"] == ["IncidentResolved"]
    assert verify(ControllerDecider(ControllerPolicy(node_silence_timeout=SILENCE)), job.log).clean


def test_a_tick_sent_late_after_a_partition_makes_no_clock_look_skewed() -> None:
    """The clock host's link is cut just after it sent a tick; its kernel delivers that tick once the link is
    back, 60 s later, behind the heartbeats that piled up meanwhile. That tick says a time long past: the
    window it closes is not reported on (the next tick comes after a gap, so the late one is not confirmed);
    a real skew is still reported, one tick later."""
    job = Clocked(nodes=3, skews={"n2": timedelta(seconds=30)})
    job.run(10)
    cut = job.now
    job.run(60, ticking=False)
    late = job.feed(TimerTicked(now=cut + timedelta(seconds=1), interval_s=1.0), "clock/job1",
                    producer=CLOCK_PRODUCER, at=cut + timedelta(seconds=1))
    decided = late + job.tick() + job.run(10)
    reports = [e.payload for e in decided if e.type == "NodeClockSkewed"]
    assert [p.node_id for p in reports if p.skewed] in ([], ["n2"]), reports  # n2 once, if not already reported
    assert not [p for p in reports if p.node_id != "n2"], reports
    assert verify(ControllerDecider(ControllerPolicy(node_silence_timeout=SILENCE)), job.log).clean


def test_one_event_that_arrives_late_is_no_skewed_clock_and_a_clock_off_in_two_windows_is() -> None:
    """A node's heartbeat stamped 31 s before it reached the stream (held in its outbox, or sent after its agent's
    loop stalled), its only event in that window: its clock is not reported skewed (the agent would judge its
    commands' expiries net of a skew it does not have), and the next window shows its clock as it is. A clock
    that is off is off in every window: reported at its second one, and at the first tick after it."""
    job = Clocked(nodes=3, skews={"n2": -TEN_MIN})
    job.run(10)
    job.feed(NodeHeartbeat(node_id="n1", ranks_alive=1, ranks_expected=1, last_step=job.step), "node/n1",
             node="n1", at=job.now - timedelta(seconds=31))
    decided = job.run(20)
    reports = [e.payload for e in decided if e.type == "NodeClockSkewed"]
    assert [p.node_id for p in reports] == ["n2"], reports
    assert reports[0].skewed and -601 <= reports[0].skew_s <= -599
    assert job.session.state.job("job1").node("n1").skew_sightings == 0
    # n2's report came at the tick that confirmed its second window: heartbeats every 5 s, so by 11 s.
    [first] = [e for e in job.log if e.type == "NodeClockSkewed"]
    assert first.occurred_at - T0 <= timedelta(seconds=11), first.occurred_at - T0
    assert verify(ControllerDecider(ControllerPolicy(node_silence_timeout=SILENCE)), job.log).clean


@pytest.mark.parametrize(("sightings", "skew_s", "expected"), [
    (0, 6.0, 1), (1, 6.0, 2), (-2, 6.0, 1), (0, -6.0, -1), (-1, -6.0, -2), (3, -6.0, -1), (2, 4.9, 0), (-2, 0.0, 0),
])
def test_skew_sightings_count_windows_beyond_the_allowance_in_one_direction(sightings: int, skew_s: float,
                                                                           expected: int) -> None:
    from keel.controller.state import next_skew_sightings

    assert next_skew_sightings(sightings, skew_s, 5.0) == expected


def test_windows_on_either_side_of_a_gap_in_the_clock_are_not_in_a_row() -> None:
    """Late events cluster around partitions: one before a gap in the clock and one after it are two sightings
    of lateness, not of a clock, so the count starts again after the gap."""
    job = Clocked(nodes=3)
    job.run(10)
    job.feed(NodeHeartbeat(node_id="n1", ranks_alive=1, ranks_expected=1, last_step=job.step), "node/n1",
             node="n1", at=job.now - timedelta(seconds=31))
    job.run(2)
    assert job.session.state.job("job1").node("n1").skew_sightings == -1
    job.run(60, ticking=False, silent=frozenset({"n1"}))  # the clock host cut off, and n1 not heard meanwhile
    job.run(1, silent=frozenset({"n1"}))
    assert job.session.state.job("job1").node("n1").skew_sightings == 0
    assert verify(ControllerDecider(ControllerPolicy(node_silence_timeout=SILENCE)), job.log).clean
