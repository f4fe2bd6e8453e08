"""The escalation ladder's rules: what the controller does about each event it decides on (pure).

One rule per input event type (``on_health``, ``on_exit``, ``on_diagnostics``, ..., ``on_tick``); each
reads the job through an ``ActionPlan`` and calls its actions (``actions``). ``decider`` dispatches to
them. Every decision's reason names the rung and the evidence.

The rungs (docs/architecture.md, "The escalation ladder"), cheapest first:

1. A high-confidence fatal hardware signal (GPU lost, fatal XID, NIC down, disk fault, kernel error),
   a node whose agent went silent, a silent node its peers' ranks cannot reach (their connections to its
   address keep retransmitting: ``peer_reported_lost_nodes``), or a minority of a stack capture round's nodes whose agents did not
   acknowledge the request (a host cut off: its ranks hang rather than fail): evict the node now,
   promote a ready warm standby into its slice of ranks, and restart every other node in place as the
   next generation (restore from memory and the peers' copies).
2. A crash or a hang with no culprit: stop the ranks and run stop-time diagnostics on every node; evict
   what fails or does not answer in time, else restart in place. A crash whose traceback the exit
   classifier pins on the user's code needs no diagnostics: it restarts in place at once.
3. (analyzer issue) stack aggregation names the smallest parallel group to evict.
4. The same failure again after a restart, with no progress in between: roll back to the last stable
   code version (``CodeVersionStable``, hot-update's) and restart (``RollbackDecided``; the restart
   commands carry that version). With no stable version known the restart runs the same code, and a
   third failure trips rung 6.
5. A NaN or a loss / gradient-norm spike that stop-time diagnostics do not explain (every node passes):
   silent data corruption is suspected. Dual-phase replay (``SdcReplayRequested``): every node restarts
   its ranks in replay mode from the checkpoint before the anomaly, and the analyzer judges which groups
   of machines compute wrong numbers (``SdcReplayAnalyzed``); the machine it locates is evicted (a
   standby takes its ranks), else the job restarts in place from before the anomaly.
6. A crash loop (the same fingerprint ``max_same_failure`` times in a row) or a spent restart budget:
   stop the job and page a human (``JobStopDecided``).

Hot-update's ``CodeRolloutRequested`` (an urgent deploy, a lazy one's deadline) becomes a planned
restart: an incident of kind ``code_update`` at rung 0, which is no failure (the crash-loop breaker does
not count it) but whose lost time ETTR accounts like any other.

Time-dependent rules (a silent node, a diagnostic that timed out) fire on ``TimerTicked`` from the
controller's clock (recorded, so a replay sees the same time): rules never read a clock. Liveness and
every deadline and expiry go by the recorded clock (when events arrive between ticks), never by a
producer's timestamp; a producer's clock skew is reported (``report_skews``), never acted on.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from keel.controller.actions import ActionPlan, ranks_text
from keel.controller.guardrails import failure_fingerprint
from keel.controller.state import PEER_UNREACHABLE_CHECK, JobView, NodeView, PeerReport, processes_up
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    ApprovalGiven,
    CodeRolloutRequested,
    DiagnosticsCompleted,
    FailSlowConvicted,
    MetricAnomalyDetected,
    NodeClockSkewed,
    NodeCordoned,
    NodeFenced,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeRegistered,
    RankExited,
    RanksRestarted,
    SdcReplayAnalyzed,
    StacksAnalyzed,
    TimerTicked,
)

HARDWARE_COMPONENTS = frozenset({"gpu", "nic", "disk", "kernel", "host"})
"""Components whose high-confidence fatal fault is a rung-1 signal: evict without diagnosing."""
FAILURE_CLASSES = frozenset({"user_code", "infrastructure", "unknown"})
"""Exit classifications that are failures (``success`` and ``stopped_by_agent`` are not)."""
HANG_CHECKS = frozenset({"no_progress", "heartbeat_lost", "collective_stuck", "process_stopped"})
"""A rank's health checks that mean it hangs (rung 3, else rung 2)."""
SDC_VERDICT_GRACE = timedelta(seconds=30)
"""How long past a replay round's timeout the controller waits for the analyzer's verdict."""
SKEW_SIGHTINGS = 2
"""Confirmed windows in a row (of those a node was heard in, in one unbroken run of ticks) with its newest
timestamp beyond the allowance, in the same direction, before its clock is reported skewed: one event that
arrived late is no clock."""


# -- rung 1 and hangs ----------------------------------------------------------------------------------


def on_health(plan: ActionPlan, p: NodeHealthChanged) -> None:
    """A node's health changed: rung 1 for a high-confidence fatal hardware fault, rung 3 (else 2) for a
    hung rank; anything milder is left to the higher rungs."""
    job = plan.job
    if p.check == PEER_UNREACHABLE_CHECK:
        if not evict_peer_reported(plan, plan.now):
            plan.note(f"{p.node_id}: {p.check} {p.status} ({p.detail or 'no detail'}): evidence kept; a node is "
                      f"evicted on it only while it is silent too")
        return
    if p.status != "failed":
        plan.note(f"{p.node_id} is {p.status} ({p.component}/{p.check}): nothing to do")
        return
    if p.node_id not in job.nodes:
        plan.note(f"health event for unknown node {p.node_id} ({p.component}/{p.check}): it never registered "
                  f"with job {plan.event.job_id}; recorded, nothing done")
        return
    node = job.node(p.node_id)
    if node.evicted:
        plan.note(f"{p.node_id} is already evicted")
        return
    if node.eviction_pending:
        plan.note(f"{p.node_id} already has eviction {node.eviction_pending} pending")
        return
    rung1 = p.is_fatal and p.confidence == "high" and p.component in HARDWARE_COMPONENTS
    if rung1:
        why = (f"rung 1: high-confidence fatal {p.component} fault on {p.node_id} ({p.check}: "
               f"{p.detail or 'no detail'}); evict now rather than diagnose")
        if not node.ranks or node.standby or job.stopped:
            plan.evict_idle(p.node_id, why + (" (an idle standby: nothing to restart)" if node.standby else ""))
            return
        plan.open_incident("hardware", p.node_id, "", why)
        plan.recover(1, frozenset({p.node_id}), why)
        return
    if p.component == "rank" and p.check in HANG_CHECKS and node.ranks and not job.stopped:
        if job.incident is not None:
            plan.note(f"{p.node_id}: rank {p.check} during incident {job.incident.id[:8]} ({job.incident.stage}): "
                      f"part of it")
            return
        _open_hang(plan, p.node_id, p.check, f"{p.node_id} reports {p.check} ({p.detail or 'no detail'})")
        return
    plan.note(f"{p.node_id}: {p.component}/{p.check} failed with {p.confidence} confidence, fatal={p.is_fatal}; "
              f"not a rung-1 signal, left to the higher rungs")


