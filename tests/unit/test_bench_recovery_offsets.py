"""bench/recovery.py places Keel's faults at stratified offsets within the checkpoint report round, the
same rule on the flat and the netns cluster (a lost node's ranks restore from a round step)."""

from __future__ import annotations

from bench.recovery import AHEAD, fault_offset, round_fault_step


def test_a_single_trial_fires_in_the_middle_of_the_round() -> None:
    assert fault_offset(0, 1, 64) == 32
    assert [fault_offset(i, 3, 64) for i in range(3)] == [10, 32, 53]


def test_the_fault_step_is_the_first_one_that_far_into_a_round_and_never_sooner_than_ahead() -> None:
    assert round_fault_step(10, 32, 64) == 32
    assert round_fault_step(30, 32, 64) == 96  # 32 is fewer than AHEAD steps away: the next round's
    for current in range(0, 300, 7):
        step = round_fault_step(current, 32, 64)
        assert step % 64 == 32 and current + AHEAD <= step < current + AHEAD + 64
