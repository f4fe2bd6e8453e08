"""A job without the SDK, end to end with real processes: a plain torch.distributed gloo script
(tests/fixtures/nosdk_train.py, never imports keel) on a local cluster of two nodes, the controller,
checkpoint broker, analyzer and actuator as services. One rank is SIGKILLed; the controller restarts the
job; the incident is resolved on process liveness (every rank of the new generation running for the
settle interval) and `keel ettr` accounts for the outage only, labelled process-level.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from keel.events.envelope import Event
from tests.integration.test_crashes import service_env
from tests.scenarios import test_ladder
from tests.scenarios.test_ladder import Stack

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "nosdk_train.py"
SETTLE_S = 3.0
stack = test_ladder.stack
"""The ladder scenarios' fixture: the control plane as services, the session's recorder, a cluster."""


def running_without_sdk(generation: int) -> Callable[[Event], bool]:
    return lambda e: (not e.payload.standby and e.payload.generation == generation and e.payload.ranks_alive == 1
                      and e.payload.ranks_reporting == 0 and e.payload.last_step == -1)


def keel_ettr(stack: Stack) -> dict:
    out = subprocess.run([sys.executable, "-m", "keel.cli.main", "ettr", "--job", stack.job, "--json"],
                         env={**service_env(stack.settings), **stack.knobs}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    [job] = json.loads(out.stdout)["jobs"]
    return job


async def test_a_job_without_the_sdk_is_resolved_on_process_liveness_and_its_ettr_is_process_level(stack: Stack) -> None:
    started_at = time.monotonic()
    stack.start(nodes=2, standby=0, command=[str(SCRIPT), "--step-time", "0.05"],
                extra={"KEEL_CONTROLLER__PROCESS_SETTLE_INTERVAL": f"{SETTLE_S:g}s"})
    for node in ("n00", "n01"):
        await stack.wait_for(["NodeHeartbeat"], lambda e, n=node: e.payload.node_id == n and running_without_sdk(0)(e),
                             60, f"{node} running generation 0 without the SDK")
    await asyncio.sleep(2)  # productive time before the fault
    victim = next(e for e in await stack.events(["RankStarted"]) if e.payload.rank == 1 and e.payload.generation == 0)
    killed_at = time.monotonic()
    os.kill(victim.payload.pid, signal.SIGKILL)

    opened = await stack.wait_for(["IncidentOpened"], lambda e: True, 30, "an incident")
    resolved = await stack.wait_for(["IncidentResolved"], lambda e: e.payload.incident_id == str(opened.id), 90,
                                    "the incident resolved")
    outage_s = time.monotonic() - killed_at
    assert resolved.payload.outcome == "recovered", resolved.payload.reason
    assert resolved.payload.measure == "process", resolved.payload
    assert "Process-level" in resolved.payload.reason and "hangs" in resolved.payload.reason
    generation = resolved.payload.generation
    assert generation >= 1
    # Resolved only after the settle interval: the new generation's last rank started at least that long before.
    restarted = [e for e in await stack.events(["RankStarted"]) if e.payload.generation == generation]
    assert len({e.payload.rank for e in restarted}) == 2
    assert (resolved.occurred_at - max(e.occurred_at for e in restarted)).total_seconds() >= SETTLE_S

    await asyncio.sleep(4)  # the restarted job runs on: productive time again
    await stack.stop_and_verify()

    job = keel_ettr(stack)
    cumulative = job["cumulative"]
    assert job["measure"] == cumulative["measure"] == "process" and "coarser" in job["note"]
    [incident] = cumulative["incidents"]
    assert incident["recovered"] and incident["measure"] == "process", incident
    lost, wall = incident["lost_s"], cumulative["wall_s"]
    # The lost time ends when the new generation's last rank started (before the controller's settle).
    assert 0 < lost <= outage_s, (lost, outage_s)
    assert incident["marks"]["recovered"] == max(e.occurred_at for e in restarted).isoformat()
    assert cumulative["ettr"] == pytest.approx(1 - lost / wall, abs=1e-6)
    # Not the whole job lost (before: the incident never closed and ETTR charged it to the end of the log).
    assert wall - lost >= 10 and cumulative["ettr"] > 0.5, cumulative
    print(f"no-SDK scenario: lost {lost:.2f} s of {wall:.1f} s (ETTR {100 * cumulative['ettr']:.1f} %), outage "
          f"to resolution {outage_s:.1f} s, whole test {time.monotonic() - started_at:.0f} s")
