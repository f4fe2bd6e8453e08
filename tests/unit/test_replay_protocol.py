"""The replay protocol between a node agent and its ranks (``keel.protocol.replay``, ``keel.agent.commands``): the
spec file maps units to global ranks, malformed specs are refused with a reason, and the agent's answer
says which rank did not answer and why - a crash, a timeout, an unreadable file - never "clean"."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from keel.agent.commands import replay_answer, replay_spec_json
from keel.agent.supervisor import RankExit
from keel.events.types import SdcPhase, SdcReplayRequested, SdcUnit
from keel.protocol.replay import REPLAY_ENV, ReplaySpecError, parse_spec, replay_spec, write_result

REQUEST = SdcReplayRequested(
    round=2, generation=5, nodes=["a", "b", "c"], anomaly_step=30, timeout_s=20, reason="test",
    expires_at=datetime(2026, 12, 1, 9, 0, tzinfo=UTC),
    units=[SdcUnit(name="a+b", nodes=["a", "b"], ranks=[0, 1, 2, 3]), SdcUnit(name="c", nodes=["c"], ranks=[4, 5])],
    phases=[SdcPhase(index=3, kind="split", groups=[["c"], ["a+b"]], suspects=["c"])])


def exit_of(rank: int, code: int | None = 0, signal: str | None = None, tail: str = "") -> RankExit:
    return RankExit(rank=rank, local_rank=rank % 2, pid=100 + rank, generation=5, exit_code=code, signal=signal,
                    stderr_tail=tail, stopped_by_agent=False)


def test_the_spec_file_names_each_group_by_its_global_ranks(tmp_path: Path) -> None:
    text = replay_spec_json(REQUEST, tmp_path)
    spec = parse_spec(json.loads(text))
    assert spec.round == 2 and spec.anomaly_step == 30 and spec.result_dir == tmp_path
    assert [(p.index, p.kind, p.groups) for p in spec.phases] == [(3, "split", ((4, 5), (0, 1, 2, 3)))]
    assert spec.phases[0].group_of(2) == 1 and spec.phases[0].group_of(9) is None
    path = tmp_path / "replay.json"
    path.write_text(text)
    assert replay_spec({REPLAY_ENV: str(path)}) == spec
    assert replay_spec({}) is None


@pytest.mark.parametrize("data, match", [
    ({"round": 0, "result_dir": "/x"}, "KeyError"),
    ({"round": "zero", "phases": [], "result_dir": "/x"}, "ValueError"),
    ({"round": 0, "phases": [{"index": 1, "groups": [[]]}], "result_dir": "/x"}, "empty group"),
    ({"round": 0, "phases": [], "result_dir": "/x"}, "without groups"),
])
def test_malformed_specs_are_refused_with_the_reason(data: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ReplaySpecError, match=match):
        parse_spec(data)


def test_an_unreadable_spec_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ReplaySpecError, match="bad.json"):
        replay_spec({REPLAY_ENV: str(tmp_path / "bad.json")})
    with pytest.raises(ReplaySpecError, match="missing.json"):
        replay_spec({REPLAY_ENV: str(tmp_path / "missing.json")})


def test_every_rank_answered_gives_its_results(tmp_path: Path) -> None:
    spec = parse_spec(json.loads(replay_spec_json(REQUEST, tmp_path)))
    for rank in (4, 5):
        write_result(spec, rank, 29, [{"phase": 3, "group": 0, "consistent": True, "digest": "d" * 64, "detail": ""}],
                     detail="replayed step 30")
    answer = replay_answer(REQUEST, "c", "req", [4, 5], {4: exit_of(4), 5: exit_of(5)}, tmp_path, 1.5)
    assert answer.ran and answer.restored_step == 29 and [r.rank for r in answer.results] == [4, 5]
    assert answer.results[0].digest == "d" * 64 and answer.detail == "replayed step 30"


def test_a_crashed_a_late_and_an_unreadable_rank_are_named_and_nothing_counts_as_clean(tmp_path: Path) -> None:
    spec = parse_spec(json.loads(replay_spec_json(REQUEST, tmp_path)))
    write_result(spec, 0, 29, [{"phase": 3, "group": 1, "consistent": True, "digest": "d" * 64, "detail": ""}])
    (tmp_path / "rank3.json").write_text("{truncated")
    exits = {0: exit_of(0), 1: exit_of(1, code=1, tail="Traceback...\nRuntimeError: restore failed"), 3: exit_of(3)}
    answer = replay_answer(REQUEST, "a", "req", [0, 1, 2, 3], exits, tmp_path, 20.0)
    assert not answer.ran and answer.results == []
    assert "rank 1 ended (exit code 1) without an answer: RuntimeError: restore failed" in answer.detail
    assert "rank 2 did not finish in time (the round's timeout is 20 s)" in answer.detail
    assert "rank 3 wrote an unreadable answer" in answer.detail