def _open_hang(plan: ActionPlan, node_id: str, check: str, evidence: str) -> None:
    """A hang: rung 3 (capture the stacks while the ranks hang) or, with stack analysis off, rung 2."""
    if plan.policy.stack_analysis:
        why = (f"rung 3: {evidence}: capture the stacks of every training process while they hang and let the "
               f"analyzer find the outliers")
        plan.open_incident("hang", node_id, f"hang/{check}", why)
        plan.capture_stacks(why)
        return
    why = f"rung 2: {evidence} and nothing names a culprit: stop the ranks and run stop-time diagnostics on every node"
    plan.open_incident("hang", node_id, f"hang/{check}", why)
    plan.diagnose(why)


ALL_BLOCKED_CHECK = "all_ranks_blocked"


def all_blocked(job: JobView, floor: timedelta) -> tuple[str, str] | None:
    """Whether every rank of the job has been inside a collective at once for ``floor`` (pure): the node whose
    ranks entered first and the evidence, or None.

    Each active node's newest heartbeat must have all its ranks inside one (``NodeView.blocked``), in the job's
    generation. A rank's wait only grows while it stays in the same collective, so at the earliest of those
    heartbeats every rank was inside one, and had been since the latest entry: the job was blocked together for
    (earliest heartbeat - latest entry). Nobody was computing or loading data for the others to wait on, which
    a slow rank or a data-loader stall never looks like (its own rank is outside a collective). The ranks that
    entered first are the group the others wait behind."""
    if floor <= timedelta(0) or job.stopped or job.finished:
        return None
    active = job.active
    views = [n.blocked for n in active]
    if not active or any(b is None or b.generation != job.generation for b in views):
        return None
    blocked = [(n.node_id, b) for n, b in zip(active, views, strict=True) if b is not None]
    together = min(b.heard_at for _, b in blocked) - max(b.since for _, b in blocked)
    if together < floor:
        return None
    entries = sorted((b.heard_at - timedelta(seconds=waited), rank, collective, node)
                     for node, b in blocked for rank, collective, waited in b.ranks)
    first = entries[0][0]
    group = [(rank, collective, node) for entered, rank, collective, node in entries
             if entered - first <= timedelta(seconds=0.5)]
    names = sorted({collective for _, collective, _ in group})
    evidence = (f"every rank of the job ({len(entries)} on {len(blocked)} node(s)) has been inside a collective at once "
                f"for {together.total_seconds():.1f} s (floor {floor.total_seconds():g} s): nobody is computing for them "
                f"to wait on. Waiting longest: rank(s) {', '.join(str(r) for r, _, _ in group)} in "
                f"{', '.join(names)} on {', '.join(sorted({n for _, _, n in group}))}")
    return group[0][2], evidence


# -- crashes: rungs 2, 4 and 6 -------------------------------------------------------------------------


def on_exit(plan: ActionPlan, p: RankExited) -> None:
    """A rank exited: a failure opens an incident at rung 2 (diagnostics; a crash in the user's code
    restarts at once), rung 4 (roll back) the second time in a row, rung 6 past ``max_same_failure``. A
    restarted generation failing before it stepped past its restore point supersedes its incident."""
    job = plan.job
    if p.classification not in FAILURE_CLASSES:
        plan.note(f"rank {p.rank} on {p.node_id} exited ({p.classification}): not a failure")
        return
    if job.stopped:
        plan.note(f"the job is stopped: the exit of rank {p.rank} is recorded, nothing restarted")
        return
    if p.generation < job.generation:
        plan.note(f"rank {p.rank} of generation {p.generation} exited; the job is at generation {job.generation}: "
                  f"an old generation ending")
        return
    incident = job.incident
    if incident is not None:
        restarted = incident.target_generation
        if not (incident.stage == "recovering" and restarted is not None and p.generation >= restarted):
            plan.note(f"rank {p.rank} on {p.node_id} exited ({p.classification}) during incident "
                      f"{incident.id[:8]} ({incident.stage}): part of it")
            return
        # The restarted generation itself failed before stepping past its restore point: the
        # recovery did not work. Close that incident and take this failure on as a new one (a
        # repeated fingerprint then climbs to rung 4, and on to rung 6).
        plan.resolve("superseded", f"generation {p.generation} failed again before stepping past its restore "
                                   f"point (step {incident.restore_step}): rank {p.rank} on {p.node_id} exited "
                                   f"({p.classification})")
    fingerprint = failure_fingerprint(p.classification, p.error_type, p.stderr_tail)
    streak = _streak(job.crash_loop.fingerprints, fingerprint)
    what = (f"rank {p.rank} on {p.node_id} exited ({p.classification}{': ' + p.error_type if p.error_type else ''}"
            f"{'; ' + p.reason if p.reason else ''})")
    kind = "user_code" if p.classification == "user_code" else "crash"
    if 2 <= streak < plan.policy.max_same_failure:
        why = (f"rung 4: {what}; the same failure ({fingerprint}) {streak} times in a row with no progress "
               f"in between: roll back to the last stable code version and restart")
        plan.open_incident(kind, p.node_id, fingerprint, why, ranks=[p.rank])
        plan.recover(4, frozenset(), why, rollback=True)
    elif p.classification == "user_code":
        why = f"rung 2: {what}; the traceback names the user's code, not a machine: restart in place, no diagnostics"
        plan.open_incident(kind, p.node_id, fingerprint, why, ranks=[p.rank])
        plan.recover(2, frozenset(), why)
    else:
        why = f"rung 2: {what}; nothing names a culprit: stop the ranks and run stop-time diagnostics on every node"
        plan.open_incident(kind, p.node_id, fingerprint, why, ranks=[p.rank])
        if streak >= plan.policy.max_same_failure:
            plan.recover(2, frozenset(), why)  # the crash-loop breaker stops it, with its reason
        else:
            plan.diagnose(why)


# -- verdicts: diagnostics (rung 2), stacks and fail-slow (rung 3), anomalies and replays (rung 5) -----


