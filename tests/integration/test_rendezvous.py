"""`keel run --rdzv-backend c10d` without --node-rank: real agents on this host (each its own agent folder)
rendezvous at a TCP store, get distinct node ranks, and their gloo ranks see one world of the admitted
size. Also: --nnodes 1:2 with one agent starts after the last call, and two standalone `keel run`s on one
host at once both succeed (each its own port, agent folder and slot folder)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.infra.embedded import free_port

pytestmark = pytest.mark.integration

PROBE = Path(__file__).resolve().parents[1] / "fixtures" / "rendezvous" / "probe.py"
def fast(last_call_s: int) -> str:
    return f"last_call_timeout={last_call_s},join_timeout=150,close_timeout=20,read_timeout=20"


def env_for(scratch: Path) -> dict[str, str]:
    """No control plane (no NATS, a home without `keel up`): torchrun's behaviour; TMPDIR inside the test."""
    (scratch / "tmp").mkdir(exist_ok=True)
    return {k: v for k, v in os.environ.items() if k != "KEEL_NATS_URL"} | {
        "KEEL_HOME": str(scratch / "home"), "TMPDIR": str(scratch / "tmp")}


def start_agents(scratch: Path, count: int, nnodes: str, port: int, rdzv_id: str,
                 last_call_s: int) -> tuple[list[subprocess.Popen], Path]:
    out = scratch / f"out-{rdzv_id}"
    out.mkdir()
    agents = []
    for index in range(count):
        argv = [sys.executable, "-m", "keel.cli.main", "run", "--nnodes", nnodes, "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
                "--rdzv-conf", fast(last_call_s), "--keel-node-id", f"node-{index}", "--keel-agent-dir", str(scratch / f"{rdzv_id}-{index}"),
                "--keel-no-checkpoint", "--keel-no-warm-ranks", str(PROBE), str(out)]
        log = open(scratch / f"{rdzv_id}-{index}.log", "wb")  # noqa: SIM115 - closed with the process
        agents.append(subprocess.Popen(argv, env=env_for(scratch), stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL))
    return agents, out


def wait_all(agents: list[subprocess.Popen], scratch: Path, rdzv_id: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for index, agent in enumerate(agents):
            code = agent.wait(max(1.0, deadline - time.monotonic()))
            assert code == 0, (index, code, (scratch / f"{rdzv_id}-{index}.log").read_text()[-3000:])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)


def read_ranks(out: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


@pytest.mark.parametrize("count", [2, 3])
def test_agents_without_node_rank_get_distinct_ranks_from_a_c10d_rendezvous(scratch_dir: Path, count: int) -> None:
    port = free_port()
    # Three: MAX closes the round as the third joins (a long last call never waits); two: the last call does.
    agents, out = start_agents(scratch_dir, count, "2:3", port, f"job{count}", last_call_s=20 if count == 3 else 2)
    wait_all(agents, scratch_dir, f"job{count}")
    seen = read_ranks(out)
    assert sorted(s["rank"] for s in seen) == list(range(count)), seen
    assert {s["world"] for s in seen} == {count} and {s["env"]["WORLD_SIZE"] for s in seen} == {str(count)}
    # Node ranks follow the node ids (node-0 -> 0, ...), one per node, and every rank saw the same world.
    assert all(s["env"]["GROUP_RANK"] == s["env"]["KEEL_NODE_ID"].split("-")[1] for s in seen), seen
    assert all(s["gathered"] == [[r, r] for r in range(count)] for s in seen), seen
    # The ranks' store is rank 0's, on its own port, clear of the rendezvous store's.
    masters = {(s["env"]["MASTER_ADDR"], s["env"]["MASTER_PORT"]) for s in seen}
    assert len(masters) == 1 and abs(int(next(iter(masters))[1]) - port) > 1000, (masters, port)
    # Recorded while the agent ran, removed when it ended by itself; the rendezvous store no longer listens.
    assert not (scratch_dir / f"job{count}-0" / "rendezvous.json").exists()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_one_to_two_nodes_with_one_agent_starts_after_the_last_call(scratch_dir: Path) -> None:
    started = time.monotonic()
    agents, out = start_agents(scratch_dir, 1, "1:2", free_port(), "solo", last_call_s=1)
    wait_all(agents, scratch_dir, "solo", timeout_s=140)
    seen = read_ranks(out)
    assert [(s["rank"], s["world"]) for s in seen] == [(0, 1)], seen
    log = (scratch_dir / "solo-0.log").read_text()
    assert "node rank 0 of 1" in log, log[-2000:]
    assert time.monotonic() - started < 140  # not join_timeout (150 s) and more: the last call (1 s) closed it


def test_two_standalone_keel_runs_on_one_host_at_once_both_succeed(scratch_dir: Path) -> None:
    env = env_for(scratch_dir)
    runs = []
    for name in ("first", "second"):
        (scratch_dir / name).mkdir()
        argv = [sys.executable, "-m", "keel.cli.main", "run", "--standalone", "--nproc-per-node", "2",
                "--keel-no-warm-ranks", str(PROBE), str(scratch_dir / name), "4"]
        log = open(scratch_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        runs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    for name, run in zip(("first", "second"), runs, strict=True):
        try:
            assert run.wait(150) == 0, (scratch_dir / f"{name}.log").read_text()[-3000:]
        finally:
            if run.poll() is None:
                run.kill()
    firsts, seconds = read_ranks(scratch_dir / "first"), read_ranks(scratch_dir / "second")
    assert len(firsts) == len(seconds) == 2
    ports = {s["env"]["MASTER_PORT"] for s in firsts}, {s["env"]["MASTER_PORT"] for s in seconds}
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1]
    # Each its own agent folder: the default one, and the next of its series while the first was held.
    folders = sorted(p.name for p in (scratch_dir / "tmp").iterdir() if p.name.startswith("keel-agent-"))
    assert folders == [f"keel-agent-{socket.gethostname()}-job", f"keel-agent-{socket.gethostname()}-job-2"], folders


def test_a_standby_watches_the_rendezvous_and_learns_the_world_without_a_rank(scratch_dir: Path) -> None:
    port = free_port()
    out = scratch_dir / "out-withstandby"  # start_agents' folder for this rendezvous id
    argv = [sys.executable, "-m", "keel.cli.main", "run", "--nnodes", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "withstandby", "--rdzv-conf", fast(20),
            "--keel-node-id", "spare", "--keel-agent-dir", str(scratch_dir / "spare"), "--keel-standby",
            "--keel-no-checkpoint", "--keel-no-warm-ranks", str(PROBE), str(out)]
    log = scratch_dir / "spare.log"
    # The standby comes first and is watching before the nodes join: one that comes after the round closed
    # finds nobody listening (the host stops once every node read its rank) and waits for the next start.
    with open(log, "wb") as sink:
        standby = subprocess.Popen(argv, env=env_for(scratch_dir), stdout=sink, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while "hosting the rendezvous store" not in log.read_text():
            assert time.monotonic() < deadline and standby.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        agents, agents_out = start_agents(scratch_dir, 2, "2", port, "withstandby", last_call_s=20)
        assert agents_out == out
        wait_all(agents, scratch_dir, "withstandby")
        assert sorted(s["rank"] for s in read_ranks(out)) == [0, 1]  # the standby took no rank
        deadline = time.monotonic() + 60
        while "node rank - (standby) of 2" not in log.read_text():
            assert time.monotonic() < deadline and standby.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        standby.terminate()
        standby.wait(30)
