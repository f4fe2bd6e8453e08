"""The controller's guardrails trip where they should, and say why."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from keel.controller.guardrails import CrashLoopBreaker, EvictionBreaker, failure_fingerprint

T0 = datetime(2026, 11, 29, 8, 0, tzinfo=UTC)


def test_eviction_breaker_trips_on_the_fraction_of_a_small_job_and_on_the_count_of_a_big_one() -> None:
    breaker = EvictionBreaker(window=timedelta(hours=1), max_evictions=8, max_fraction=0.1)
    assert breaker.limit(16) == 1 and breaker.limit(1024) == 8 and breaker.limit(4) == 1
    assert breaker.check(T0, 16).allowed
    breaker = breaker.record(T0)
    verdict = breaker.check(T0 + timedelta(minutes=10), 16)
    assert not verdict.allowed
    assert "1 eviction(s) in the last 1 h reach the limit of 1" in verdict.reason and "16 nodes" in verdict.reason
    # The window slides: an hour later the old eviction no longer counts.
    assert breaker.check(T0 + timedelta(hours=1, seconds=1), 16).allowed
    big = EvictionBreaker()
    for i in range(8):
        assert big.check(T0 + timedelta(minutes=i), 1024).allowed
        big = big.record(T0 + timedelta(minutes=i))
    assert not big.check(T0 + timedelta(minutes=9), 1024).allowed


def test_crash_loop_breaker_stops_the_same_failure_and_an_exhausted_budget() -> None:
    breaker = CrashLoopBreaker(window=timedelta(hours=1), restart_budget=4, max_same=3)
    same = "user_code/ValueError@train.py:step"
    for i in range(2):
        assert breaker.check(T0 + timedelta(minutes=i), same).allowed
        breaker = breaker.record(T0 + timedelta(minutes=i), same)
    verdict = breaker.check(T0 + timedelta(minutes=3), same)
    assert not verdict.allowed and "the same failure 3 times in a row" in verdict.reason
    # Progress past the failure point resets the streak, but not the budget.
    breaker = breaker.progressed()
    assert breaker.check(T0 + timedelta(minutes=4), same).allowed
    breaker = breaker.record(T0 + timedelta(minutes=4), "infrastructure/SIGKILL")
    breaker = breaker.record(T0 + timedelta(minutes=5), "infrastructure/NCCL")
    verdict = breaker.check(T0 + timedelta(minutes=6), "unknown/?")
    assert not verdict.allowed and "restart budget spent: 4 restart(s)" in verdict.reason
    assert breaker.check(T0 + timedelta(hours=2), "unknown/?").allowed


def test_fingerprints_ignore_ranks_steps_and_addresses() -> None:
    tail = ('Traceback (most recent call last):\n  File "/job/train.py", line 120, in main\n'
            '  File "/job/model.py", line {line}, in forward\nValueError: bad shape at step {step} rank {rank}\n')
    a = failure_fingerprint("user_code", "ValueError", tail.format(line=40, step=10, rank=3))
    b = failure_fingerprint("user_code", "ValueError", tail.format(line=40, step=999, rank=7))
    assert a == b == "user_code/ValueError@model.py:forward"
    assert failure_fingerprint("user_code", "ValueError", tail.format(line=40, step=1, rank=1).replace(
        "forward", "backward")) != a
    no_traceback = failure_fingerprint("infrastructure", "", "Segmentation fault at 0x7f00dead (rank 3)")
    assert no_traceback == "infrastructure/?@Segmentation fault at N (rank N)"
