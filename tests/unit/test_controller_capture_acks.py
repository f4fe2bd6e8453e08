"""A stack capture round's node whose agent does not acknowledge the request is lost (issue 16).

A host cut off the network (a link cut) leaves its peers' ranks hung in a collective, not failed: the hang
opens a rung-3 stack capture round, and the cut host's agent never answers. Agents acknowledge the request
with a heartbeat on receipt; the controller evicts the minority that did not within the acknowledgement
timeout instead of waiting out the capture and the analyzer's verdict, unless the silence could be its own
(half the round or more silent, or a gap in its recorded clock since the request).

Pure: a ``DeciderSession`` fed the log a live run records (``Clocked``), replayed by ``verify``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.controller.rules import round_lost_nodes
from keel.events.envelope import Event
from keel.events.types import NodeHealthChanged
from keel.kernel.replay import verify
from tests.unit.test_controller_clock import SILENCE, Clocked, evicted

T0 = datetime(2026, 12, 3, 9, 0, tzinfo=UTC)
ACK = timedelta(seconds=2)


def hang_reported(job: Clocked, node: str = "n0") -> Event:
    """``node``'s inspector reports a rank without progress: the controller asks every node for stacks."""
    decided = job.feed(NodeHealthChanged(node_id=node, status="failed", component="rank", check="no_progress",
                                         confidence="high", is_fatal=False, detail="no step for 5.2 s"),
                       f"node/{node}", node=node)
    [request] = [e for e in decided if e.type == "StacksRequested"]
    return request


def decisions(events: list[Event]) -> list[str]:
    return [e.type for e in events if e.type in ("NodeEvictionDecided", "RestartDecided", "DiagnosticsRequested")]


def test_a_node_that_does_not_acknowledge_a_capture_is_evicted_after_the_ack_timeout() -> None:
    job = Clocked(nodes=4)
    job.run(10)
    request = hang_reported(job)
    assert request.payload.nodes == ["n0", "n1", "n2", "n3"]
    for node in ("n0", "n1", "n2"):
        job.beat(node)  # the agents acknowledge on receipt; n3's host is cut off
    assert evicted(job.run(1, silent=frozenset({"n3"}))) == []  # 1 s: within the acknowledgement timeout
    concluded = job.run(2, silent=frozenset({"n3"}))
    [eviction] = [e for e in concluded if e.type == "NodeEvictionDecided"]
    assert eviction.payload.node_id == "n3"
    assert eviction.payload.rung == 1
    assert "stack capture round 0: n3 did not acknowledge the request within 2 s" in eviction.payload.reason
    assert "while n0, n1, n2 did" in eviction.payload.reason
    assert eviction.occurred_at - request.occurred_at <= timedelta(seconds=3)  # not the 10 s capture + verdict
    assert "DiagnosticsRequested" not in decisions(concluded)
    assert verify(ControllerDecider(ControllerPolicy(node_silence_timeout=SILENCE)), job.log).clean


def test_a_heartbeat_just_before_the_request_is_no_acknowledgement() -> None:
    """n3's last heartbeat arrives just before the link is cut and the hang is reported: it is credited at
    the tick after the request, but in log order it came before it."""
    job = Clocked(nodes=4)
    job.run(10)
    job.beat("n3")
    hang_reported(job)
    for node in ("n0", "n1", "n2"):
        job.beat(node)
    assert evicted(job.run(3, silent=frozenset({"n3"}))) == ["n3"]


def test_every_node_acknowledging_waits_for_the_analyzer() -> None:
    job = Clocked(nodes=4)
    job.run(10)
    hang_reported(job)
    for node in job.nodes:
        job.beat(node)
    assert decisions(job.run(8)) == []
    assert job.session.state.job("job1").incident.stage == "capturing"


def test_half_the_round_silent_evicts_nobody() -> None:
    """Two of four nodes silent: likelier the controller's or NATS's side of the network than two hosts;
    the round goes on to the analyzer's verdict (or its timeout), as before."""
    job = Clocked(nodes=4)
    job.run(10)
    hang_reported(job)
    for node in ("n0", "n1"):
        job.beat(node)
    assert decisions(job.run(4, silent=frozenset({"n2", "n3"}))) == []
    assert job.session.state.job("job1").incident.stage == "capturing"


def test_a_majority_silent_evicts_nobody() -> None:
    job = Clocked(nodes=4)
    job.run(10)
    hang_reported(job)
    job.beat("n0")
    assert decisions(job.run(4, silent=frozenset({"n1", "n2", "n3"}))) == []


def test_a_gap_in_the_controllers_clock_after_the_request_evicts_nobody() -> None:
    """The controller's host stalls right after asking: when it ticks again, the silence since the request
    may be its own (acknowledgements still on their way), so nobody is lost for it."""
    job = Clocked(nodes=4)
    job.run(10)
    hang_reported(job)
    for node in ("n0", "n1", "n2"):
        job.beat(node)
    job.run(12, ticking=False, silent=frozenset({"n3"}))  # no tick for 12 s: more than 1 s + the 5 s allowance
    after_gap = job.run(4, silent=frozenset({"n3"}))
    assert evicted(after_gap) == []
    assert job.session.state.job("job1").clock_since > job.session.state.job("job1").incident.stacks_requested_at


def test_the_decision_names_why_nobody_is_lost() -> None:
    asked = ["n0", "n1", "n2", "n3"]
    at = T0

    def lost(acked: list[str], *, waited_s: float = 3.0, since: datetime | None = T0) -> tuple[tuple[str, ...], str]:
        verdict = round_lost_nodes(asked, acked, requested_at=at, now=at + timedelta(seconds=waited_s),
                                           clock_since=since, ack_timeout=ACK)
        return verdict.nodes, verdict.reason

    assert lost(["n0", "n1", "n2"])[0] == ("n3",)
    assert lost(["n0", "n1", "n2"], since=T0 - timedelta(minutes=1))[0] == ("n3",)  # an older unbroken run
    nodes, why = lost(asked)
    assert nodes == () and "every node acknowledged" in why
    nodes, why = lost(["n0", "n1", "n2"], waited_s=1.5)
    assert nodes == () and "1.5 s of the 2 s" in why
    nodes, why = lost(["n0", "n1", "n2"], since=T0 + timedelta(seconds=1))
    assert nodes == () and "gap" in why
    nodes, why = lost(["n0", "n1", "n2"], since=None)  # not on the recorded clock: no judging silence
    assert nodes == () and "gap" in why
    nodes, why = lost(["n0", "n1"])
    assert nodes == () and "2 of 4 nodes sent nothing" in why
    nodes, why = lost([])
    assert nodes == () and "4 of 4" in why
    # One node of two is half the round: no eviction on silence alone.
    verdict = round_lost_nodes(["n0", "n1"], ["n0"], requested_at=at, now=at + timedelta(seconds=3),
                                       clock_since=T0, ack_timeout=ACK)
    assert verdict.nodes == ()