def on_diagnostics(plan: ActionPlan, p: DiagnosticsCompleted) -> None:
    """One node's stop-time diagnostics result: conclude the round once every node that can answer did."""
    incident = plan.job.incident
    if incident is None or incident.stage != "diagnosing" or p.round != incident.diag_round:
        plan.note(f"diagnostics of {p.node_id} (round {p.round}) outside a diagnosing incident: recorded")
        return
    missing = sorted(incident.diag_nodes - set(incident.diag_results))
    named = {s for r in incident.diag_results.values() for s in r.suspects}
    if missing and not set(missing) <= named:
        plan.note(f"diagnostics round {p.round}: {p.node_id} {'passed' if p.passed else 'failed'}; waiting for "
                  f"{', '.join(missing)}")
        return
    # Everyone who can answer did, and they name every silent node as the peer that never joined:
    # no need to sit out the timeout.
    conclude_diagnostics(plan, timed_out=tuple(missing))

def conclude_diagnostics(plan: ActionPlan, timed_out: tuple[str, ...], unacknowledged: tuple[str, ...] = ()) -> None:
    """End the open incident's diagnostics round: stop, evict what failed, replay (rung 5) or restart in
    place, as ``diagnostics_verdict`` says."""
    incident = plan.job.incident
    assert incident is not None
    verdict = diagnostics_verdict(incident.diag_results, incident.diag_nodes, timed_out,
                                  plan.policy.diagnostics_timeout, unacknowledged=unacknowledged,
                                  ack_timeout=plan.policy.diagnostics_ack_timeout)
    round_ = incident.diag_round
    if verdict.stop:
        plan.resolve("stopped", f"rung 2: stop-time diagnostics round {round_}: {verdict.reason}", stop=True, rung=2)
    elif verdict.evict:
        plan.recover(2, verdict.evict, f"rung 2: stop-time diagnostics round {round_}: {verdict.reason}: evict")
    elif incident.kind == "metric_anomaly" and plan.policy.sdc_replay and plan.job.anomaly_step >= 0:
        plan.replay_sdc(f"rung 5: stop-time diagnostics round {round_}: {verdict.reason}, yet a machine computed "
                        f"a non-finite or spiking value at step {plan.job.anomaly_step}: silent data corruption "
                        f"suspected")
    else:
        plan.recover(2, frozenset(), f"rung 2: stop-time diagnostics round {round_}: {verdict.reason}: "
                                     f"restart in place")


def on_stacks(plan: ActionPlan, p: StacksAnalyzed) -> None:
    """The analyzer's verdict on a stack capture (rung 3): evict the group it names, or go on to rung 2."""
    incident = plan.job.incident
    if incident is None or incident.stage != "capturing" or p.round != incident.stacks_round:
        plan.note(f"stack verdict of round {p.round} outside a capturing incident: recorded")
        return
    seen = f" (could not see: {'; '.join(p.missing)})" if p.missing else ""
    if (not p.conclusive or not p.group_nodes) and resolve_cleared_stall(plan, f"the analyzer was inconclusive "
                                                                             f"({p.reason}){seen}"):
        return
    if not p.conclusive or not p.group_nodes:
        plan.diagnose(f"rung 3 inconclusive: {p.reason}{seen}; rung 2: stop the ranks and run stop-time "
                      f"diagnostics on every node")
        return
    group = f"{p.group_kind.upper()} group" if p.group_kind in ("tp", "pp", "dp") else p.group_kind
    plan.recover(3, frozenset(p.group_nodes),
                 f"rung 3: the analyzer names rank(s) {ranks_text(p.outlier_ranks)} as outliers ({p.reason}); "
                 f"evict the smallest group covering them, the {group} of rank(s) {ranks_text(p.group_ranks)} on "
                 f"{', '.join(p.group_nodes)} (over-evicting on purpose){seen}")

def resolve_cleared_stall(plan: ActionPlan, verdict: str) -> bool:
    """A hang whose capture named no culprit, while every node running the hung generation has since
    stepped past where the job stood when it opened: the stall cleared itself (a long save or eval
    outside its phase, a slow filesystem). Stopping the job for diagnostics would only lose time, so the
    incident is resolved (rung 0) and the verdict kept in its reason. A conclusive verdict still evicts:
    the outlier it names stalled everyone, and may again. True when it resolved the incident."""
    job, incident = plan.job, plan.job.incident
    assert incident is not None
    running = {n.node_id for n in job.active if n.ranks and n.generation == incident.generation}
    if incident.kind != "hang" or not running or not running <= incident.stepped_on:
        return False
    plan.resolve("recovered", f"the hang cleared itself: every node of generation {incident.generation} "
                              f"({', '.join(sorted(running))}) stepped past step {incident.last_step} during the "
                              f"capture, and {verdict}: nothing to evict or restart", rung=0)
    return True


def on_fail_slow(plan: ActionPlan, p: FailSlowConvicted) -> None:
    """The analyzer convicts a slow group (rung 3, fail-slow): evict it, unless an incident is open."""
    job = plan.job
    nodes = [n for n in p.group_nodes if n in job.nodes and not job.node(n).evicted]
    if job.stopped:
        plan.note(f"fail-slow conviction of {', '.join(p.group_nodes)}: the job is stopped; recorded")
        return
    if job.incident is not None:
        plan.note(f"fail-slow conviction of {', '.join(p.group_nodes)} during incident {job.incident.id[:8]} "
                  f"({job.incident.stage}): recorded; the analyzer convicts again if it persists")
        return
    if not nodes:
        plan.note(f"fail-slow conviction of {', '.join(p.group_nodes)}: no such live node of this job; recorded")
        return
    spanned = conviction_spans_restart(plan.now, p.rounds, timedelta(seconds=p.interval_s),
                                       job.restarted_at)
    if spanned:
        plan.note(f"fail-slow conviction of {', '.join(p.group_nodes)}: {spanned}; recorded, not acted on (the "
                  f"analyzer counts afresh)")
        return
    group = f"{p.group_kind.upper()} group" if p.group_kind in ("tp", "pp", "dp") else p.group_kind
    why = (f"rung 3: fail-slow: the analyzer convicts the {group} of rank(s) {ranks_text(p.group_ranks)} on "
           f"{', '.join(nodes)} ({p.flags} of {p.rounds} rounds, every {p.interval_s:g} s: {p.reason}); "
           f"every rank waits for it each step: evict it")
    plan.open_incident("fail_slow", nodes[0], f"fail_slow/{','.join(nodes)}", why,
                       ranks=sorted({r for n in nodes for r in job.node(n).ranks}))
    plan.recover(3, frozenset(nodes), why)

