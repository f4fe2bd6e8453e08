"""Rung 5 from events: replay units from the ranks' groups, judging a replay round (majority reference,
members that disagree, missing answers), localisation across rounds, and the analyzer's decider."""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, datetime, timedelta

from keel.analyzer.core import AnalyzerDecider
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CLOCK_PRODUCER,
    SdcGroupResult,
    SdcPhase,
    SdcReplayAnalyzed,
    SdcReplayCompleted,
    SdcReplayRequested,
    TimerTicked,
)
from keel.kernel.decider import DeciderSession
from keel.rules.sdc import plan_phases
from keel.rules.sdc_replay import judge_round, machine_units, sdc_phase, verdict_fields

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
GOOD = hashlib.sha256(b"clean gradients").hexdigest()


def digest_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def test_units_join_nodes_of_one_pipeline_and_keep_dp_replicas_apart() -> None:
    # DP 2 x PP 2, one rank a node: pipelines {0, 1} on n0+n1 and {2, 3} on n2+n3; DP groups {0,2}, {1,3}.
    rank_nodes = {0: "n0", 1: "n1", 2: "n2", 3: "n3"}
    links = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    units = machine_units(rank_nodes, links)
    assert [(u.name, u.nodes, u.ranks) for u in units] == [("n0+n1", ["n0", "n1"], [0, 1]), ("n2+n3", ["n2", "n3"], [2, 3])]
    # PP 1: every node is its own unit, ordered by rank.
    flat = machine_units({0: "b", 1: "a", 2: "c"}, {0: [0], 1: [1], 2: [2]})
    assert [u.name for u in flat] == ["b", "a", "c"]


def request(nodes: list[str], round_: int = 0, phases=None) -> SdcReplayRequested:  # type: ignore[no-untyped-def]
    units = machine_units({i: n for i, n in enumerate(nodes)}, {i: [i] for i in range(len(nodes))})
    planned = phases or [sdc_phase(p) for p in plan_phases([u.name for u in units])]
    return SdcReplayRequested(round=round_, generation=3, nodes=nodes, units=units, phases=planned, anomaly_step=22,
                              timeout_s=60, expires_at=T0 + timedelta(minutes=5), reason="test")


def answers(req: SdcReplayRequested, bad: set[str], silent: frozenset[str] = frozenset()) -> dict[str, SdcReplayCompleted]:
    """What the agents report when ``bad`` nodes corrupt their gradients: groups holding one disagree."""
    units = {u.name: u for u in req.units}
    out: dict[str, SdcReplayCompleted] = {}
    for node in req.nodes:
        if node in silent:
            continue
        results = []
        for phase in req.phases:
            for gi, group in enumerate(phase.groups):
                if node not in group:
                    continue
                members = [n for n in group]
                corrupt = bad & set(members)
                for rank in units[node].ranks:
                    if len(members) == 1:
                        results.append(SdcGroupResult(phase=phase.index, group=gi, rank=rank, consistent=True,
                                                      digest=digest_of(node) if node in bad else GOOD))
                    elif corrupt:
                        results.append(SdcGroupResult(phase=phase.index, group=gi, rank=rank, consistent=False,
                                                      detail=f"ranks disagree: {sorted(corrupt)}"))
                    else:
                        results.append(SdcGroupResult(phase=phase.index, group=gi, rank=rank, consistent=True, digest=GOOD))
        out[node] = SdcReplayCompleted(node_id=node, request_id="r", round=req.round, ran=True, restored_step=21,
                                       results=results)
    return out


def test_one_bad_node_among_four_is_found_in_one_round_of_two_phases() -> None:
    req = request(["n0", "n1", "n2", "n3"])
    judgement = judge_round(req, answers(req, {"n2"}))
    assert [o.failed_groups for o in judgement.outcomes] == [[1], [0]]  # row {n2, n3}, column {n0, n2}
    fields = verdict_fields(req, judgement)
    assert fields["kind"] == "found" and fields["unit"] == "n2" and fields["nodes"] == ["n2"]
    assert fields["rounds"] == 2 and judgement.reference == GOOD[:16]


def test_clean_replay_is_not_reproduced_and_names_nobody() -> None:
    req = request(["n0", "n1", "n2", "n3"])
    fields = verdict_fields(req, judge_round(req, answers(req, set())))
    assert fields["kind"] == "not_reproduced" and "nodes" not in fields


def test_a_node_that_sent_nothing_counts_against_its_groups_not_for_them() -> None:
    req = request(["n0", "n1", "n2", "n3"])
    judgement = judge_round(req, answers(req, set(), silent=frozenset({"n1"})))
    assert judgement.missing == ("n1",)
    fields = verdict_fields(req, judgement)
    assert fields["kind"] == "found" and fields["unit"] == "n1"
    assert "no result from n1" in str(fields["reason"])


