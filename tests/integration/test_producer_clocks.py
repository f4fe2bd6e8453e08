"""Producer clocks (issue 14): real NATS, PostgreSQL, recorder and controller, and real ``keel run`` agent
processes whose clocks run 10 minutes ahead and 10 minutes behind (the agent's fault hook
``KEEL_FAULT_CLOCK_OFFSET``). Nobody is evicted while they heartbeat, each skew is reported once
(``NodeClockSkewed``), a node that really goes silent (SIGKILLed, agent and ranks) is still evicted, the
skewed agents judge commands' expiries on the controller's clock (the skew it reported to them), and the
recorded log replays to the same decisions (``keel replay --verify``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from keel.agent.clock import CLOCK_OFFSET_ENV
from keel.cluster.local import ranks_of, rendezvous_base_port, seed_overlay_root, spawn_agent
from keel.controller.adapter import Controller, decider_from_settings
from keel.events.envelope import Event, now_utc
from keel.events.types import RanksRestartRequested
from keel.infra.config import ControllerSettings
from keel.kernel.replay import verify
from tests.integration.test_crashes import service_env, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOB = "skewed"
OFFSETS = {"n00": "+10m", "n01": "-10m", "n02": "0s"}
SILENCE_S = 10.0


def kill_agent_and_ranks(process: subprocess.Popen, agent_dir: Path) -> None:
    """Lose the node: SIGKILL its agent's session and every rank and zygote of it (forked ranks lead process
    groups of their own, so killing the agent's group alone would leave them running)."""
    for pid in [process.pid, *ranks_of(agent_dir, zygotes=True)]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if process.poll() is None:
        process.wait(timeout=10)


@pytest.fixture
def agents(scratch_dir: Path) -> Iterator[dict[str, subprocess.Popen]]:
    started: dict[str, subprocess.Popen] = {}
    yield started
    for node_id, process in started.items():
        kill_agent_and_ranks(process, scratch_dir / node_id)
    deadline = time.monotonic() + 10  # a SIGKILLed process lingers until the kernel has torn it down
    while (leftovers := [pid for node_id in started for pid in ranks_of(scratch_dir / node_id, zygotes=True)]):
        assert time.monotonic() < deadline, f"processes of the agents still running: {leftovers}"
        time.sleep(0.1)


def start_agents(settings, scratch: Path, started: dict[str, subprocess.Popen]) -> None:  # type: ignore[no-untyped-def]
    script = scratch / "sleeper.py"
    script.write_text("import time\ntime.sleep(600)\n")
    port = rendezvous_base_port()
    for index, (node_id, offset) in enumerate(OFFSETS.items()):
        agent_dir = scratch / node_id
        root = agent_dir / "root"
        seed_overlay_root(root, gpus=1)
        argv = [sys.executable, "-m", "keel.cli.main", "run", "--nnodes", str(len(OFFSETS)), "--nproc-per-node", "1",
                "--node-rank", str(index), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--keel-job-id", JOB, "--keel-node-id", node_id, "--keel-agent-dir", str(agent_dir),
                "--keel-root", str(root), "--keel-heartbeat-interval", "1s", str(script)]
        env = {**service_env(settings), CLOCK_OFFSET_ENV: offset}
        started[node_id] = spawn_agent(argv, env, agent_dir)


