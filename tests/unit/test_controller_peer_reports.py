"""A node its peers cannot reach and the controller cannot hear is lost at rung 1 (issue 16).

A host cut off the network (a link cut) gives nobody an error; its peers' ranks keep retransmitting to
its address, and their inspector reports that address (``peer_unreachable``). The controller maps the
address to the node that registered it and evicts that node once its agent has sent nothing since the
report for ``peer_loss_silence``: without waiting for the ranks' step timeout and a capture round. A
report about a node that keeps heartbeating, about an address no single node owns, or one withdrawn,
evicts nothing.

Pure: a ``DeciderSession`` fed the log a live run records (``Clocked``), replayed by ``verify``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.controller.rules import peer_reported_lost_nodes
from keel.controller.state import NodeView, PeerReport
from keel.events.envelope import Event
from keel.events.types import NodeHealthChanged, NodeRegistered
from keel.kernel.replay import verify
from tests.unit.test_controller_clock import SILENCE, Clocked, evicted

PEER_SILENCE = timedelta(seconds=3)
POLICY = ControllerPolicy(node_silence_timeout=SILENCE, peer_loss_silence=PEER_SILENCE)


def address(node: str) -> str:
    return f"10.77.{int(node[1:]) + 2}.2"


def on_hosts(nodes: int = 4, shared: str | None = None) -> Clocked:
    """A running job whose nodes registered their hosts' addresses (``shared``: every node has it too)."""
    job = Clocked(nodes=nodes, policy=POLICY)
    for node in job.nodes:
        addresses = [address(node)] + ([shared] if shared else [])
        job.feed(NodeRegistered(node_id=node, host="one-machine", addresses=addresses), f"node/{node}", node=node)
    job.run(10)
    return job


def report(job: Clocked, reporter: str, peer_address: str, status: str = "failed") -> list[Event]:
    detail = f"2 connection(s) to {peer_address} retransmitted 3 times in a row" if status == "failed" else ""
    return job.feed(NodeHealthChanged(node_id=reporter, status=status, component="rank", check="peer_unreachable",
                                      confidence="medium" if status == "failed" else "high", is_fatal=False,
                                      detail=detail, evidence={"key": peer_address, "peer_address": peer_address}),
                    f"node/{reporter}", node=reporter)


def test_a_cut_host_named_by_a_peer_is_evicted_at_rung_1_once_silent_since() -> None:
    job = on_hosts()
    cut_at = job.now  # n3's last heartbeat came at the 10 s mark: the link is cut now
    assert evicted(job.run(2, silent=frozenset({"n3"}))) == []
    decided = report(job, "n0", address("n3"))  # 2 s of retransmissions and a probe interval later
    decided += job.run(3, silent=frozenset({"n3"}))
    [eviction] = [e for e in decided if e.type == "NodeEvictionDecided"]
    assert eviction.payload.node_id == "n3" and eviction.payload.rung == 1
    reason = eviction.payload.reason
    assert "rung 1: peers cannot reach a silent node: n3 (10.77.5.2): n0's ranks cannot reach it" in reason
    assert "retransmitted 3 times" in reason and "nothing since the report" in reason
    assert eviction.occurred_at - cut_at <= PEER_SILENCE + timedelta(seconds=1)  # not 30 s of silence
    [opened] = job.of("IncidentOpened")
    assert opened.payload.kind == "lost_node" and opened.payload.node_id == "n3"
    assert verify(ControllerDecider(POLICY), job.log).clean


def test_a_report_about_a_node_that_keeps_heartbeating_evicts_nothing() -> None:
    job = on_hosts()
    report(job, "n0", address("n3"))  # one noisy connection; n3's agent is heard every second
    decided = job.run(60, every=1)
    assert evicted(decided) == []
    assert job.of("IncidentOpened") == []
    # Even with its usual 5 s heartbeats: it is heard since the report, so the report is refuted.
    job2 = on_hosts()
    report(job2, "n0", address("n3"))
    job2.beat("n3")
    assert evicted(job2.run(60)) == []


def test_a_report_withdrawn_before_the_silence_is_long_enough_evicts_nothing() -> None:
    job = on_hosts()
    report(job, "n0", address("n3"))
    report(job, "n0", address("n3"), status="healthy")  # the connection moved again
    assert evicted(job.run(20, silent=frozenset({"n3"}))) == []  # only the 30 s silence rule would, later


