"""Rung 5 in the training program: ``keel.workload.train`` in replay mode (``$KEEL_SDC_REPLAY``) under
torchrun, 4 processes on gloo. A run restores its persisted step, replays the next step once per phase on
replica 0's batch, and compares gradients bitwise inside each group; a simulated bit flip on one rank
(``$KEEL_SIMULATED_SDC_FILE``) makes exactly the groups holding that rank disagree, and the analyzer's
judging of those answers locates it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.events.types import SdcGroupResult, SdcPhase, SdcReplayCompleted, SdcReplayRequested, SdcUnit
from keel.rules.sdc_replay import judge_round, verdict_fields

pytestmark = pytest.mark.integration

_TIMEOUT_S = 240


def _torchrun(args: list[str], env_extra: dict[str, str]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "keel.workload.train", "--steps", "4", "--batch", "4", "--micro-batches", "2", "--seed", "3", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen[str]) -> str:
    output, _ = proc.communicate(timeout=_TIMEOUT_S)
    assert proc.returncode == 0, output[-3000:]
    return output


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="keel-sdc-wl-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _spec(path: Path, phases: list[dict], result_dir: Path) -> Path:  # type: ignore[type-arg]
    path.write_text(json.dumps({"round": 0, "anomaly_step": 4, "phases": phases, "result_dir": str(result_dir)}))
    return path


def _results(result_dir: Path) -> dict[int, dict]:  # type: ignore[type-arg]
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in result_dir.glob("rank*.json")}


PHASES = [{"index": 1, "kind": "contiguous", "groups": [[0, 1], [2, 3]]},
          {"index": 2, "kind": "strided", "groups": [[0, 2], [1, 3]]}]


def test_replay_locates_a_rank_that_flips_a_bit_in_its_gradients(scratch: Path) -> None:
    persist = scratch / "dp4"
    _finish(_torchrun(["--persist-every", "2", "--persist-dir", str(persist)], {}))
    sdc = scratch / "sdc.json"
    sdc.write_text(json.dumps({"bit": 30, "index": 5, "ranks": [2]}))
    clean_dir, bad_dir = scratch / "clean", scratch / "bad"
    clean = _torchrun(["--persist-dir", str(persist)],
                      {"KEEL_SDC_REPLAY": str(_spec(scratch / "clean.json", PHASES, clean_dir))})
    bad = _torchrun(["--persist-dir", str(persist)],
                    {"KEEL_SDC_REPLAY": str(_spec(scratch / "bad.json", PHASES, bad_dir)),
                     "KEEL_SIMULATED_SDC_FILE": str(sdc)})
    out = _finish(clean) + _finish(bad)
    assert "replay round 0: step 4 replayed in 2 phase(s)" in out
    assert "done steps" not in out  # a replay never trains on

    healthy = _results(clean_dir)
    assert sorted(healthy) == [0, 1, 2, 3]
    assert all(r["restored_step"] == 3 for r in healthy.values())
    digests = {res["digest"] for r in healthy.values() for res in r["results"]}
    # Every replica replays replica 0's batch from the same state: one digest everywhere, every group consistent.
    assert len(digests) == 1 and all(res["consistent"] for r in healthy.values() for res in r["results"])

    corrupt = _results(bad_dir)
    by = {(rank, res["phase"]): res for rank, r in corrupt.items() for res in r["results"]}
    assert not by[(2, 1)]["consistent"] and not by[(3, 1)]["consistent"]   # row {2, 3}
    assert not by[(0, 2)]["consistent"] and not by[(2, 2)]["consistent"]   # column {0, 2}
    assert by[(0, 1)]["consistent"] and by[(1, 2)]["consistent"] and by[(0, 1)]["digest"] in digests
    assert "1 of" in by[(3, 1)]["detail"]  # exactly one element differs

    # The analyzer judges those answers: the unit of rank 2 is the one in a failing group of both phases.
    units = [SdcUnit(name=f"n{r}", nodes=[f"n{r}"], ranks=[r]) for r in range(4)]
    request = SdcReplayRequested(
        round=0, generation=2, nodes=[u.name for u in units], units=units, anomaly_step=4, timeout_s=60,
        expires_at="2026-12-01T09:00:00Z", reason="test",
        phases=[SdcPhase(index=p["index"], kind=p["kind"], groups=[[f"n{r}" for r in g] for g in p["groups"]])
                for p in PHASES])
    answers = {f"n{rank}": SdcReplayCompleted(node_id=f"n{rank}", request_id="r", round=0, ran=True,
                                              restored_step=r["restored_step"],
                                              results=[SdcGroupResult(rank=rank, **res) for res in r["results"]])
               for rank, r in corrupt.items()}
    fields = verdict_fields(request, judge_round(request, answers))
    assert fields["kind"] == "found" and fields["unit"] == "n2", fields["reason"]


def test_replay_keeps_pipelines_whole_and_compares_each_stage(scratch: Path) -> None:
    persist = scratch / "pp2"
    _finish(_torchrun(["--pp", "2", "--persist-every", "2", "--persist-dir", str(persist)], {}))
    sdc = scratch / "sdc-pp.json"
    sdc.write_text(json.dumps({"bit": 30, "index": 0, "ranks": [3]}))
    result_dir = scratch / "pp-bad"
    phases = [{"index": 1, "kind": "contiguous", "groups": [[0, 1, 2, 3]]},
              {"index": 2, "kind": "strided", "groups": [[0, 1], [2, 3]]}]
    _finish(_torchrun(["--pp", "2", "--persist-dir", str(persist)],
                      {"KEEL_SDC_REPLAY": str(_spec(scratch / "pp.json", phases, result_dir)),
                       "KEEL_SIMULATED_SDC_FILE": str(sdc)}))
    by = {(rank, res["phase"]): res for rank, r in _results(result_dir).items() for res in r["results"]}
    # Phase 1, both replicas together: stage 0 (ranks 0, 2) agrees, stage 1 (ranks 1, 3) does not.
    assert by[(0, 1)]["consistent"] and by[(2, 1)]["consistent"]
    assert not by[(1, 1)]["consistent"] and not by[(3, 1)]["consistent"]
    # Phase 2, each replica alone: consistent, but rank 3's stage-1 result differs from rank 1's.
    assert all(by[(r, 2)]["consistent"] for r in range(4))
    assert by[(1, 2)]["digest"] != by[(3, 2)]["digest"] and by[(0, 2)]["digest"] == by[(2, 2)]["digest"]