def conviction_spans_restart(convicted_at: datetime, rounds: int, interval: timedelta,
                             restarted_at: datetime | None) -> str:
    """Why a fail-slow conviction's window (``rounds`` rounds of ``interval``, each judging the interval
    before it, up to ``convicted_at``) spans the job's latest restart, else "". Such a window compares
    samples of two generations, or of the first steps after a restore: no evidence of a slow machine."""
    if restarted_at is None:
        return ""
    window_start = convicted_at - rounds * interval
    if restarted_at < window_start:
        return ""
    return (f"its {rounds} rounds of {interval.total_seconds():g} s since {window_start.isoformat()} span the "
            f"restart decided at {restarted_at.isoformat()}")

def on_metric_anomaly(plan: ActionPlan, p: MetricAnomalyDetected) -> None:
    """A NaN or a spike (a decline is only recorded) opens a ``metric_anomaly`` incident at rung 2;
    rung 5 follows if every node passes its diagnostics."""
    job = plan.job
    what = f"{p.kind.replace('_', '-')} {p.metric} on rank {p.rank} ({p.node_id}) at step {p.step}: {p.reason}"
    if p.kind == "decline":
        plan.note(f"throughput: {what}; recorded (a slow node is fail-slow's to convict; nothing is evicted "
                  f"for a decline alone)")
        return
    if job.stopped or p.generation < job.generation:
        plan.note(f"{what}: {'the job is stopped' if job.stopped else 'an old generation'}; recorded")
        return
    if job.incident is not None:
        plan.note(f"{what}: during incident {job.incident.id[:8]} ({job.incident.stage}): part of it")
        return
    if p.node_id not in job.nodes:
        plan.note(f"{what}: from a node this job does not know; recorded")
        return
    why = (f"rung 2: {what}. Nothing crashed, so a machine may be computing wrong numbers: stop the ranks and run "
           f"stop-time diagnostics on every node, then restart from a checkpoint before step {p.step} (the "
           f"checkpoint broker plans below it); if every node passes, rung 5 replays the step to locate a machine "
           f"that corrupts silently")
    plan.open_incident("metric_anomaly", p.node_id, f"metric/{p.kind}/{p.metric}", why, ranks=[p.rank])
    plan.diagnose(why)

def on_sdc_verdict(plan: ActionPlan, p: SdcReplayAnalyzed) -> None:
    """The analyzer's verdict on a replay round (rung 5): evict what it located, run the next phase, or
    restart in place."""
    incident = plan.job.incident
    if incident is None or incident.stage != "replaying" or p.round != incident.sdc_round:
        plan.note(f"replay verdict of round {p.round} outside a replaying incident: recorded")
        return
    rounds = f"{p.rounds} replay phase(s)"
    if p.kind in ("found", "several") and p.nodes:
        what = (f"machine {p.unit}" if p.kind == "found" else f"machines {', '.join(p.candidates)} (each fails alone)")
        plan.recover(5, frozenset(p.nodes), f"rung 5: dual-phase replay located {what} in {rounds}: {p.reason}; "
                                            f"evict {', '.join(p.nodes)} and restart from before the anomaly")
    elif p.kind == "ambiguous" and p.next_phase is not None:
        plan.replay_sdc(f"rung 5: replay round {p.round} was ambiguous ({p.reason})", phases=[p.next_phase],
                        reference=p.reference_digest)
    else:
        plan.recover(5, frozenset(), f"rung 5: dual-phase replay {p.kind.replace('_', ' ')} after {rounds} "
                                     f"({p.reason}): no machine to evict; restart in place from before the anomaly")


# -- time, code rollouts, recovery, the standby pool, humans -------------------------------------------


