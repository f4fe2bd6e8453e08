"""Fencing, pure: a node evicted while nobody could reach it (a link cut, a frozen host) comes back with its
old agent and ranks, and every layer keeps it out - the controller's fold and rules, the agent's verdicts,
the shard stores' admission and the checkpoint broker's fold."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

from keel.agent.fencing import FENCE_FILE, Fence, fence_refusal, fence_verdict, read_fence
from keel.agent.shard_access import authorize_put
from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.controller.rules import acting_as_member
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    NodeEvictionDecided,
    NodeFenced,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeRegistered,
    RankExited,
    RankGroups,
    RankStarted,
    StandbyChecked,
)
from keel.kernel.replay import verify
from tests.unit.test_checkpoint_broker import JOB as BROKER_JOB
from tests.unit.test_checkpoint_broker import ev, registered_session, shards, topology
from tests.unit.test_controller import T0, Job, of, types

# -- the controller --------------------------------------------------------------------------------------


def lost_and_replaced() -> tuple[Job, Event]:
    """A 4-node job whose n2 went silent, was evicted (the actuator could not reach it) and replaced by the
    standby; generation 1 is stepping. Returns the job and the eviction decision."""
    job = Job(policy=ControllerPolicy(node_silence_timeout=timedelta(seconds=30)))
    job.tick(10)
    job.heartbeats(step=21, nodes=["n0", "n1", "n3"])
    job.tick(15)
    out = job.tick(10)
    [eviction] = of(out, "NodeEvictionDecided")
    assert eviction.payload.node_id == "n2"
    assert of(job.restart(out, restore_step=18, step=19), "IncidentResolved")
    return job, eviction


def from_agent(job: Job, payload: EventPayload, subject: str) -> list[Event]:
    return job.feed(payload, subject, producer="agent")


def test_a_fenced_nodes_reports_count_for_nothing_and_are_recorded_once() -> None:
    job, eviction = lost_and_replaced()
    view = job.session.state.job("job1")
    assert view.node("n2").fenced_by == str(eviction.id) and view.node("n2").fenced_generation == 0
    assert "n2" not in [n.node_id for n in view.active]
    last_step, loop = view.last_step, view.crash_loop
    # The host comes back: its agent's heartbeat still shows its old ranks alive, far ahead.
    out = from_agent(job, NodeHeartbeat(node_id="n2", ranks_alive=2, ranks_expected=2, last_step=500), "node/n2")
    [fenced] = of(out, "NodeFenced")
    p = fenced.payload
    assert (p.node_id, p.generation, p.fenced_generation, p.evicted_by, p.input_type) == (
        "n2", 1, 0, str(eviction.id), "NodeHeartbeat")
    assert fenced.subject == "node/n2" and fenced.correlation_id == eviction.correlation_id  # in the timeline
    assert "is ignored" in p.reason and "generation 1 without it" in p.reason
    after = job.session.state.job("job1")
    assert after.last_step == last_step and after.crash_loop == loop, "a stale step must not count as progress"
    # Once per fence: the next reports are ignored without another event.
    assert from_agent(job, NodeHeartbeat(node_id="n2", ranks_alive=2, ranks_expected=2, last_step=501), "node/n2") == []
    assert "n2 is fenced" in job.last_reason
    assert from_agent(job, RankExited(node_id="n2", rank=4, pid=9, generation=0, exit_code=1,
                                      classification="infrastructure"), "rank/4") == []
    # Its ranks' restart (a stale agent) takes no rank back from the standby that runs them now.
    from_agent(job, RankStarted(node_id="n2", rank=4, local_rank=0, world_size=8, pid=9, generation=1), "rank/4")
    assert 4 in job.session.state.job("job1").node("s0").ranks
    assert not job.session.state.job("job1").node("n2").ranks


def test_a_new_agent_registering_a_fenced_node_as_a_worker_is_told_again_and_stays_out() -> None:
    job, eviction = lost_and_replaced()
    from_agent(job, NodeHeartbeat(node_id="n2", ranks_alive=2, ranks_expected=2, last_step=30), "node/n2")
    out = from_agent(job, NodeRegistered(node_id="n2", host="n2"), "node/n2")
    [again] = of(out, "NodeFenced")
    assert again.payload.input_type == "NodeRegistered" and again.causation_id == job.log[-2].id
    view = job.session.state.job("job1").node("n2")
    assert view.fenced and not view.standby and view not in job.session.state.job("job1").active
    # Offered back as a standby (a new agent with --keel-standby): the fence is lifted, the pool takes it
    # once its self-check passes - the controller's existing rule for a new standby.
    assert not of(from_agent(job, NodeRegistered(node_id="n2", host="n2", standby=True), "node/n2"), "NodeFenced")
    from_agent(job, StandbyChecked(node_id="n2", passed=True), "node/n2")
    view = job.session.state.job("job1").node("n2")
    assert not view.fenced and "n2" in [n.node_id for n in job.session.state.job("job1").ready_standbys]
    # The whole log replays to the same decisions.
    report = verify(ControllerDecider(job.decider.policy), job.log)
    assert report.clean, [d.describe() for d in report.divergences]


def test_a_drained_agents_goodbye_is_not_reported_but_ignored() -> None:
    job, _ = lost_and_replaced()
    quiet = [from_agent(job, RankExited(node_id="n2", rank=4, pid=9, generation=0, exit_code=None, signal="SIGTERM",
                                        classification="stopped_by_agent"), "rank/4"),
             from_agent(job, NodeHeartbeat(node_id="n2", ranks_alive=0, ranks_expected=2, last_step=400), "node/n2"),
             from_agent(job, NodeHealthChanged(node_id="n2", status="failed", component="gpu", check="xid",
                                               confidence="high", is_fatal=True), "node/n2")]
    assert quiet == [[], [], []] and "not acting as a member" in job.last_reason
    assert job.session.state.job("job1").last_step < 400


def test_an_observe_only_eviction_fences_nothing() -> None:
    job = Job(policy=ControllerPolicy(observe_only=True))
    out = job.health("n1")
    assert types(out)[:2] == ["IncidentOpened", "NodeEvictionDecided"] and out[1].payload.observe_only
    assert not job.session.state.job("job1").node("n1").fenced


def test_what_counts_as_acting_as_a_member() -> None:
    assert acting_as_member(NodeHeartbeat(node_id="n", ranks_alive=1, ranks_expected=1))
    assert not acting_as_member(NodeHeartbeat(node_id="n", ranks_alive=0, ranks_expected=1))
    assert acting_as_member(NodeRegistered(node_id="n", host="h")) and not acting_as_member(
        NodeRegistered(node_id="n", host="h", standby=True))
    assert acting_as_member(RankExited(node_id="n", rank=0, pid=1, generation=0, exit_code=1, classification="infrastructure"))
    assert not acting_as_member(RankExited(node_id="n", rank=0, pid=1, generation=0, exit_code=None,
                                       classification="stopped_by_agent"))
    assert acting_as_member(StandbyChecked(node_id="n", passed=True))


# -- the agent ---------------------------------------------------------------------------------------------


def command(payload: EventPayload, subject: str, seconds: float, cause: uuid.UUID | None = None) -> Event:
    return Event.create(payload, job_id="job1", subject=subject, producer="controller",
                        occurred_at=T0 + timedelta(seconds=seconds), causation_id=cause)


def verdict(event: Event, *, standby: bool = False, generation: int = 3, running: bool = True, started_s: float = 0,
            ours: bool = False):  # type: ignore[no-untyped-def]
    return fence_verdict(event, node_id="n2", standby=standby, generation=generation, ranks_running=running,
                         started_at=T0 + timedelta(seconds=started_s), ours=ours)


def test_the_agent_is_fenced_by_its_eviction_or_fence_and_left_behind_by_a_newer_plan() -> None:
    expires = T0 + timedelta(minutes=5)
    evict = command(NodeEvictionDecided(node_id="n2", rung=1, reason="silent", expires_at=expires), "node/n2", 60)
    fenced = verdict(evict)
    assert fenced is not None and fenced.fenced and "evicted n2 at rung 1" in fenced.reason
    # Long past its expiry: a fence does not expire (the host may come back hours later).
    assert verdict(evict, started_s=-3600) is not None
    assert verdict(command(NodeEvictionDecided(node_id="n2", rung=1, reason="x", expires_at=expires, observe_only=True),
                           "node/n2", 60)) is None
    assert verdict(command(NodeEvictionDecided(node_id="n3", rung=1, reason="x", expires_at=expires), "node/n3", 60)) is None
    # Decided before this agent started: about an earlier agent of the node (a restarted keel run).
    assert verdict(evict, started_s=120) is None
    fence = command(NodeFenced(node_id="n2", generation=4, fenced_generation=3, evicted_by="e", input_type="NodeRegistered",
                               reason="fenced"), "node/n2", 100)
    assert verdict(fence, started_s=120) is None
    caused = verdict(fence, started_s=120, ours=True)  # stamped before the start, but caused by this agent's report
    assert caused is not None and caused.fenced and "generation 4" in caused.reason
    plan = command(CheckpointRestorePlanned(generation=4, step=10, reason="plan"), "job/job1", 70)
    behind = verdict(plan)
    assert behind is not None and not behind.fenced and "without n2" in behind.reason
    assert verdict(plan, generation=4) is None and verdict(plan, standby=True) is None
    assert verdict(plan, running=False) is None


def test_a_fenced_folder_refuses_a_worker_and_lets_a_standby_offer_the_host_back(tmp_path: Path) -> None:
    assert read_fence(tmp_path) is None and fence_refusal(None, job_id="j", node_id="n2", standby=False) == ""
    fence = Fence(job_id="j", node_id="n2", generation=3, decision_id="d", reason="evicted: silent")
    (tmp_path / FENCE_FILE).write_text(fence.to_json())
    assert read_fence(tmp_path) == fence
    refused = fence_refusal(read_fence(tmp_path), job_id="j", node_id="n2", standby=False)
    assert "fenced out of job j at generation 3" in refused and "--keel-standby" in refused
    assert fence_refusal(fence, job_id="j", node_id="n2", standby=True) == ""
    assert fence_refusal(fence, job_id="other", node_id="n2", standby=False) == ""
    (tmp_path / FENCE_FILE).write_text("{not json")
    assert "unreadable" in fence_refusal(read_fence(tmp_path), job_id="other", node_id="x", standby=False)


# -- the shard stores and the broker -------------------------------------------------------------------------


def test_a_store_refuses_backups_of_a_generation_older_than_its_own() -> None:
    def put(generation: int, floor: int):  # type: ignore[no-untyped-def]
        return authorize_put("n1", 0, "n1", store_node="n0", world_size=4, senders={0: "n1"},
                             generation=generation, min_generation=floor)

    assert put(3, 3) is None and put(4, 3) is None
    stale = put(2, 3)
    assert stale is not None and stale.code == "FAILED_PRECONDITION"
    assert "generation 2, older than 'n0''s generation 3" in stale.reason


def test_the_broker_ignores_a_left_nodes_reports_until_it_runs_a_newer_generation() -> None:
    sites = topology(2, 2, 1, 4)
    session = registered_session(sites)
    n3 = [s for s in sites if s.node_id == "n3"]
    eviction = ev(NodeEvictionDecided(node_id="n3", rung=1, reason="silent", expires_at=T0 + timedelta(minutes=5)),
                  "node/n3", producer="controller")
    session.observe(eviction)
    job = session.state.job(BROKER_JOB)
    assert "n3" in job.left and job.left_at["n3"] == 0
    # Back from the partition: its memory reports and a re-registration of its old ranks change nothing.
    stale = shards("n3", "memory", [(s.rank, 40) for s in n3])
    result = session.observe(stale)
    assert result.emitted == [] and "n3 left the job at generation 0" in result.decision.reason
    assert 40 not in session.state.job(BROKER_JOB).shards.get("memory", {})
    again = ev(CheckpointRanksRegistered(node_id="n3", generation=0, world_size=4, store_address="n3:7301",
                                         ranks=[RankGroups(rank=s.rank, dp=list(s.dp), pp=list(s.pp)) for s in n3]),
               "node/n3")
    assert session.observe(again).emitted == [] and "n3" in session.state.job(BROKER_JOB).left
    # Taken back later (a standby promoted into generation 2): a member again.
    newer = ev(CheckpointRanksRegistered(node_id="n3", generation=2, world_size=4, store_address="n3:7301",
                                         ranks=[RankGroups(rank=s.rank, dp=list(s.dp), pp=list(s.pp)) for s in n3]),
               "node/n3")
    session.observe(newer)
    job = session.state.job(BROKER_JOB)
    assert "n3" not in job.left and "n3" not in job.left_at


def test_a_node_evicted_then_started_again_under_its_id_is_planned_from_in_the_newer_generation() -> None:
    """A lost node replaced by a fresh machine under the same id (``start_node``): the eviction may be decided
    before the new agent reports. Its inventory of the generation after the eviction counts; one of the
    generation it left does not."""
    from tests.unit.test_checkpoint_broker import four_nodes, inventory, plan_events

    session, backup = four_nodes()
    session.observe(shards("n1", "memory", [(1, 40)]))  # rank 1's step 40, reported before the loss
    session.observe(ev(NodeEvictionDecided(node_id="n1", rung=1, reason="lost", expires_at=T0 + timedelta(minutes=5)),
                       "node/n1", producer="controller"))
    assert "n1" in session.state.job(BROKER_JOB).left
    survivors = [inventory(f"n{r}", 1, memory={r: [40, 41]}, peer={1: [40]} if backup[1] == f"n{r}" else None)
                 for r in (0, 2, 3)]
    stale = inventory("n1", 0, memory={1: [44]})  # the old agent, back from a partition: nothing
    plan, _ = plan_events(session, [*survivors, stale])
    assert plan is None and 44 not in session.state.job(BROKER_JOB).shards.get("memory", {})
    plan, _ = plan_events(session, [inventory("n1", 1, ranks=[1])])  # the new machine: empty shared memory
    assert plan is not None and plan.generation == 1 and plan.step == 40
    assert {s.rank: s.tier for s in plan.sources} == {0: "memory", 1: "peer", 2: "memory", 3: "memory"}


def test_keel_incidents_lists_the_fenced_nodes() -> None:
    from keel.reports.incidents import format_fences

    job, eviction = lost_and_replaced()
    from_agent(job, NodeHeartbeat(node_id="n2", ranks_alive=2, ranks_expected=2, last_step=30), "node/n2")
    text = format_fences(job.log)
    assert text.startswith("nodes fenced out of their job") and "n2" in text
    assert "left at generation 0, heard at generation 1 (NodeHeartbeat)" in text
    assert str(eviction.correlation_id)[:8] in text and format_fences([]) == ""


def test_each_generation_rendezvous_on_its_own_port(tmp_path: Path) -> None:
    """The rendezvous fence: a stale rank of generation g knows only its own store's port (base + g); the
    new generation's store listens on base + g + 1, so the stale rank can never join it."""
    from keel.agent.launch_spec import LaunchSpec
    from keel.agent.supervisor import RankSupervisor

    spec = LaunchSpec(nnodes=4, nproc_per_node=1, node_rank=1, master_addr="127.0.0.1", master_port=29400,
                      command=("-c", "pass"), job_id="job", node_id="n01", agent_dir=tmp_path, root=tmp_path)
    supervisor = RankSupervisor(spec, tmp_path / "agent.sock", tmp_path / "fault.json")
    stale, new = supervisor.rank_env(0, 3), supervisor.rank_env(0, 4)
    assert (stale["MASTER_PORT"], new["MASTER_PORT"]) == ("29403", "29404")
    assert (stale["KEEL_GENERATION"], new["KEEL_GENERATION"]) == ("3", "4")
    assert stale["RANK"] == new["RANK"] == "1"


def test_a_heartbeat_of_a_generation_the_job_left_counts_no_progress() -> None:
    job, _ = lost_and_replaced()
    before = job.session.state.job("job1").last_step
    job.feed(NodeHeartbeat(node_id="n0", ranks_alive=2, ranks_expected=2, last_step=900, generation=0), "node/n0")
    assert job.session.state.job("job1").last_step == before
    job.feed(NodeHeartbeat(node_id="n0", ranks_alive=2, ranks_expected=2, last_step=40, generation=1), "node/n0")
    job.feed(NodeHeartbeat(node_id="n1", ranks_alive=2, ranks_expected=2, last_step=41), "node/n1")  # an older agent
    assert job.session.state.job("job1").last_step == 41
