"""The pure parts of an agent's rejoin (``keel.agent.rejoin``) and of tick isolation (``keel.agent.isolation``)."""

from __future__ import annotations

import json
import logging

import pytest

from keel.agent.isolation import PieceFailures, Pieces, should_log
from keel.agent.rejoin import AgentState, ProcessRef, decide_rejoin


def state(**fields: object) -> AgentState:
    base: dict[str, object] = dict(job_id="job", node_id="n01", agent=ProcessRef(100, 5), generation=3,
                                   standby=False, node_rank=1, ranks={2: ProcessRef(101, 6), 3: ProcessRef(102, 6)},
                                   zygote=ProcessRef(99, 4), code={"version_id": "v2", "path": "/code/v2"})
    base.update(fields)
    return AgentState(**base)  # type: ignore[arg-type]


def test_the_state_file_round_trips_and_a_bad_one_is_refused_with_the_reason() -> None:
    recorded = state(held=True)
    assert AgentState.from_json(recorded.to_json()) == recorded
    raw = json.loads(recorded.to_json())

    def edited(**fields: object) -> str:
        return json.dumps({**raw, **fields})

    for text, why in (("{", "unreadable agent state"), ('{"version": 99}', "not a version-1"),
                      (edited(generation=-1), "non-negative"), (edited(ranks={"2": "x"}), "unreadable agent state"),
                      (edited(agent=[0, 5]), "bad process reference"), (edited(code=[1]), "code must be")):
        with pytest.raises(ValueError, match=why):
            AgentState.from_json(text)


def test_an_agent_rejoins_only_the_job_and_node_its_predecessor_died_in() -> None:
    previous = state()
    decision = decide_rejoin(previous, job_id="job", node_id="n01", standby=False)
    assert decision.mode == "rejoin" and decision.previous == previous and "generation 3" in decision.reason
    assert decide_rejoin(None, job_id="job", node_id="n01", standby=False).mode == "fresh"
    other_job = decide_rejoin(previous, job_id="job2", node_id="n01", standby=False)
    assert other_job.mode == "fresh" and "'job'" in other_job.reason
    assert decide_rejoin(previous, job_id="job", node_id="n02", standby=False).mode == "fresh"
    # Started as a standby: a new machine for the pool, whatever ran before.
    as_standby = decide_rejoin(previous, job_id="job", node_id="n01", standby=True)
    assert as_standby.mode == "fresh" and "standby" in as_standby.reason
    # An idle standby died: nothing to resume.
    assert decide_rejoin(state(standby=True, ranks={}), job_id="job", node_id="n01", standby=False).mode == "fresh"
    # Held (a diagnostics round stopped the ranks) or failed: rejoined too, at that generation.
    held = decide_rejoin(state(ranks={}, held=True), job_id="job", node_id="n01", standby=False)
    assert held.mode == "rejoin"


def test_a_failing_piece_is_logged_once_per_interval_with_the_count(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    pieces = Pieces("n00", logging.getLogger("test.pieces"), every_s=60, clock=lambda: now[0])
    caplog.set_level(logging.ERROR, logger="test.pieces")

    def broken() -> int:
        raise ValueError("boom")

    assert pieces.run("probe", broken, default=7) == 7
    assert pieces.run("probe", lambda: 1) == 1
    for second in range(1, 61):
        now[0] = float(second)
        pieces.run("probe", broken)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages  # the first (traceback), then at 60 s: the count and the latest error
    assert caplog.records[0].exc_info is not None
    assert "60 times in the last 60 s" in messages[1] and "ValueError: boom" in messages[2]
    assert pieces.failures["probe"].total == 61 and pieces.total() == 61
    # BaseException (a cancel, an exit) is not swallowed.
    with pytest.raises(KeyboardInterrupt):
        pieces.run("probe", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))


def test_should_log_is_the_first_time_then_once_per_interval() -> None:
    failures = PieceFailures()
    assert should_log(failures, 5.0)
    failures.logged_at_s = 5.0
    assert not should_log(failures, 64.9) and should_log(failures, 65.0)