def on_tick(plan: ActionPlan, p: TimerTicked) -> None:
    """The job clock: a stack capture round's nodes that never acknowledged it (rung 1), a stack or
    replay verdict that never came, an approval nobody gave in time, a
    diagnostics round past its deadline or waiting on nodes that are gone, and running nodes gone silent
    (rung 1)."""
    job, policy, now = plan.job, plan.policy, p.now
    if p.interval_s is not None:
        report_skews(plan, now)
    if evict_peer_reported(plan, now):
        return
    incident = job.incident
    if (incident is not None and incident.stage == "capturing" and incident.stacks_requested_at is not None
            and now - incident.stacks_requested_at >= policy.stacks_verdict_timeout):
        if resolve_cleared_stall(plan, f"no verdict came from the analyzer within "
                                       f"{policy.stacks_verdict_timeout.total_seconds():g} s"):
            return
        plan.diagnose(f"rung 3: no verdict from the analyzer {policy.stacks_verdict_timeout.total_seconds():g} s "
                      f"after the capture of round {incident.stacks_round} was asked for (is it running?); rung 2: "
                      f"stop the ranks and run stop-time diagnostics on every node")
        return
    if incident is not None and incident.stage == "capturing" and incident.stacks_requested_at is not None:
        unanswered = round_lost_nodes(incident.stacks_nodes, incident.stacks_acknowledged,
                                      requested_at=incident.stacks_requested_at, now=now,
                                      clock_since=job.clock_since, ack_timeout=policy.diagnostics_ack_timeout)
        if unanswered.nodes:
            plan.recover(1, frozenset(unanswered.nodes), f"rung 1: stack capture round {incident.stacks_round}: "
                                                         f"{unanswered.reason}: evict")
            return
    if (incident is not None and incident.stage == "replaying" and incident.sdc_requested_at is not None
            and now - incident.sdc_requested_at >= policy.sdc_replay_timeout + SDC_VERDICT_GRACE):
        plan.recover(5, frozenset(), f"rung 5: no verdict on replay round {incident.sdc_round} "
                                     f"{(policy.sdc_replay_timeout + SDC_VERDICT_GRACE).total_seconds():g} s after it "
                                     f"was asked for (is the analyzer running?): restart in place from before the anomaly")
        return
    if incident is not None and resolve_by_processes(plan, now):
        return
    if (incident is not None and incident.stage == "recovering" and incident.recovering_since is not None
            and not job.stopped and not job.finished and now - incident.recovering_since >= policy.recovery_timeout):
        plan.resolve("stopped", f"the restart to generation {incident.target_generation} did not bring the job back to "
                                f"stepping within {policy.recovery_timeout.total_seconds():g} s: stopped, a human is "
                                f"paged", stop=True)
        return
    if (incident is not None and incident.stage == "awaiting_approval" and incident.approval_expires_at is not None
            and now >= incident.approval_expires_at):
        # Nobody answered: a held recovery is never carried out unapproved, and waiting longer wedges the
        # incident. Taken as a denial: the job stops and a human is paged, as `keel deny` would.
        plan.resolve("stopped", f"nobody answered the approval asked for {incident.approval_id[:8]} by "
                                f"{incident.approval_expires_at.isoformat()}: taken as denied; the job is stopped and "
                                f"left to a human", stop=True)
        return
    if incident is not None and incident.stage == "diagnosing":
        missing = sorted(incident.diag_nodes - set(incident.diag_results))
        if incident.diag_deadline is not None and now >= incident.diag_deadline:
            conclude_diagnostics(plan, timed_out=tuple(missing))
            return
        # Every node still owing a result has gone silent too (no heartbeat for the silence
        # timeout): its agent is gone, and waiting for the deadline only loses time.
        silent = [n for n in missing if (quiet := job.silence(job.node(n), now)) is not None
                  and quiet > policy.node_silence_timeout]
        if missing and len(silent) == len(missing) and len(missing) < len(incident.diag_nodes):
            plan.note(f"diagnostics round {incident.diag_round}: {', '.join(silent)} sent no heartbeat for "
                      f"over {policy.node_silence_timeout.total_seconds():g} s: not waiting for the deadline")
            conclude_diagnostics(plan, timed_out=tuple(missing))
            return
        # A node whose agent has not answered the request at all (agents send a heartbeat on receipt)
        # is gone: its peers would only wait for it in the all-gather until the deadline. Judged as a
        # capture round's silence is (``round_lost_nodes``): never over a gap in the recorded clock, never
        # half the round or more (a loaded or cut-off control plane, not that many hosts).
        if incident.diag_requested_at is not None:
            unanswered = round_lost_nodes(incident.diag_nodes, incident.diag_acknowledged | set(incident.diag_results),
                                          requested_at=incident.diag_requested_at, now=now,
                                          clock_since=job.clock_since, ack_timeout=policy.diagnostics_ack_timeout)
            if unanswered.nodes:
                plan.note(f"diagnostics round {incident.diag_round}: {unanswered.reason}: not waiting for the "
                          f"deadline")
                conclude_diagnostics(plan, timed_out=(), unacknowledged=unanswered.nodes)
        return
    if job.stopped or job.finished or (incident is not None and incident.stage not in ("recovering", "observing")):
        return
    active = job.active  # sorted on every tick: once, not twice
    quiet_for = {n.node_id: q for n in active if not n.eviction_pending and (q := job.silence(n, now)) is not None}
    lost = [n for n in active if n.node_id in quiet_for and quiet_for[n.node_id] > policy.node_silence_timeout]
    if not lost:
        return
    silence = max(quiet_for[n.node_id].total_seconds() for n in lost)
    names = ", ".join(n.node_id for n in lost)
    heard = ("nothing from" if job.recorded_clock else "no heartbeat from")
    on = " (on the controller's recorded clock: by arrival, not by the node's timestamps)" if job.recorded_clock else ""
    why = (f"rung 1: {heard} {names} for {silence:.0f} s{on} (timeout "
           f"{policy.node_silence_timeout.total_seconds():g} s): the node's agent is gone; evict it")
    plan.open_incident("lost_node", lost[0].node_id, "", why)
    plan.recover(1, frozenset(n.node_id for n in lost), why)

@dataclass(frozen=True)
class LostInRound:
    """Which nodes of a round the controller takes as lost for not acknowledging it, and why (or why none)."""

    nodes: tuple[str, ...]
    reason: str


def round_lost_nodes(nodes: Iterable[str], acknowledged: Iterable[str], *, requested_at: datetime,
                     now: datetime, clock_since: datetime | None, ack_timeout: timedelta) -> LostInRound:
    """The nodes of a stack capture round (rung 3) or a diagnostics round (rung 2) that are lost: their
    agents sent nothing in the ``ack_timeout`` since the request, while the others acknowledged it (agents
    answer the request with a heartbeat on receipt). Typically a host cut off the network or an agent
    killed: its ranks hang without failing (or its peers wait for it in the all-gather), so the rest of
    the round would only wait out its timeout to learn what the silence already says.

    Evicting on silence must not be done when the silence could be the controller's own, so nobody is
    lost while:

    - the ``ack_timeout`` has not passed since the request;
    - the recorded clock has a gap since the request (``clock_since``, the start of the current unbroken
      run of ticks, lies after it; or the job is not on the recorded clock, ``None``): the controller's
      host stalled or was cut off itself, and the acknowledgements may be waiting in the stream;
    - half the round or more is silent: that is likelier the controller's or NATS's side of the network
      than that many hosts at once (the analyzer's verdict, or its absence, decides as before).
    """
    asked = sorted(set(nodes))
    silent = [n for n in asked if n not in set(acknowledged)]
    waited = now - requested_at
    if not silent:
        return LostInRound((), "every node acknowledged the request")
    if waited < ack_timeout:
        return LostInRound((), f"{waited.total_seconds():g} s of the {ack_timeout.total_seconds():g} s "
                               f"acknowledgement timeout passed")
    if clock_since is None or clock_since > requested_at:
        return LostInRound((), "the recorded clock has a gap since the request (the controller itself was not "
                               "listening): silence proves nothing")
    if 2 * len(silent) >= len(asked):
        return LostInRound((), f"{len(silent)} of {len(asked)} nodes sent nothing: not fewer than half the round, "
                               f"likelier the controller's side of the network than that many hosts")
    heard = [n for n in asked if n not in silent]
    return LostInRound(tuple(silent), f"{', '.join(silent)} did not acknowledge the request within "
                                      f"{ack_timeout.total_seconds():g} s (its agent sent nothing) while "
                                      f"{', '.join(heard)} did: lost (a host cut off or gone; its ranks hang "
                                      f"rather than fail)")