async def test_agents_ten_minutes_off_are_not_evicted_and_a_silent_one_is(keel_env, agents, scratch_dir: Path) -> None:
    settings = keel_env.settings.model_copy(update={"controller": ControllerSettings(
        node_silence_timeout=f"{SILENCE_S:g}s", clock_skew_allowance="2s", clock_interval="1s")})  # type: ignore[arg-type]
    await keel_env.start_recorder()
    controller = Controller(keel_env.bus, keel_env.store, settings)
    await controller.start()
    stop = asyncio.Event()
    keel_env.stops.append(stop)
    keel_env.tasks.append(asyncio.create_task(controller.run(stop)))

    async def log() -> list[Event]:
        return [r.event async for r in keel_env.store.read(job_id=JOB)]

    def of(events: list[Event], type_: str) -> list[Event]:
        return [e for e in events if e.type == type_]

    start_agents(settings, scratch_dir, agents)

    async def every_node_beats() -> bool:
        beats = of(await log(), "NodeHeartbeat")
        return {e.payload.node_id for e in beats} == set(OFFSETS) and len(of(await log(), "RankStarted")) == 3

    await wait_until(every_node_beats, 90, "a heartbeat and a rank start from every agent")
    events = await log()
    # The fault hook works: each agent stamps its events with its own clock.
    stamps = {e.payload.node_id: e.occurred_at for e in of(events, "NodeHeartbeat")}
    ticks = [e for e in events if e.type == "TimerTicked"]
    assert ticks and ticks[-1].payload.interval_s == 1.0
    assert stamps["n00"] - ticks[-1].payload.now > timedelta(minutes=9), stamps
    assert ticks[-1].payload.now - stamps["n01"] > timedelta(minutes=9), stamps

    # Three silence timeouts of heartbeats from clocks 10 minutes off: nobody is evicted.
    await asyncio.sleep(3 * SILENCE_S)
    events = await log()
    assert of(events, "NodeEvictionDecided") == [], [e.payload.reason for e in of(events, "NodeEvictionDecided")]
    assert of(events, "IncidentOpened") == [], [(e.payload.node_id, e.payload.reason) for e in of(events, "IncidentOpened")] + [(e.payload.node_id, e.payload.check, e.payload.detail) for e in of(events, "NodeHealthChanged")]
    skewed = [(e.payload.node_id, e.payload.skewed) for e in of(events, "NodeClockSkewed")]
    assert sorted(skewed) == [("n00", True), ("n01", True)], skewed  # once each, the honest node never
    by_node = {e.payload.node_id: e.payload.skew_s for e in of(events, "NodeClockSkewed")}
    # A lower bound of each offset, to the clock interval and the agents' publishing delay (a loaded machine).
    assert 570 < by_node["n00"] <= 601 and -630 <= by_node["n01"] < -590, by_node

    # `keel incidents` shows both clocks (reported, not acted on).
    shown = subprocess.run([sys.executable, "-m", "keel.cli.main", "incidents", "--job", JOB], env=service_env(settings),
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "keel: no incidents" in shown.stdout and "n00" in shown.stdout and "ahead" in shown.stdout \
        and "n01" in shown.stdout and "behind" in shown.stdout, shown.stdout

    # The honest node really goes silent (its agent and ranks killed): it alone is evicted.
    killed_at = asyncio.get_running_loop().time()
    kill_agent_and_ranks(agents["n02"], scratch_dir / "n02")

    async def evicted() -> bool:
        return bool(of(await log(), "NodeEvictionDecided"))

    await wait_until(evicted, SILENCE_S + 30, "the silent node's eviction")
    took = asyncio.get_running_loop().time() - killed_at
    events = await log()
    decided = of(events, "NodeEvictionDecided")
    assert [e.payload.node_id for e in decided] == ["n02"], [e.payload.reason for e in decided]
    assert SILENCE_S <= took, took
    [eviction] = decided
    assert "recorded clock" in eviction.payload.reason
    # The command expires a TTL after the tick it was decided on (not after a skewed node's stamp).
    assert eviction.payload.expires_at == eviction.occurred_at + settings.controller.command_ttl
    assert eviction.occurred_at in {t.payload.now for t in of(events, "TimerTicked")}

    # The skewed agents judge commands' expiries on the controller's clock (net of the skew it reported to
    # them): a fresh restart is carried out by the node 10 minutes ahead (its own clock says it expired
    # 9 minutes ago), one expired 30 s ago is refused by the node 10 minutes behind (its own clock says it
    # has 9.5 minutes left). The reported skew is good to about a clock interval.
    now = now_utc()
    fresh = Event.create(RanksRestartRequested(node_id="n00", generation=5, reason="test: fresh",
                                               expires_at=now + timedelta(minutes=1)),
                         job_id=JOB, subject="node/n00", producer="controller", occurred_at=now)
    stale = Event.create(RanksRestartRequested(node_id="n01", generation=5, reason="test: stale",
                                               expires_at=now - timedelta(seconds=30)),
                         job_id=JOB, subject="node/n01", producer="controller", occurred_at=now - timedelta(minutes=5))
    await keel_env.bus.publish_many([fresh, stale])

    async def answered() -> bool:
        return len(of(await log(), "RanksRestarted")) >= 2

    await wait_until(answered, 60, "both agents' answers to the restart commands")
    outcomes = {e.payload.node_id: e.payload.outcome for e in of(await log(), "RanksRestarted")}
    assert outcomes == {"n00": "restarted", "n01": "expired"}, outcomes

    # keel replay --verify: the recorded log gives the same decisions.
    events = await log()
    report = verify(decider_from_settings(settings), events)
    assert report.clean, report.details()
