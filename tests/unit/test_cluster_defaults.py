"""Defaults a new user meets: `keel up`, then `keel cluster up` with nothing configured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import keel.cluster.local as local
from keel.checkpoint_broker.adapter import CheckpointBroker
from keel.infra.config import Settings


def test_the_agents_persist_shards_where_the_broker_writes_manifests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The agents' processes are not the point here (the scenarios start real ones): only which folder
    # each side is given. A sleeping child stands in for each agent and is reaped below.
    started: list[subprocess.Popen] = []

    def spawn(argv: list[str], env: dict[str, str], agent_dir: Path) -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]))
        started[-1].argv = argv  # type: ignore[attr-defined]
        return started[-1]

    monkeypatch.setattr(local, "spawn_agent", spawn)
    settings = Settings(home=tmp_path / "home")
    try:
        state = local.cluster_up(settings, tmp_path / "home" / "cluster", nodes=2, standby=0, nproc_per_node=1,
                                 job_id="j", command=["-m", "keel.workload.train"], nats_url=None)
    finally:
        for process in started:
            process.kill()
            process.wait()
    broker = CheckpointBroker(object(), None, settings)  # type: ignore[arg-type]
    assert Path(state["persist_root"]) == broker.persist_root == tmp_path / "home" / "checkpoints"
    for process in started:
        argv = process.argv  # type: ignore[attr-defined]
        assert argv[argv.index("--keel-persist-root") + 1] == str(broker.persist_root)