def peer_reported_lost_nodes(reports: Iterable[PeerReport], nodes: Mapping[str, NodeView], *,
                             heard_since_tick: Iterable[str], now: datetime, clock_since: datetime | None,
                             min_silence: timedelta) -> LostInRound:
    """The nodes that peers name as unreachable and that are themselves silent: lost (rung 1).

    A host cut off the network gives nobody an error; its peers' ranks keep retransmitting to it
    (``peer_unreachable``: their kernel heard no acknowledgement for several retransmission timeouts).
    That names the address, and the node that registered it, but a lossy path between two hosts would
    too. So a report counts only when the controller cannot hear the named node either. A node is lost
    when a report:

    - comes from a node of the job that runs ranks and is not itself on its way out;
    - names an address that exactly one other such node registered (none: not a node of this job; more
      than one: hosts sharing an address, such as loopback on one machine, name nobody);
    - has stood while the named node's agent sent nothing since it was recorded (any event, by arrival:
      a node that keeps heartbeating is reachable, whatever one peer's connection says), for at least
      ``min_silence`` by the recorded clock since its last event (``clock_since`` bounds it: time the
      controller itself was not listening counts for nothing; no recorded clock: nobody is lost);
    - comes from the better connected of the two: the named node has been silent longer than the reporter
      had been when its report arrived (a reporter whose own link failed for a while flushes its queued
      report once it is back, naming peers that were never the problem).

    And, as for a capture round, not when half the running nodes or more would be lost: likelier the
    controller's side of the network than that many hosts.
    """
    heard_now = set(heard_since_tick)
    running = {n.node_id: n for n in nodes.values()
               if n.ranks and not n.standby and not n.evicted and not n.eviction_pending and not n.fenced}
    if clock_since is None:
        return LostInRound((), "no recorded clock: a node's silence proves nothing")
    lost: dict[str, str] = {}
    waiting: list[str] = []
    for report in sorted(reports, key=lambda r: (r.address, r.reporter)):
        if report.reporter not in running:
            continue
        owners = [n for n in running.values() if report.address in n.addresses]
        if len(owners) != 1 or owners[0].node_id == report.reporter:
            waiting.append(f"{report.reporter}'s report of {report.address} names "
                           f"{'no other running node' if not owners or owners[0].node_id == report.reporter else 'several nodes: ' + ', '.join(sorted(o.node_id for o in owners))}")
            continue
        named = owners[0]
        if named.node_id in heard_now or named.heard_at is None or named.heard_at > report.at:
            waiting.append(f"{named.node_id} ({report.address}) was heard from since {report.reporter} named it: "
                           f"reachable")
            continue
        silence = now - max(named.heard_at, clock_since)
        if silence < min_silence:
            waiting.append(f"{named.node_id} ({report.address}), named by {report.reporter}, silent for "
                           f"{silence.total_seconds():.1f} s of {min_silence.total_seconds():g} s")
            continue
        if report.reporter_heard_at is None:
            continue  # a reporter never heard before its report: a new agent's first word proves little
        reporter_quiet = report.at - max(report.reporter_heard_at, clock_since)
        if silence <= reporter_quiet:
            waiting.append(f"{report.reporter} had been silent for {reporter_quiet.total_seconds():.1f} s itself when "
                           f"it named {named.node_id} ({report.address}), silent for {silence.total_seconds():.1f} s: "
                           f"its own link is as much in doubt")
            continue
        lost.setdefault(named.node_id, f"{named.node_id} ({report.address}): {report.reporter}'s ranks cannot "
                                       f"reach it ({report.detail or 'retransmitting'}) and it sent nothing for "
                                       f"{silence.total_seconds():.1f} s (at least {min_silence.total_seconds():g} s, "
                                       f"nothing since the report)")
    if not lost:
        return LostInRound((), "; ".join(waiting) or "no standing report of an unreachable peer")
    if 2 * len(lost) >= len(running):
        return LostInRound((), f"{len(lost)} of {len(running)} running nodes named and silent: not fewer than "
                               f"half, likelier the controller's side of the network than that many hosts")
    return LostInRound(tuple(sorted(lost)), "; ".join(lost[n] for n in sorted(lost)))


def evict_peer_reported(plan: ActionPlan, now: datetime) -> bool:
    """Rung 1 for nodes their peers cannot reach and the controller cannot hear
    (``peer_reported_lost_nodes``): evict them now rather than wait for the ranks' step timeout and a
    capture round. Whether it acted."""
    job = plan.job
    if not job.peer_reports or job.stopped or job.finished:
        return False
    incident = job.incident
    if incident is not None and incident.stage not in ("capturing", "recovering", "observing"):
        return False  # diagnosing, replaying, awaiting approval: that round decides, with its own timeouts
    verdict = peer_reported_lost_nodes(job.peer_reports, job.nodes, heard_since_tick=job.heard, now=now,
                                       clock_since=job.clock_since, min_silence=plan.policy.peer_loss_silence)
    if not verdict.nodes:
        return False
    why = f"rung 1: peers cannot reach a silent node: {verdict.reason}: the host is cut off or gone; evict it"
    plan.open_incident("lost_node", verdict.nodes[0], "", why)
    plan.recover(1, frozenset(verdict.nodes), why)
    return True


def report_skews(plan: ActionPlan, now: datetime) -> None:
    """A node whose newest timestamp lies further outside the window than the allowance, in ``SKEW_SIGHTINGS``
    confirmed windows in a row that it was heard in (``NodeView.skew_sightings``), is reported
    (``NodeClockSkewed``), once per crossing; back within half the allowance in an unbroken run of ticks, the
    report is withdrawn. One late event (held in an outbox, or sent after a stalled loop) is seen in one window
    only, and is no skewed clock: the agent would judge its commands' expiries net of a skew it does not have.
    Reported only: nothing is decided on a producer's clock."""
    job, allowance = plan.job, plan.policy.clock_skew_allowance.total_seconds()
    unbroken = job.clock_since is not None and job.clock_since < now
    for node_id, skew in sorted(job.skews.items()):
        node = job.nodes.get(node_id)
        if node is None or node.evicted or node.fenced:
            continue
        way = "ahead of" if skew > 0 else "behind"
        if abs(skew) > allowance and not node.clock_skewed and abs(node.skew_sightings) >= SKEW_SIGHTINGS:
            why = (f"{node_id}'s clock is at least {abs(skew):.1f} s {way} the controller's recorded clock "
                   f"(allowance {allowance:g} s{'' if skew > 0 else '; or its events arrive that late'}): "
                   f"reported, not acted on (liveness and expiry go by arrival)")
        elif node.clock_skewed and unbroken and abs(skew) <= allowance / 2:
            why = f"{node_id}'s clock is back within {allowance / 2:g} s of the controller's recorded clock"
        else:
            continue
        plan.note(why)
        plan.emit(NodeClockSkewed(node_id=node_id, skewed=abs(skew) > allowance, skew_s=round(skew, 3),
                                  allowance_s=allowance, reason=why), subject=f"node/{node_id}", key=f"skew/{node_id}")


