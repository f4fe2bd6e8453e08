"""Rung 5 from events to verdicts: the replay units of a job, and the judging of a replay round.

Pure. ``machine_units`` groups a job's nodes into the "machines" a replay shrinks DP by: nodes joined by
a pipeline or tensor-parallel group must replay together (TP and PP stay fixed), so a unit is a
connected set of nodes holding whole model replicas.

``judge_round`` turns the agents' ``SdcReplayCompleted`` answers into each phase's failing groups and
hands them, with the earlier rounds of the same localisation, to ``keel.rules.sdc.locate``.

How a group passes: every replica of the replay processes the same recorded batch from the same
restored state, so on healthy hardware every rank of one pipeline stage computes bitwise the same
gradients. Inside a group the ranks of each stage all-gather their gradients and check they are equal
(``consistent``); the group's *result* is the set of its stages' digests. The *reference* is the result
most consistent groups share, across every phase of the round (or the one carried from the round
before): silent corruption almost always comes from one machine, so most groups are clean. A group
fails when a member saw its peers disagree, when its result differs from the reference, or when a
member of it sent no result (missing evidence counts against the group, never for it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from keel.events.types import (
    SdcPhase,
    SdcPhaseOutcome,
    SdcReplayCompleted,
    SdcReplayRequested,
    SdcUnit,
)
from keel.rules.sdc import Localisation, Phase, PhaseResult, locate


def machine_units(rank_nodes: Mapping[int, str], links: Mapping[int, Iterable[int]]) -> list[SdcUnit]:
    """The replay units: nodes joined (transitively) when a rank on one shares a PP or TP group (``links``:
    rank -> the ranks of its PP and TP groups) with a rank on another. Ordered by their lowest rank;
    named by their nodes joined with ``+``. Ranks whose node is unknown are left out."""
    parent: dict[str, str] = {n: n for n in rank_nodes.values()}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for rank, peers in links.items():
        if rank not in rank_nodes:
            continue
        for peer in peers:
            if peer in rank_nodes:
                a, b = find(rank_nodes[rank]), find(rank_nodes[peer])
                if a != b:
                    parent[max(a, b)] = min(a, b)
    members: dict[str, list[int]] = {}
    for rank, node in rank_nodes.items():
        members.setdefault(find(node), []).append(rank)
    units = []
    for ranks in sorted(members.values(), key=min):
        nodes = sorted({rank_nodes[r] for r in ranks}, key=lambda n: min(r for r in ranks if rank_nodes[r] == n))
        units.append(SdcUnit(name="+".join(nodes), nodes=nodes, ranks=sorted(ranks)))
    return units


def phase_of(p: SdcPhase) -> Phase:
    return Phase(p.index, p.kind, tuple(tuple(g) for g in p.groups), tuple(p.suspects))


def sdc_phase(p: Phase) -> SdcPhase:
    return SdcPhase(index=p.index, kind=p.kind, groups=[list(g) for g in p.groups], suspects=list(p.suspects))


@dataclass(frozen=True)
class RoundJudgement:
    outcomes: tuple[SdcPhaseOutcome, ...]
    results: tuple[PhaseResult, ...]
    reference: str
    missing: tuple[str, ...]
    ran: bool
    """Some node produced group results (else nothing can be judged)."""
    split_results: bool = False
    """Consistent groups disagree and no result has a majority: nothing tells the clean result apart."""


def _group_results(request: SdcReplayRequested, answers: Mapping[str, SdcReplayCompleted]
                   ) -> dict[tuple[int, int], tuple[bool, frozenset[str], list[str]]]:
    """(phase, group) -> (every member consistent, the distinct digests, what is wrong or missing)."""
    units = {u.name: u for u in request.units}
    out: dict[tuple[int, int], tuple[bool, frozenset[str], list[str]]] = {}
    by_rank = {}
    for answer in answers.values():
        for r in answer.results:
            by_rank[(r.phase, r.group, r.rank)] = r
    for phase in request.phases:
        for gi, group in enumerate(phase.groups):
            consistent, digests, notes = True, set(), []
            for name in group:
                unit = units.get(name)
                if unit is None:
                    consistent = False
                    notes.append(f"unit {name} is not in the request")
                    continue
                for rank in unit.ranks:
                    result = by_rank.get((phase.index, gi, rank))
                    if result is None:
                        consistent = False
                        node = next((n for n in unit.nodes if n in answers), None)
                        why = answers[node].detail if node is not None and not answers[node].ran else "no result"
                        notes.append(f"rank {rank} ({name}): {why or 'no result'}")
                    elif not result.consistent:
                        consistent = False
                        notes.append(f"rank {rank} ({name}): {result.detail or 'its peers gradients differ'}")
                    else:
                        digests.add(result.digest)
            out[(phase.index, gi)] = (consistent, frozenset(digests), notes)
    return out


def _result_text(digests: frozenset[str]) -> str:
    return ",".join(sorted(d[:16] for d in digests))


def judge_round(request: SdcReplayRequested, answers: Mapping[str, SdcReplayCompleted],
                reference: str = "") -> RoundJudgement:
    """Each phase's failing groups (see the module docstring). ``reference``: the result a previous round of
    the same localisation settled on ("" to take this round's majority)."""
    groups = _group_results(request, answers)
    missing = tuple(sorted(n for n in request.nodes if n not in answers or not answers[n].ran))
    ran = any(a.ran and a.results for a in answers.values())
    split_results = False
    if not reference:
        counts = Counter(_result_text(d) for ok, d, _ in groups.values() if ok and d)
        ranked = counts.most_common(2)
        if ranked and (len(ranked) == 1 or ranked[0][1] > ranked[1][1]):
            reference = ranked[0][0]
        split_results = len(ranked) > 1 and not reference
    outcomes, results = [], []
    for phase in request.phases:
        failed, evidence = [], []
        for gi, group in enumerate(phase.groups):
            ok, digests, notes = groups[(phase.index, gi)]
            result = _result_text(digests)
            if not ok:
                failed.append(gi)
                evidence.append(f"group {gi} ({', '.join(group)}): {'; '.join(notes[:4])}")
            elif not reference or result != reference:
                failed.append(gi)
                evidence.append(f"group {gi} ({', '.join(group)}): its gradients agree but differ from the "
                                f"reference ({result or 'nothing'} vs {reference or 'no majority'})")
        outcomes.append(SdcPhaseOutcome(phase=phase.index, kind=phase.kind, failed_groups=failed, evidence=evidence))
        results.append(PhaseResult(phase_of(phase), frozenset(failed)))
    return RoundJudgement(tuple(outcomes), tuple(results), reference, missing, ran, split_results)


def verdict_fields(request: SdcReplayRequested, judgement: RoundJudgement,
                   earlier: Sequence[PhaseResult] = ()) -> dict[str, object]:
    """The ``SdcReplayAnalyzed`` fields (less the request id and round) for this round, localising with
    ``earlier`` phases of the same localisation first."""
    units = {u.name: u for u in request.units}
    common = {"phases": list(judgement.outcomes), "reference_digest": judgement.reference,
              "missing": list(judgement.missing)}
    if not judgement.ran:
        return {**common, "kind": "incomplete", "rounds": len(earlier),
                "reason": f"no node ran the replay ({', '.join(judgement.missing) or 'no answer'}): nothing to judge"}
    if judgement.split_results:
        return {**common, "kind": "incomplete", "rounds": len(earlier) + len(judgement.results),
                "reason": "the groups that agree internally disagree with each other and no result has a majority: "
                          "nothing tells the clean result from the corrupted one (a reference needs at least 3 "
                          "replay units)"}
    loc: Localisation = locate([*earlier, *judgement.results])
    reason = "; ".join(loc.reasons)
    if judgement.missing:
        reason += f"; no result from {', '.join(judgement.missing)} (counted against their groups)"
    fields: dict[str, object] = {**common, "kind": loc.kind, "candidates": list(loc.candidates), "rounds": loc.rounds,
                                 "reason": reason}
    if loc.kind == "found" and loc.machine is not None:
        fields.update(unit=loc.machine, nodes=list(units[loc.machine].nodes) if loc.machine in units else [])
    elif loc.kind == "several":
        fields.update(nodes=sorted({n for c in loc.candidates if c in units for n in units[c].nodes}))
    if loc.next_phase is not None:
        fields["next_phase"] = sdc_phase(loc.next_phase)
    return fields