def test_an_address_no_single_node_owns_names_nobody() -> None:
    job = on_hosts(shared="192.168.7.7")  # every node has it (one machine's address)
    report(job, "n0", "192.168.7.7")
    report(job, "n1", "10.99.0.1")  # not an address of this job's nodes
    assert evicted(job.run(10, silent=frozenset({"n3"}))) == []


T0 = datetime(2026, 12, 3, 9, 0, tzinfo=UTC)


def running(node: str, heard_s: float, *, addresses: tuple[str, ...] | None = None) -> NodeView:
    return NodeView(node, ranks=frozenset({int(node[1:])}), heard_at=T0 + timedelta(seconds=heard_s),
                    addresses=addresses if addresses is not None else (address(node),))


def test_the_rule_waits_for_the_silence_refuses_half_the_nodes_and_a_missing_clock() -> None:
    nodes = {n: running(n, 10) for n in ("n0", "n1", "n2", "n3")}
    named = [PeerReport("n0", address("n3"), T0 + timedelta(seconds=12), "retransmitting",
                        reporter_heard_at=T0 + timedelta(seconds=11))]

    def verdict(now_s: float, reports: list[PeerReport] = named, clock_since: datetime | None = T0,
                heard: tuple[str, ...] = (), of: dict[str, NodeView] = nodes):
        return peer_reported_lost_nodes(reports, of, heard_since_tick=heard, now=T0 + timedelta(seconds=now_s),
                                        clock_since=clock_since, min_silence=PEER_SILENCE)

    assert verdict(12).nodes == () and "silent for 2.0 s of 3 s" in verdict(12).reason
    assert verdict(13).nodes == ("n3",)
    assert verdict(13, heard=("n3",)).nodes == ()  # heard since the latest tick
    assert "reachable" in verdict(13, heard=("n3",)).reason
    assert verdict(13, clock_since=None).nodes == ()
    # The controller's own clock gap: silence counts from the end of the gap, not from the last heartbeat.
    assert verdict(13, clock_since=T0 + timedelta(seconds=11)).nodes == ()
    # Two of four nodes named and silent: likelier the controller's side of the network.
    both = named + [PeerReport("n0", address("n2"), T0 + timedelta(seconds=12),
                               reporter_heard_at=T0 + timedelta(seconds=11))]
    assert verdict(13, both).nodes == () and "not fewer than half" in verdict(13, both).reason
    # A report by a node on its way out, or about one already evicted, counts for nothing.
    gone = {**nodes, "n0": NodeView("n0", ranks=frozenset({0}), evicted=True, heard_at=T0, addresses=(address("n0"),))}
    assert verdict(13, of=gone).nodes == ()
    evicted_named = {**nodes, "n3": NodeView("n3", evicted=True, heard_at=T0, addresses=(address("n3"),))}
    assert verdict(13, of=evicted_named).nodes == ()
    # A node naming its own address names nobody.
    assert verdict(13, [PeerReport("n3", address("n3"), T0 + timedelta(seconds=12),
                                   reporter_heard_at=T0 + timedelta(seconds=11))]).nodes == ()


def test_a_report_flushed_after_the_reporters_own_silence_waits_until_the_named_node_is_quieter() -> None:
    """A reporter whose own link failed sends its queued report once it is back: it names a peer that was
    never the problem, and that peer (heartbeats every 5 s) may well be silent for 3 s right then."""
    nodes = {n: running(n, 10) for n in ("n0", "n1", "n2", "n3")}
    late = [PeerReport("n0", address("n3"), T0 + timedelta(seconds=14), "retransmitting",
                       reporter_heard_at=T0 + timedelta(seconds=5))]  # n0 itself silent 9 s before it
    at_14 = peer_reported_lost_nodes(late, nodes, heard_since_tick=(), now=T0 + timedelta(seconds=14),
                                     clock_since=T0, min_silence=PEER_SILENCE)
    assert at_14.nodes == () and "had been silent for 9.0 s itself" in at_14.reason
    # n3 keeps heartbeating (heard at 15 s): refuted for good.
    heard = {**nodes, "n3": running("n3", 15)}
    assert peer_reported_lost_nodes(late, heard, heard_since_tick=(), now=T0 + timedelta(seconds=30),
                                    clock_since=T0, min_silence=PEER_SILENCE).nodes == ()
    # n3 really is gone too: once it has been silent longer than the reporter was, it is lost.
    at_20 = peer_reported_lost_nodes(late, nodes, heard_since_tick=(), now=T0 + timedelta(seconds=20),
                                     clock_since=T0, min_silence=PEER_SILENCE)
    assert at_20.nodes == ("n3",)