def on_rollout(plan: ActionPlan, p: CodeRolloutRequested) -> None:
    """Hot-update asks for a rollout: a planned restart onto the pending version (rung 0), if ranks run
    and no incident is open (its restart carries the version anyway)."""
    job = plan.job
    pending = job.code_pending
    if not pending:
        plan.note(f"rollout of {p.version_id} asked for: no version is pending (a restart already carried it)")
    elif job.stopped or job.finished:
        plan.note(f"rollout of {pending} asked for: the job is {'stopped' if job.stopped else 'finishing'}; "
                  f"nothing restarted")
    elif not job.active:
        plan.note(f"rollout of {pending} asked for: no ranks run yet; they start on it with the next restart")
    elif job.incident is not None:
        plan.note(f"rollout of {pending} asked for during incident {job.incident.id[:8]} ({job.incident.stage}): "
                  f"its restart carries the version, or one follows once it is resolved")
    else:
        plan.roll_out(f"{p.reason}{'' if pending == p.version_id else f' (the newest pending version is {pending})'}")

def on_heartbeat(plan: ActionPlan, p: NodeHeartbeat) -> None:
    """Every rank of the job blocked in collectives at once: a hang (``all_blocked``). A node of the restarted
    generation stepped past the restore point: the incident is resolved (and a rollout asked for meanwhile
    follows)."""
    if plan.job.incident is None and p.rank_collectives and not p.standby:
        found = all_blocked(plan.job, plan.policy.all_blocked_hang_after)
        if found is not None:
            _open_hang(plan, found[0], ALL_BLOCKED_CHECK, found[1])
            return
    incident = plan.job.incident
    if incident is None or incident.stage not in ("recovering", "observing") or p.node_id not in incident.started:
        return
    if p.last_step > incident.restore_step:
        by = "" if incident.stage == "recovering" else " without the controller acting"
        code = ""
        if incident.code_change.startswith("rolled back"):
            code = (f"; the code was {incident.code_change} and that resolved it: the cause was the user's code, "
                    f"not a machine")
        elif incident.code_change:
            code = f"; the code {incident.code_change}"
        plan.resolve("recovered", f"generation {incident.target_generation} is stepping again{by} ({p.node_id} at "
                                  f"step {p.last_step}, restored after step {incident.restore_step}){code}")
        _rollout_after(plan, incident.id)


def _rollout_after(plan: ActionPlan, incident_id: str) -> None:
    """A rollout asked for during the incident just resolved: restart onto the pending version now."""
    job = plan.job
    if job.rollout_due and job.code_pending and not job.stopped and not job.finished:
        plan.roll_out(f"rollout of {job.code_pending} asked for during incident {incident_id[:8]}, which is "
                      f"over: restart onto it now")

def resolve_by_processes(plan: ActionPlan, now: datetime) -> bool:
    """A job without the SDK (no rank ever reported a step, so none can be seen): its incident is resolved
    once every rank of the restarted generation has been running for ``process_settle_interval``, on
    process liveness alone. Coarser than a step: a rank that runs but hangs counts as recovered. True
    when it resolved the incident."""
    job, settle = plan.job, plan.policy.process_settle_interval
    incident = job.incident
    if (incident is None or job.sdk_seen or incident.stage not in ("recovering", "observing")
            or incident.processes_up_since is None or now - incident.processes_up_since < settle
            or not processes_up(job, incident)):
        return False
    ranks = sorted({r for n in job.active for r in n.ranks})
    by = "" if incident.stage == "recovering" else " without the controller acting"
    code = f"; the code {incident.code_change}" if incident.code_change else ""
    plan.resolve("recovered", f"generation {incident.target_generation} is running again{by}: all {len(ranks)} "
                              f"rank(s) on {', '.join(n.node_id for n in job.active)} alive for "
                              f"{(now - incident.processes_up_since).total_seconds():.1f} s (settle "
                              f"{settle.total_seconds():g} s){code}. Process-level: no rank reports through the "
                              f"SDK, so no step is seen; a rank that runs but hangs would count as recovered",
                 measure="process")
    _rollout_after(plan, incident.id)
    return True


def on_pool_change(plan: ActionPlan, p: EventPayload) -> None:
    """The standby pool changed: carry out a recovery that waits for a standby, else re-size the pool."""
    incident = plan.job.incident
    if incident is not None and incident.stage == "waiting_standby" and incident.held is not None:
        held = incident.held
        if len(plan.job.ready_standbys) >= sum(1 for n in held.evict if plan.job.node(n).ranks):
            plan.recover(held.rung, held.evict, f"{held.reason}; a ready standby joined the pool",
                         rollback=held.rollback, approved=True)
            return
    plan.size_pool()

def on_approval(plan: ActionPlan, p: ApprovalGiven) -> None:
    """A human's answer: approved, carry out the held recovery; denied, stop the job."""
    incident = plan.job.incident
    if incident is None or incident.stage != "awaiting_approval" or incident.approval_id != p.request_id:
        plan.note(f"answer to {p.request_id[:8]} by {p.by} matches no waiting action: recorded, nothing done")
        return
    held = incident.held
    assert held is not None
    if not p.approved:
        plan.resolve("stopped", f"{p.by} denied the recovery ({p.comment or 'no comment'}): the job is stopped and "
                                f"left to a human", stop=True)
        return
    plan.recover(held.rung, held.evict, f"{held.reason}; approved by {p.by}", rollback=held.rollback, approved=True)


def on_restart_report(plan: ActionPlan, p: RanksRestarted) -> None:
    """An agent's report on a restart command: a node that could not carry out the incident's restart
    (the command failed there, or reached it expired) is isolated: evicted, a standby takes its ranks."""
    incident = plan.job.incident
    if (incident is None or incident.stage != "recovering" or p.generation != incident.target_generation
            or p.outcome in ("restarted", "stale_generation")):
        plan.note(f"{p.node_id}: restart to generation {p.generation} {p.outcome}")
        return
    plan.recover(3, frozenset({p.node_id}), f"rung 3: {p.node_id} could not restart to generation {p.generation} "
                                            f"({p.outcome}{': ' + p.detail if p.detail else ''}): evict it, a standby "
                                            f"takes its ranks")


def acting_as_member(p: EventPayload) -> bool:
    """Whether a fenced node's report shows it still acting as a member of the job (pure): ranks alive in
    its heartbeat, a registration as a worker, a rank that ended on its own (it was running), answers to
    commands, a standby's self-check. A drained agent's goodbye (its ranks stopped by it, a heartbeat with
    none alive) and its health probes do not."""
    if isinstance(p, NodeHeartbeat):
        return p.ranks_alive > 0
    if isinstance(p, NodeRegistered):
        return not p.standby
    if isinstance(p, RankExited):
        return p.classification != "stopped_by_agent"
    return not isinstance(p, NodeHealthChanged)


