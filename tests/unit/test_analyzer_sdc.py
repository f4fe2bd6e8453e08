"""Rung 5 dual-phase replay: planning, localisation, fallbacks, and the simulator over every bad machine."""

from __future__ import annotations

import pytest

from keel.rules.sdc import (
    Phase,
    PhaseResult,
    binary_search_rounds,
    grid_shape,
    locate,
    plan_phases,
    plan_split,
    replays_needed,
    run_replays,
    simulate,
)

M24 = [f"m{i:02d}" for i in range(24)]


def failing(phase: Phase, bad: set[str]) -> PhaseResult:
    return PhaseResult(phase, frozenset(i for i, g in enumerate(phase.groups) if bad & set(g)))


def test_the_papers_example_24_machines_in_2_replays_where_binary_search_needs_5() -> None:
    p1, p2 = plan_phases(M24)
    assert p1.kind == "contiguous" and p2.kind == "strided"
    assert p1.groups[0] == tuple(M24[:6]) and len(p1.groups) == 4
    assert p2.groups[0] == ("m00", "m06", "m12", "m18") and len(p2.groups) == 6
    assert sorted(p1.machines) == sorted(p2.machines) == M24  # every machine once per phase
    loc = locate([failing(p1, {"m15"}), failing(p2, {"m15"})])
    assert loc.kind == "found" and loc.machine == "m15" and loc.rounds == 2 and loc.next_phase is None
    assert "m15 is the only one in a failing group of every phase" in loc.reasons[0]
    assert replays_needed(24) == 2 and binary_search_rounds(24) == 5
    sim = simulate(24)
    assert sim.all_correct and len(sim.cases) == 24 and sim.worst_rounds == 2


@pytest.mark.parametrize("n", [2, 3, 7, 13, 24, 96, 1200])
def test_every_possible_bad_machine_is_found(n: int) -> None:
    sim = simulate(n)
    assert sim.wrong == ()
    assert sim.all_correct and len(sim.cases) == n
    assert sim.worst_rounds == replays_needed(n) == 2
    rows, cols = grid_shape(n)
    assert rows * cols >= n > (rows - 1) * cols


def test_binary_search_rounds() -> None:
    assert [binary_search_rounds(n) for n in (1, 2, 3, 24, 96, 1200)] == [0, 1, 2, 5, 7, 11]
    with pytest.raises(ValueError):
        binary_search_rounds(0)


def test_one_machine_needs_no_replay() -> None:
    assert replays_needed(1) == 0
    sim = simulate(1)
    assert sim.all_correct and sim.worst_rounds == 0


def test_grid_is_near_square_or_follows_the_dp_shrink() -> None:
    assert grid_shape(24) == (4, 6)
    assert grid_shape(7) == (2, 4)
    assert grid_shape(13) == (3, 5)
    assert grid_shape(1200) == (30, 40)
    assert grid_shape(24, group_size=8) == (3, 8)
    assert grid_shape(5, group_size=50) == (1, 5)
    p1, p2 = plan_phases(M24, group_size=8)
    assert [len(g) for g in p1.groups] == [8, 8, 8] and [len(g) for g in p2.groups] == [3] * 8
    sim = simulate(24, group_size=8)
    assert sim.all_correct and sim.worst_rounds == 2
    with pytest.raises(ValueError):
        grid_shape(10, group_size=0)


def test_a_ragged_last_row_still_locates() -> None:
    machines = [f"h{i}" for i in range(7)]  # 2 x 4: the second row holds 3
    p1, p2 = plan_phases(machines)
    assert [len(g) for g in p1.groups] == [4, 3] and [len(g) for g in p2.groups] == [2, 2, 2, 1]
    for bad in machines:
        assert run_replays(machines, [bad]).machine == bad


def test_nothing_failing_in_phase_1_is_not_reproduced() -> None:
    p1, p2 = plan_phases(M24)
    loc = locate([PhaseResult(p1, frozenset())])
    assert loc.kind == "not_reproduced" and loc.machine is None and loc.next_phase is None
    assert loc.reasons[0].startswith("no group failed in phase 1 (contiguous, 4 groups): not reproduced")
    loc = locate([failing(p1, {"m03"}), PhaseResult(p2, frozenset())])
    assert loc.kind == "not_reproduced" and "no group failed in phase 2" in loc.reasons[0]
    assert run_replays(M24, []).kind == "not_reproduced" and run_replays(M24, []).rounds == 1


