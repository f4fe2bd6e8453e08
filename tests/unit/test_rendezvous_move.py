"""The ranks' rendezvous (MASTER_ADDR) moves with node rank 0 to another host (``keel.controller.master``).

Global rank 0 hosts the ranks' TCPStore, so when a standby on another host takes over node rank 0 every node
of the new generation must be told the standby's address; on one machine (every node registering the same
addresses) nothing moves. The rule is pure; the controller's commands carry its answer from then on.
"""

from __future__ import annotations

from keel.controller.master import moved_rendezvous
from keel.controller.policy import ControllerPolicy
from keel.controller.state import NodeView
from keel.events.types import NodeRegistered, Promotion, StandbyChecked
from keel.kernel.replay import verify
from tests.unit.test_controller import Job, of


def node(node_id: str, *addresses: str) -> NodeView:
    return NodeView(node_id=node_id, addresses=tuple(addresses))


def test_rank_0_taken_over_on_another_host_moves_the_rendezvous_to_it() -> None:
    nodes = {"n0": node("n0", "10.77.0.10"), "s0": node("s0", "10.77.0.14")}
    moved = moved_rendezvous([Promotion(standby_node_id="s0", replaces_node_id="n0", ranks=[0, 1])], nodes)
    assert moved.address == "10.77.0.14"
    assert "rank 0 moves from n0 (10.77.0.10) to s0" in moved.reason and "MASTER_ADDR" in moved.reason


def test_on_a_host_with_several_addresses_the_one_on_the_old_hosts_network_is_chosen() -> None:
    nodes = {"n0": node("n0", "10.77.0.10"), "s0": node("s0", "10.1.2.3", "10.77.0.14", "192.168.5.14", "fd00::14")}
    moved = moved_rendezvous([Promotion(standby_node_id="s0", replaces_node_id="n0", ranks=[0])], nodes)
    assert moved.address == "10.77.0.14"


def test_the_rendezvous_stays_when_rank_0_stays_or_its_host_does() -> None:
    nodes = {"n0": node("n0", "10.0.0.5"), "n1": node("n1", "10.0.0.6"), "s0": node("s0", "10.0.0.9"),
             "local-s0": node("local-s0", "10.0.0.5")}
    other_rank = moved_rendezvous([Promotion(standby_node_id="s0", replaces_node_id="n1", ranks=[2, 3])], nodes)
    assert (other_rank.address, other_rank.reason) == ("", "")
    same_host = moved_rendezvous([Promotion(standby_node_id="local-s0", replaces_node_id="n0", ranks=[0, 1])], nodes)
    assert same_host.address == "" and "on n0's host" in same_host.reason


def test_without_registered_addresses_nothing_moves() -> None:
    """An agent older than NodeRegistered v2 names no address: nothing to go by, so the launch's stays."""
    nodes = {"n0": node("n0"), "s0": node("s0", "10.0.0.9")}
    moved = moved_rendezvous([Promotion(standby_node_id="s0", replaces_node_id="n0", ranks=[0])], nodes)
    assert moved.address == "" and "registered no address" in moved.reason


def hosts_job() -> Job:
    """The controller's test job, every node and the standbys on a host of its own (n<i> at 10.77.0.1<i>)."""
    job = Job(standbys=0, policy=ControllerPolicy(max_eviction_fraction=1.0))  # two evictions in an hour
    for i, node_id in enumerate(job.nodes):
        job.feed(NodeRegistered(node_id=node_id, host="vm", addresses=[f"10.77.0.1{i}"]), f"node/{node_id}")
    for s, address in (("s0", "10.77.0.20"), ("s1", "10.77.0.21")):
        job.feed(NodeRegistered(node_id=s, host="vm", standby=True, addresses=[address]), f"node/{s}")
        job.feed(StandbyChecked(node_id=s, passed=True), f"node/{s}")
    return job


def test_every_command_of_the_restart_and_of_later_ones_carries_the_moved_rendezvous() -> None:
    job = hosts_job()
    out = job.health("n0")  # node rank 0's GPU is lost: rung 1 evicts it
    [restart] = of(out, "RestartDecided")
    assert restart.payload.evict == ["n0"]
    assert "rendezvous (MASTER_ADDR) moves to 10.77.0.20" in restart.payload.reason
    [promotion] = of(out, "StandbyPromotionRequested")
    assert (promotion.payload.node_id, promotion.payload.node_rank, promotion.payload.master_addr) == ("s0", 0, "10.77.0.20")
    assert {e.payload.node_id: e.payload.master_addr for e in of(out, "RanksRestartRequested")} == {
        "n1": "10.77.0.20", "n2": "10.77.0.20", "n3": "10.77.0.20"}
    job.restart(out)

    # A later incident that moves nothing: the commands still carry where the rendezvous is now (a
    # standby promoted into another rank launched with the old address).
    out = job.health("n2")
    [promotion] = of(out, "StandbyPromotionRequested")
    assert (promotion.payload.node_id, promotion.payload.master_addr) == ("s1", "10.77.0.20")
    assert {e.payload.master_addr for e in of(out, "RanksRestartRequested")} == {"10.77.0.20"}
    [restart] = of(out, "RestartDecided")
    assert "moves to" not in restart.payload.reason
    report = verify(job.decider, job.log)
    assert report.clean, report.details()


def test_a_job_on_one_host_never_moves_its_rendezvous() -> None:
    """Every node of the flat local cluster registers this machine's addresses: rank 0 taken over there
    keeps ``MASTER_ADDR`` (the commands say nothing of it)."""
    job = Job(standbys=0)
    for node_id in job.nodes:
        job.feed(NodeRegistered(node_id=node_id, host="vm", addresses=["10.0.2.15"]), f"node/{node_id}")
    job.feed(NodeRegistered(node_id="s0", host="vm", standby=True, addresses=["10.0.2.15"]), "node/s0")
    job.feed(StandbyChecked(node_id="s0", passed=True), "node/s0")
    out = job.health("n0")
    assert [e.payload.master_addr for e in of(out, "StandbyPromotionRequested")] == [""]
    assert {e.payload.master_addr for e in of(out, "RanksRestartRequested")} == {""}