def on_fenced(plan: ActionPlan, event: Event, node: NodeView) -> None:
    """A report from a node the controller decided to evict (``state.fenced_report``): the fold ignored it;
    the first one that shows the node still acting as a member is recorded (``NodeFenced``, once per fence
    and again for a new agent registering there), which tells its agent to stop and leave."""
    job, what = plan.job, event.type
    fence = f"evicted by decision {node.fenced_by[:8]} at generation {node.fenced_generation}"
    if node.fence_reported or not acting_as_member(event.payload):
        plan.note(f"{node.node_id} is fenced ({fence}): its {what} is ignored"
                  + ("" if node.fence_reported else " (not acting as a member: not reported)"))
        return
    why = (f"{node.node_id} was {fence} and is fenced: its {what} is ignored (it counts for no progress, "
           f"liveness, membership or checkpoint), and its agent is told to stop its ranks and leave; the job "
           f"is at generation {job.generation} without it")
    plan.note(why)
    plan.emit(NodeFenced(node_id=node.node_id, generation=max(0, job.generation),
                         fenced_generation=max(0, node.fenced_generation), evicted_by=node.fenced_by,
                         input_type=what, reason=why),
              subject=f"node/{node.node_id}", key=f"fenced/{node.node_id}/{node.fenced_by}",
              correlation_id=uuid.UUID(node.fenced_incident) if node.fenced_incident else None)


def on_cordon(plan: ActionPlan, p: NodeCordoned) -> None:
    """A human cordoned or uncordoned a node: only said in the reason (the fold keeps the cordon)."""
    plan.note(f"{p.node_id} {'cordoned' if p.cordoned else 'uncordoned'} by {p.by}"
              + (f" ({p.reason})" if p.reason else "")
              + (": never diagnosed, restarted onto or promoted until a human lifts it" if p.cordoned else ""))


# -- helpers: a failure's streak, the diagnostics verdict ----------------------------------------------


def _streak(history: Iterable[str], fingerprint: str) -> int:
    """How many times in a row ``fingerprint`` will have been seen, counting this time."""
    streak = 1
    for previous in reversed(tuple(history)):
        if previous != fingerprint:
            break
        streak += 1
    return streak


@dataclass(frozen=True)
class DiagnosticsVerdict:
    evict: frozenset[str]
    reason: str
    stop: bool = False


_LOCAL_CHECKS = frozenset({"gpu_matmul", "intra_node_all_to_all"})


def diagnostics_verdict(results: Mapping[str, DiagnosticsCompleted], nodes: Iterable[str], timed_out: Iterable[str],
                        timeout: timedelta, *, unacknowledged: Iterable[str] = (),
                        ack_timeout: timedelta | None = None) -> DiagnosticsVerdict:
    """Which nodes one round of stop-time diagnostics convicts, and why (pure).

    - A node failing a check of its own (the GPU self-test, the intra-node all-to-all) is bad.
    - The inter-node all-gather fails on *every* node when one is bad; the reports' ``suspects`` (a peer
      that never joined or sent wrong data) say which. A node named by another is bad; a node whose
      only failure is the collective and whom nobody names is a bystander.
    - A node that did not report (``timed_out``) is bad: its agent or its network is gone. So is one
      whose agent did not even acknowledge the request (``unacknowledged``, within ``ack_timeout``); a
      node that acknowledged and has not reported yet when the round ends that early is not judged.
    - The collective failing on at least half the nodes with nobody named is no bad machine (a switch,
      the fabric, a bad driver push): evicting would empty the job, so the verdict is to stop and page.
    """
    nodes, timed_out = sorted(set(nodes)), sorted(set(timed_out))
    unacknowledged = sorted(set(unacknowledged) - set(timed_out))
    named: dict[str, set[str]] = {}
    for reporter, result in results.items():
        for suspect in result.suspects:
            if suspect != reporter:
                named.setdefault(suspect, set()).add(reporter)
    local_bad = {n for n, r in results.items() if any(not c.passed and not c.skipped and c.check in _LOCAL_CHECKS
                                                      for c in r.results)}
    collective_only = {n for n, r in results.items() if not r.passed and n not in local_bad}
    bad = local_bad | set(timed_out) | set(unacknowledged) | {s for s in named if s in set(nodes)}
    unexplained = collective_only - bad
    parts = []
    for node_id in sorted(local_bad):
        checks = [f"{c.check}: {c.detail}" for c in results[node_id].results
                  if not c.passed and not c.skipped and c.check in _LOCAL_CHECKS]
        parts.append(f"{node_id} failed its own checks ({'; '.join(checks)})")
    for suspect in sorted(set(named) & bad - local_bad):
        parts.append(f"{suspect} named by {', '.join(sorted(named[suspect]))} "
                     f"({'never joined or sent wrong data' if suspect in timed_out or suspect not in results else 'sent wrong data'})")
    silent = [n for n in timed_out if n not in named]
    if silent:
        parts.append(f"{', '.join(silent)} did not report within {timeout.total_seconds():g} s (the diagnostic timed "
                     f"out): treated as failed")
    gone = [n for n in unacknowledged if n not in named]
    if gone:
        within = f" within {ack_timeout.total_seconds():g} s" if ack_timeout is not None else ""
        parts.append(f"{', '.join(gone)} did not acknowledge the request{within} (its agent sent nothing): lost")
    if not bad and unexplained:
        if len(unexplained) * 2 >= max(1, len(nodes)):
            return DiagnosticsVerdict(frozenset(), f"the inter-node check failed on {', '.join(sorted(unexplained))} "
                                                   f"and no report names a culprit: a fabric-wide fault, not a machine; "
                                                   f"stopping instead of evicting half the job", stop=True)
        bad = set(unexplained)
        for node_id in sorted(unexplained):
            checks = [f"{c.check}: {c.detail}" for c in results[node_id].results if not c.passed and not c.skipped]
            parts.append(f"{node_id} failed ({'; '.join(checks) or results[node_id].detail or 'no detail'})")
        parts.append("nobody else is named: evicting the minority that failed")
    if not bad:
        return DiagnosticsVerdict(frozenset(), f"passed on every node ({', '.join(sorted(results))})")
    bystanders = sorted(collective_only - bad)
    if bystanders:
        parts.append(f"{', '.join(bystanders)} failed only the collective check because of them: kept")
    return DiagnosticsVerdict(frozenset(bad), "; ".join(parts))
