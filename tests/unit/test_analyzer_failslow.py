"""Fail-slow: robust step-time outliers, and the rounds accumulator that convicts the group flagged most."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from keel.analyzer.aggregate import Topology, aggregate
from keel.analyzer.failslow import (
    FailSlowRounds,
    FlaggedGroup,
    StepTimeSettings,
    add_round,
    conclusion,
    flagged_from_step_times,
    flagged_from_verdict,
    step_time_outliers,
)
from tests.fixtures.stacks.scenarios import HUNG, replicate

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
GRID16 = Topology.grid(dp=4, pp=2, tp=2, ranks_per_node=2)
A = FlaggedGroup("pp", (5, 7), ("node-2", "node-3"), "stacks", (5,))
B = FlaggedGroup("node", (0, 1), ("node-0",), "step_times", (0,))
C = FlaggedGroup("tp", (8, 9), ("node-4",), "stacks", (9,))


def play(groups: list[FlaggedGroup | None], state: FailSlowRounds | None = None) -> FailSlowRounds:
    state = state or FailSlowRounds()
    for i, g in enumerate(groups):
        state = add_round(state, g, T0 + i * state.interval)
    return state


# ------------------------------------------------------------------------------------- step times


def test_a_rank_twice_the_median_is_flagged() -> None:
    r = step_time_outliers({0: 1.00, 1: 1.02, 2: 0.99, 3: 1.01, 4: 2.0, 5: 1.0})
    assert r.flagged == (4,)
    assert r.median_s == pytest.approx(1.005)
    assert any("4: step time 2 s is 1.99x the median" in s and "> 1.5x" in s for s in r.reasons)


def test_a_modest_but_clear_outlier_is_flagged_by_its_mad_z_score() -> None:
    times = {f"node-{i}": 1.0 + 0.01 * (i % 3) for i in range(12)}
    times["node-7"] = 1.2  # 1.2x: under the ratio, far outside the spread
    r = step_time_outliers(times)
    assert r.flagged == ("node-7",)
    assert r.z_scores["node-7"] > 3.5 and r.mad_s == pytest.approx(0.01)
    assert any("modified z" in s for s in r.reasons)


def test_agreeing_step_times_flag_nothing_even_with_zero_mad() -> None:
    same = dict.fromkeys(range(8), 1.0)
    assert step_time_outliers(same).flagged == ()
    same[3] = 1.01  # MAD 0, z infinite, but only 1 % slower: noise
    assert step_time_outliers(same).flagged == ()
    same[3] = 1.10
    assert step_time_outliers(same).flagged == (3,)


def test_fast_ranks_are_not_a_fault_and_slowest_come_first() -> None:
    r = step_time_outliers({0: 0.2, 1: 1.0, 2: 1.0, 3: 1.0, 4: 3.0, 5: 2.0, 6: 1.0})
    assert r.flagged == (4, 5)


def test_too_few_or_bad_samples() -> None:
    assert step_time_outliers({0: 1.0, 1: 5.0}).flagged == ()
    r = step_time_outliers({0: 1.0, 1: 1.0, 2: 1.0, 3: math.nan, 4: 9.0})
    assert r.flagged == (4,) and any("non-finite" in s for s in r.reasons)
    with pytest.raises(ValueError, match="negative"):
        step_time_outliers({0: -1.0, 1: 1.0, 2: 1.0})
    assert step_time_outliers({0: 1, 1: 1, 2: 1.3}, StepTimeSettings(ratio=1.2)).flagged == (2,)
    with pytest.raises(ValueError):
        StepTimeSettings(ratio=1.0)


def test_step_time_flags_become_node_groups() -> None:
    by_node = step_time_outliers({f"node-{i}": (3.0 if i == 6 else 1.0) for i in range(8)})
    g = flagged_from_step_times(by_node, GRID16, by="node")
    assert g == FlaggedGroup("node", (12, 13), ("node-6",), "step_times", (12, 13), ("node-6",))
    by_rank = step_time_outliers({r: (3.0 if r in (1, 9) else 1.0) for r in range(16)})
    g = flagged_from_step_times(by_rank, GRID16, by="rank")
    assert g is not None and g.kind == "groups" and g.nodes == ("node-0", "node-4")
    assert g.ranks == (0, 1, 8, 9) and g.outlier_ranks == (1, 9)
    assert flagged_from_step_times(step_time_outliers(dict.fromkeys(range(4), 1.0)), GRID16, by="rank") is None


# ----------------------------------------------------------------------------------------- rounds


def test_no_conclusion_before_enough_rounds() -> None:
    state = play([A, A, A, A])
    assert len(state.rounds) == 4 and conclusion(state) is None


def test_the_group_flagged_most_over_five_rounds_is_convicted() -> None:
    v = conclusion(play([A, B, A, None, A]))
    assert v is not None and v.kind == "convicted" and v.actionable
    assert (v.group_kind, v.group_ranks, v.group_nodes) == ("pp", (5, 7), ("node-2", "node-3"))
    assert v.outlier_ranks == (5,)
    assert "flagged in 3 of the last 5 rounds" in v.reasons[0]
    assert "5 rounds over 40 s (every 10 s)" in v.reasons[1] and "1 round(s) flagged nothing" in v.reasons[1]


def test_a_tie_is_inconclusive_and_says_so() -> None:
    v = conclusion(play([A, B, A, B, None]))
    assert v is not None and v.kind == "inconclusive" and not v.actionable
    assert "2 groups tie at 2 flag(s) each" in v.reasons[0]
    v = conclusion(play([A, B, C, None, None]))
    assert v is not None and "3 groups tie at 1" in v.reasons[0]


def test_one_flag_is_not_enough_and_nothing_is_nothing() -> None:
    v = conclusion(play([A, None, None, None, None]))
    assert v is not None and v.kind == "inconclusive" and "fewer than 2" in v.reasons[0]
    v = conclusion(play([None] * 5))
    assert v is not None and "no group was flagged" in v.reasons[0]


def test_only_the_last_rounds_count() -> None:
    state = play([B, B, B, A, A, A, None, A])
    assert len(state.rounds) == 5
    v = conclusion(state)
    assert v is not None and v.kind == "convicted" and v.group_ranks == A.ranks
    assert "4 of the last 5" in v.reasons[0]


def test_rounds_are_immutable_ordered_and_configurable() -> None:
    s0 = FailSlowRounds(interval=timedelta(seconds=2), rounds_needed=3, min_flags=2)
    s1 = add_round(s0, A, T0)
    assert s0.rounds == () and len(s1.rounds) == 1
    with pytest.raises(ValueError, match="not after the previous"):
        add_round(s1, A, T0)
    assert not s1.due(T0 + timedelta(seconds=1)) and s1.due(T0 + timedelta(seconds=2)) and s0.due(T0)
    v = conclusion(play([A, C, A], s0))
    assert v is not None and v.kind == "convicted" and "2 of the last 3" in v.reasons[0]
    assert "every 2 s" in v.reasons[1]
    with pytest.raises(ValueError):
        FailSlowRounds(rounds_needed=3, min_flags=4)
    with pytest.raises(ValueError):
        FailSlowRounds(interval=timedelta(0))


def test_rounds_fed_by_real_stack_aggregation() -> None:
    slow = aggregate(replicate(GRID16, {5: HUNG, 7: HUNG}), GRID16)
    fine = aggregate(replicate(GRID16), GRID16)
    other = aggregate(replicate(GRID16, {9: HUNG}), GRID16)
    flags = [flagged_from_verdict(v) for v in (slow, fine, slow, other, slow)]
    assert flags[1] is None  # an inconclusive round flags nothing
    v = conclusion(play(flags))
    assert v is not None and v.kind == "convicted"
    assert v.group_kind == "pp" and v.group_ranks == (5, 7) and v.outlier_ranks == (5, 7)
    assert v.outlier_nodes == ("node-2", "node-3") and "(by stacks)" in v.reasons[0]