def test_two_bad_machines_fall_back_to_a_split_round() -> None:
    p1, p2 = plan_phases(M24)
    bad = {"m01", "m20"}
    loc = locate([failing(p1, bad), failing(p2, bad)])
    assert loc.kind == "ambiguous" and loc.machine is None
    assert set(loc.candidates) == {"m01", "m02", "m19", "m20"}  # rows 0, 3 x columns 1, 2
    nxt = loc.next_phase
    assert nxt is not None and nxt.kind == "split" and nxt.index == 3
    assert [g[0] for g in nxt.groups] == list(loc.candidates) and set(nxt.suspects) == set(loc.candidates)
    padding = {m for g in nxt.groups for m in g[1:]}
    assert padding and not padding & bad and all(len(g) == 6 for g in nxt.groups)  # padded to the replay size
    assert "more than one bad machine" in loc.reasons[0]
    final = locate([failing(p1, bad), failing(p2, bad), failing(nxt, bad)])
    assert final.kind == "several" and set(final.candidates) == bad and final.rounds == 3
    sim = simulate(24, bad_sets=[(1, 20), (0, 1), (5, 6, 7)])
    assert sim.all_correct and sim.worst_rounds == 3


def test_a_split_with_one_failure_finds_it() -> None:
    p1, p2 = plan_phases(M24)
    split = plan_split(["m01", "m02"], [m for m in M24 if m not in ("m01", "m02")], 6, 3)
    loc = locate([failing(p1, {"m01"}), failing(p2, {"m01"}), failing(split, {"m01"})])
    assert loc.kind == "found" and loc.machine == "m01"


def test_results_that_contradict_a_deterministic_fault_are_inconsistent() -> None:
    machines = [f"h{i}" for i in range(7)]
    p1, p2 = plan_phases(machines)  # rows [h0..h3], [h4..h6]; column 3 is [h3] alone
    loc = locate([PhaseResult(p1, frozenset({1})), PhaseResult(p2, frozenset({3}))])
    assert loc.kind == "inconsistent" and loc.next_phase is None
    assert "contradict a deterministic fault" in loc.reasons[0]


def test_failures_in_several_groups_can_still_intersect_in_one_machine() -> None:
    machines = [f"h{i}" for i in range(7)]
    p1, p2 = plan_phases(machines)
    loc = locate([PhaseResult(p1, frozenset({0, 1})), PhaseResult(p2, frozenset({3}))])
    assert loc.kind == "found" and loc.machine == "h3"
    loc = locate([PhaseResult(p1, frozenset({1})), PhaseResult(p2, frozenset({0, 3}))])
    assert loc.kind == "found" and loc.machine == "h4"


def test_non_intersecting_failures_retest_the_machines_that_never_passed() -> None:
    # a hand-made second phase that leaves b and d out: [a, b] fails, then [c] fails, [a] passes
    p1 = Phase(1, "contiguous", (("a", "b"), ("c", "d")))
    p2 = Phase(2, "strided", (("a",), ("c",)))
    loc = locate([PhaseResult(p1, frozenset({0})), PhaseResult(p2, frozenset({1}))])
    assert loc.kind == "ambiguous" and loc.candidates == ("b",)
    assert "the failing groups do not intersect; 1 machine(s) never passed" in loc.reasons[0]
    nxt = loc.next_phase
    assert nxt is not None and nxt.kind == "split" and nxt.groups == (("b", "a"),) and nxt.suspects == ("b",)
    assert locate([PhaseResult(p1, frozenset({0})), PhaseResult(p2, frozenset({1})),
                   PhaseResult(nxt, frozenset({0}))]).machine == "b"


def test_invalid_plans_and_results_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        plan_phases(["a", "b", "a"])
    with pytest.raises(ValueError, match="at least one machine"):
        plan_phases([])
    p1, _ = plan_phases(M24)
    with pytest.raises(ValueError, match="do not exist"):
        PhaseResult(p1, frozenset({4}))
    with pytest.raises(ValueError, match="in two groups"):
        Phase(1, "contiguous", (("a", "b"), ("b",)))
    with pytest.raises(ValueError, match="no phase results"):
        locate([])
    other = Phase(2, "strided", (("zz",),))
    with pytest.raises(ValueError, match="outside phase 1"):
        locate([failing(p1, {"m00"}), PhaseResult(other, frozenset({0}))])
