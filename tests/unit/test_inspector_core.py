"""The pure inspector core: hysteresis, fatal immediacy, recovery hold, only-changes emission."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from keel.agent.inspector import InspectorCore, InspectorPolicy, Observation
from keel.events.types import NodeHealthChanged

T0 = datetime(2026, 11, 29, 7, 0, tzinfo=UTC)
POLICY = InspectorPolicy()


def flap(n: int = 1) -> Observation:
    return Observation("nic", "link_flap", "ib0", "degraded", "low", False, "ib0 link flapped", {"flaps": n}, new_events=n)


def quiet_flap() -> Observation:
    return Observation("nic", "link_flap", "ib0", new_events=0)


def run(core: InspectorCore, samples: list[tuple[float, list[Observation]]]) -> list[tuple[float, NodeHealthChanged]]:
    state, out = core.initial_state(), []
    for at_s, observations in samples:
        state, events = core.step(state, observations, T0 + timedelta(seconds=at_s))
        out.extend((at_s, e) for e in events)
    return out


def test_two_flaps_in_five_minutes_tolerated_third_fails() -> None:
    core = InspectorCore("n1", POLICY)
    events = run(core, [(0, [flap()]), (1, [quiet_flap()]), (60, [flap()]), (61, [quiet_flap()]), (120, [flap()])])
    statuses = [(t, e.status, e.confidence) for t, e in events]
    assert statuses == [(0, "degraded", "low"), (60, "degraded", "medium"), (120, "failed", "medium")]
    last = events[-1][1]
    assert not last.is_fatal and last.evidence["occurrences"] == 3 and last.evidence["key"] == "ib0"
    assert "occurrence 3" in last.detail


def test_flaps_decay_after_the_window() -> None:
    core = InspectorCore("n1", POLICY)
    events = run(core, [(0, [flap()]), (60, [flap()]), (61, [quiet_flap()]),
                        (100, [quiet_flap()]),  # clear for 39 s: recovered
                        (400, [flap()])])       # the first two are older than 5 min
    assert [(t, e.status) for t, e in events] == [(0, "degraded"), (60, "degraded"), (100, "healthy"), (400, "degraded")]
    assert events[-1][1].evidence["occurrences"] == 1


def test_three_flaps_in_one_sample_fail_at_once() -> None:
    events = run(InspectorCore("n1", POLICY), [(0, [flap(3)])])
    assert [e.status for _, e in events] == ["failed"]


def test_fatal_high_confidence_signal_transitions_at_once() -> None:
    xid = Observation("gpu", "xid", "gpu3", "failed", "high", True, "gpu3: XID 79 (GPU has fallen off the bus)", {"xid": 79}, new_events=1)
    [(t, event)] = run(InspectorCore("n1", POLICY), [(0, [xid])])
    assert (event.status, event.confidence, event.is_fatal, event.component, event.check) == ("failed", "high", True, "gpu", "xid")
    assert event.node_id == "n1" and event.evidence["xid"] == 79 and "XID 79" in event.detail


def test_only_changes_are_emitted() -> None:
    down = Observation("disk", "disk_full", "/", "failed", "high", True, "/ full", new_events=1)
    ok = Observation("disk", "disk_full", "/")
    samples = [(float(t), [ok]) for t in range(10)] + [(float(t), [down]) for t in range(10, 20)]
    events = run(InspectorCore("n1", POLICY), samples)
    assert len(events) == 1


def test_recovery_requires_the_hold_time_and_fatal_holds_longer() -> None:
    fatal = Observation("gpu", "gpu_lost", "gpu0", "failed", "high", True, "gpu0 lost", new_events=1)
    ok = Observation("gpu", "gpu_lost", "gpu0")
    samples = [(0, [fatal])] + [(float(t), [ok]) for t in range(1, 700, 10)]
    events = run(InspectorCore("n1", POLICY), samples)
    assert [e.status for _, e in events] == ["failed", "healthy"]
    recovered_at = events[1][0]
    assert recovered_at - 1 >= POLICY.fatal_recovery_hold.total_seconds()
    assert events[1][1].evidence["previous_status"] == "failed"

    soft = Observation("host", "memory_pressure", "memory", "degraded", "low", False, "pressure")
    ok = Observation("host", "memory_pressure", "memory")
    events = run(InspectorCore("n1", POLICY), [(0, [soft]), (1, [ok]), (20, [ok]), (25, [soft]), (26, [ok]), (55, [ok]), (57, [ok])])
    # the bad sample at 25 (a second occurrence: medium confidence) restarts the hold: recovery at 57
    # (31 s after 26), not at 31
    assert [(t, e.status, e.confidence) for t, e in events] == [
        (0, "degraded", "low"), (25, "degraded", "medium"), (57, "healthy", "high")]


def test_a_soft_failed_signal_becomes_fatal_when_it_persists() -> None:
    down = Observation("nic", "link_down", "eth0", "failed", "medium", False, "eth0 link is down", fatal_if_persists=True)
    events = run(InspectorCore("n1", POLICY), [(float(t), [down]) for t in range(0, 40, 5)])
    assert [(t, e.status, e.confidence, e.is_fatal) for t, e in events] == [
        (0, "degraded", "low", False), (30, "failed", "high", True)]
    assert events[-1][1].evidence["bad_for_s"] == 30


def test_immediate_observations_skip_repetition() -> None:
    hang = Observation("rank", "no_progress", "rank3", "failed", "medium", False, "stalled", {"rank": 3}, immediate=True)
    [(t, event)] = run(InspectorCore("n1", POLICY), [(0, [hang]), (1, [hang])])
    assert (event.status, event.confidence, event.is_fatal) == ("failed", "medium", False)


def test_informational_is_emitted_once_and_changes_nothing() -> None:
    info = Observation("gpu", "nvml", "node", detail="no GPU: NVML unavailable", informational=True)
    events = run(InspectorCore("n1", POLICY), [(0, [info]), (1, [info]), (2, [info])])
    assert [(e.status, e.detail) for _, e in events] == [("healthy", "no GPU: NVML unavailable")]


def test_node_status_in_evidence_covers_other_signals() -> None:
    fatal = Observation("gpu", "xid", "gpu3", "failed", "high", True, "XID 79", new_events=1)
    soft = Observation("host", "memory_pressure", "memory", "degraded", "low", False, "pressure")
    ok = Observation("host", "memory_pressure", "memory")
    events = run(InspectorCore("n1", POLICY), [(0, [fatal, soft]), (1, [ok]), (40, [ok])])
    recovered = events[-1][1]
    assert recovered.status == "healthy" and recovered.evidence["node_status"] == "failed"


def test_time_must_be_aware_and_the_core_is_pure() -> None:
    core = InspectorCore("n1", POLICY)
    with pytest.raises(ValueError):
        core.step(core.initial_state(), [], datetime(2026, 1, 1))
    state = core.initial_state()
    a = core.step(state, [flap()], T0)
    b = core.step(state, [flap()], T0)
    assert a == b and state.signals == {}


def test_policy_from_config_uses_units() -> None:
    policy = InspectorPolicy.from_config({"recovery_hold": "45s", "soft_repeat_window": "10m", "disk_min_free_bytes": "2GiB",
                                          "xid_ignore": [13, 31, 43, 45, 68, 109, 119]})
    assert policy.recovery_hold == timedelta(seconds=45) and policy.disk_min_free_bytes == 2 * 1024**3
    with pytest.raises(ValueError):
        InspectorPolicy.from_config({"recovery_hold": 45})
    with pytest.raises(ValueError):
        InspectorPolicy.from_config({"bogus": "1s"})
    from keel.agent.inspector import classify_xid
    assert classify_xid(119, InspectorPolicy()) == "fatal" and classify_xid(119, policy) == "ignored"
