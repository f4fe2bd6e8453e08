"""Factories shared by tests and benchmarks: events, and damage done to files."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

from keel.events.envelope import Event
from keel.events.types import NodeHealthChanged, NodeRegistered

T0 = datetime(2026, 11, 29, 7, 0, tzinfo=UTC)


def health_event(node: str, *, job: str = "job1", status: str = "degraded", fatal: bool = False,
                 confidence: str = "low", component: str = "host", at: datetime = T0, detail: str = "") -> Event:
    return Event.create(
        NodeHealthChanged(node_id=node, status=status, component=component, check="psi_memory",  # type: ignore[arg-type]
                          confidence=confidence, is_fatal=fatal, detail=detail),  # type: ignore[arg-type]
        job_id=job, subject=f"node/{node}", producer="inspector", occurred_at=at,
    )


def fleet_events(count: int, *, job: str = "job1", nodes: int = 1200) -> list[Event]:
    """``count`` realistic, non-fatal events from a fleet: registrations, then health flaps."""
    events = []
    for index in range(count):
        node = f"n{index % nodes:04d}"
        at = T0 + timedelta(milliseconds=index)
        if index < nodes:
            events.append(Event.create(NodeRegistered(node_id=node, host=f"host-{node}"), job_id=job,
                                       subject=f"node/{node}", producer="agent", occurred_at=at))
        else:
            status = "degraded" if index % 2 else "healthy"
            events.append(health_event(node, job=job, status=status, at=at, detail=f"sample {index}"))
    return events


def flip_byte(path: Path, offset: int) -> None:
    """Invert every bit of the byte at ``offset`` of ``path`` in place (a corrupted checkpoint byte)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


# -- training jobs launched as process groups (tests/integration/test_checkpointer.py, test_fsdp_checkpoint.py) --

STEP_LINE = re.compile(r"^step (\d+) loss \S+ .*loss_hex (\S+)", re.M)
"""A workload's step line (``keel.workload.train`` and ``keel.workload.fsdp`` print the same)."""


def kill_ranks(procs: list[subprocess.Popen[str]]) -> None:
    """SIGKILL each rank's whole process group (started with ``start_new_session``) and reap it."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(10)


def finish_ranks(procs: list[subprocess.Popen[str]], timeout_s: float = 90) -> str:
    """Wait for every rank; assert they all exited 0; rank 0's output (its stdout is a pipe)."""
    try:
        out, _ = procs[0].communicate(timeout=timeout_s)
        for p in procs[1:]:
            p.wait(timeout_s)
    finally:
        kill_ranks(procs)
    assert all(p.returncode == 0 for p in procs), out[-3000:]
    return out


def step_losses(*outputs: str) -> dict[int, str]:
    """Step -> loss (hex) from workload outputs; a later output's line for a step wins."""
    losses: dict[int, str] = {}
    for out in outputs:
        losses.update({int(s): loss for s, loss in STEP_LINE.findall(out)})
    return losses
