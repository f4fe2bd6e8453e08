"""``keel sim``: the fleet simulator from the command line (no servers): the table and JSON of every system asked
for, Keel's recorded log written as JSON lines and replayed clean, and clear refusals of what it cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.cli.main import main
from keel.events.envelope import REGISTRY


def test_keel_sim_runs_the_systems_asked_for_writes_them_and_replays_keels_log(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, log = tmp_path / "run.json", tmp_path / "fleet.jsonl"
    assert main(["sim", "--nodes", "16", "--days", "2", "--seed", "3", "--systems", "keel,conventional,oracle",
                 "--json", str(out), "--log", str(log), "--verify"]) == 0
    printed = capsys.readouterr().out
    run = json.loads(out.read_text())
    assert list(run["systems"]) == ["keel", "conventional", "oracle"] and run["gpus"] == 128 and run["seed"] == 3
    for system, summary in run["systems"].items():
        assert 0 < summary["ettr"] <= 1 and f"{system} " in printed
    # The oracle (infinite standbys, no detection time) bounds everything else from above.
    assert run["systems"]["oracle"]["ettr"] >= max(s["ettr"] for s in run["systems"].values())
    events = [REGISTRY.parse_envelope(json.loads(line)) for line in log.read_text().splitlines()]
    assert {e.producer for e in events} >= {"controller", "agent"} and len(events) > 10
    [replayed] = [line for line in printed.splitlines() if line.startswith("replay of Keel's recorded log")]
    assert replayed.endswith("clean"), replayed


@pytest.mark.parametrize(("args", "said"), [
    (["--systems", "keel,nope"], "unknown system(s) nope"),
    (["--nodes", "0"], "--nodes must be at least 1"),
    (["--days", "0"], "--days must be above 0"),
    (["--mix", "/nonexistent/mix.yaml"], "cannot read it"),
])
def test_keel_sim_refuses_what_it_cannot_run_with_the_reason(args: list[str], said: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--nodes", "4", "--days", "1", *args]) == 2
    assert said in capsys.readouterr().err
