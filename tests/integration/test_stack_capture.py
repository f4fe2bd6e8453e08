"""Stack capture with real processes and real py-spy: a rank and its dataloader-like child are dumped
without being stopped, frames come outermost first, and what cannot be seen is reported as missing."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.agent.stack_capture import capture_ranks, process_tree, split_parts
from keel.events.types import CapturedProcess, CapturedThread

pytestmark = pytest.mark.integration

PROGRAM = """\
import multiprocessing, os, sys, time

def stuck_in_a_pipeline_stage():
    time.sleep(120)

def worker_loop_of_a_loader():
    time.sleep(120)

if __name__ == "__main__":
    child = multiprocessing.get_context("fork").Process(target=worker_loop_of_a_loader)
    child.start()
    print(child.pid, flush=True)
    stuck_in_a_pipeline_stage()
"""


def test_a_rank_and_its_child_are_captured_and_the_rest_is_missing_evidence(scratch_dir: Path) -> None:
    script = scratch_dir / "rank.py"
    script.write_text(PROGRAM)
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    vanished = subprocess.Popen([sys.executable, "-c", "pass"])
    vanished.wait()
    try:
        assert rank.stdout is not None
        child_pid = int(rank.stdout.readline())
        time.sleep(0.5)  # both in their sleeps
        assert process_tree(rank.pid) == [(rank.pid, None), (child_pid, rank.pid)]
        capture = capture_ranks({0: rank.pid, 1: None, 2: vanished.pid})
        by_pid = {p.pid: p for p in capture.processes}
        assert set(by_pid) == {rank.pid, child_pid}, capture.missing
        main = by_pid[rank.pid]
        assert main.rank == 0 and main.role == "rank" and main.parent_pid is None
        frames = main.threads[0].frames
        assert frames[0].startswith("<module> (rank.py:") and frames[-1].startswith("stuck_in_a_pipeline_stage (rank.py:")
        child = by_pid[child_pid]
        assert child.rank == 0 and child.parent_pid == rank.pid
        assert any("worker_loop_of_a_loader" in f for t in child.threads for f in t.frames)
        assert rank.poll() is None, "capturing must not stop the rank"
        by_rank = {m.rank: m for m in capture.missing}
        assert set(by_rank) == {1, 2}, capture.missing
        assert by_rank[1].pid is None and by_rank[1].role == "rank" and by_rank[1].reason == "no process on this node"
        assert by_rank[2].pid == vanished.pid and by_rank[2].role == "rank" and "vanished" in by_rank[2].reason
    finally:
        rank.kill()
        rank.wait()


def test_large_captures_are_split_into_parts_under_the_event_size_and_nothing_is_dropped() -> None:
    frames = [f"function_{i} (module_{i}.py:{i})" for i in range(200)]
    processes = [CapturedProcess(pid=i, rank=i, threads=[CapturedThread(frames=frames)]) for i in range(50)]
    parts = split_parts(processes, max_bytes=40_000)
    assert len(parts) > 1 and sum(len(p) for p in parts) == 50
    assert all(sum(len(p.model_dump_json()) for p in part) <= 40_000 for part in parts)
    [alone] = split_parts([processes[0]], max_bytes=2_000)
    kept = alone[0].threads[0].frames
    assert kept[0] == "[... outer frames cut to fit the event]" and kept[-1] == frames[-1]
    assert len(alone[0].model_dump_json()) <= 2_000