def test_agreeing_group_with_a_result_unlike_the_majority_fails() -> None:
    # Nine nodes, 3 x 3. A corruption in what every member receives alike (say, a bad reduction on one
    # node's NIC) can leave a group's members agreeing with each other on a wrong result: the reference
    # (what most groups agree on) still tells it apart.
    req = request([f"n{i}" for i in range(9)])
    replies = answers(req, set())
    wrong = digest_of("bitflip")
    for node, reply in list(replies.items()):
        results = []
        for r in reply.results:
            phase = next(p for p in req.phases if p.index == r.phase)
            if "n4" in phase.groups[r.group]:
                r = r.model_copy(update={"digest": wrong})
            results.append(r)
        replies[node] = reply.model_copy(update={"results": results})
    judgement = judge_round(req, replies)
    fields = verdict_fields(req, judgement)
    assert fields["kind"] == "found" and fields["unit"] == "n4", fields["reason"]
    assert any("differ from the reference" in e for o in judgement.outcomes for e in o.evidence)


def test_two_bad_nodes_need_a_split_round_that_reuses_the_reference() -> None:
    req = request(["n0", "n1", "n2", "n3"])
    first = judge_round(req, answers(req, {"n0", "n3"}))
    fields = verdict_fields(req, first)
    assert fields["kind"] == "ambiguous"
    split = fields["next_phase"]
    req2 = request(["n0", "n1", "n2", "n3"], round_=1, phases=[split])
    second = judge_round(req2, answers(req2, {"n0", "n3"}), reference=first.reference)
    final = verdict_fields(req2, second, earlier=first.results)
    assert final["kind"] == "several" and sorted(final["nodes"]) == ["n0", "n3"]  # type: ignore[arg-type]


def test_nobody_ran_is_incomplete() -> None:
    req = request(["n0", "n1", "n2", "n3"])
    failed = {n: SdcReplayCompleted(node_id=n, request_id="r", round=0, ran=False, detail="restore failed")
              for n in req.nodes}
    fields = verdict_fields(req, judge_round(req, failed))
    assert fields["kind"] == "incomplete"


def ev(payload: EventPayload, at: datetime, correlation: uuid.UUID | None = None) -> Event:
    subject = (f"node/{payload.node_id}" if isinstance(payload, SdcReplayCompleted)
               else "clock/j" if isinstance(payload, TimerTicked) else "job/j")
    producer = CLOCK_PRODUCER if isinstance(payload, TimerTicked) else "test"
    return Event.create(payload, job_id="j", subject=subject, producer=producer, occurred_at=at, correlation_id=correlation)


def test_decider_judges_once_when_every_node_answered_with_the_incident_id() -> None:
    incident = uuid.uuid4()
    session = DeciderSession(AnalyzerDecider())
    req = request(["n0", "n1", "n2", "n3"])
    req_event = ev(req, T0, incident)
    session.observe(req_event)
    replies = answers(req, {"n1"})
    out = []
    for i, (_node, reply) in enumerate(sorted(replies.items())):
        out += session.observe(ev(reply.model_copy(update={"request_id": str(req_event.id)}), T0 + timedelta(seconds=i + 1))).emitted
    verdicts = [e for e in out if isinstance(e.payload, SdcReplayAnalyzed)]
    assert len(verdicts) == 1 and verdicts[0].payload.kind == "found" and verdicts[0].payload.unit == "n1"
    assert verdicts[0].correlation_id == incident
    # folded back: the round is closed, a late tick judges nothing more
    later = session.observe(ev(TimerTicked(now=T0 + timedelta(minutes=5)), T0 + timedelta(minutes=5))).emitted
    assert not [e for e in later if isinstance(e.payload, SdcReplayAnalyzed)]


def test_decider_judges_at_the_deadline_without_the_silent_node() -> None:
    session = DeciderSession(AnalyzerDecider())
    req = request(["n0", "n1", "n2", "n3"])
    req_event = ev(req, T0)
    session.observe(req_event)
    for _node, reply in sorted(answers(req, set(), silent=frozenset({"n3"})).items()):
        assert not [e for e in session.observe(ev(reply.model_copy(update={"request_id": str(req_event.id)}), T0)).emitted
                    if isinstance(e.payload, SdcReplayAnalyzed)]
    early = session.observe(ev(TimerTicked(now=T0 + timedelta(seconds=30)), T0 + timedelta(seconds=30))).emitted
    assert not [e for e in early if isinstance(e.payload, SdcReplayAnalyzed)]
    late = session.observe(ev(TimerTicked(now=T0 + timedelta(seconds=61)), T0 + timedelta(seconds=61))).emitted
    [verdict] = [e.payload for e in late if isinstance(e.payload, SdcReplayAnalyzed)]
    assert verdict.kind == "found" and verdict.unit == "n3" and verdict.missing == ["n3"]


def test_two_units_that_disagree_leave_no_majority_and_name_nobody() -> None:
    units_req = request(["n0", "n1"])
    phases = [SdcPhase(index=1, kind="split", groups=[["n0"], ["n1"]])]
    req = request(["n0", "n1"], phases=phases)
    judgement = judge_round(req, answers(req, {"n1"}))
    assert judgement.split_results and judgement.reference == ""
    fields = verdict_fields(req, judgement)
    assert fields["kind"] == "incomplete" and "majority" in str(fields["reason"]) and "nodes" not in fields
    assert units_req.units[1].name == "n1"
