"""The real workload under torchrun: 4 processes, DP=2 x PP=2 on gloo, tiny model.

The three runs (two identical, one with an injected crash) start together in one fixture: each is
mostly interpreter and ``import torch`` time, so running them side by side roughly halves the wall time.
The crashed run also saves a torchrun-style persistent checkpoint every 2 steps (``--persist-every``);
a fourth run resumes from it and must print the clean run's losses bitwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

_ARGS = ["--pp", "2", "--steps", "6", "--batch", "8", "--micro-batches", "2", "--lr", "1e-2", "--seed", "1"]
_STEP_LINE = re.compile(r"^step (\d+) loss (\S+) grad_norm (\S+)", re.MULTILINE)
_HEX_LINE = re.compile(r"^step (\d+) loss \S+ .*loss_hex (\S+) t_unix [0-9.]+$", re.MULTILINE)
_TIMEOUT_S = 240


@dataclass
class Run:
    returncode: int
    output: str

    def losses(self) -> list[tuple[str, str, str]]:
        return _STEP_LINE.findall(self.output)

    def loss_hex(self) -> dict[int, str]:
        return {int(step): h for step, h in _HEX_LINE.findall(self.output)}


def _torchrun(extra_env: dict[str, str], extra_args: list[str] | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(extra_env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "keel.workload.train", *_ARGS, *(extra_args or [])]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.fixture(scope="module")
def persist_dir() -> Iterator[Path]:
    scratch = Path(tempfile.mkdtemp(prefix="keel-wl-persist-", dir="/tmp"))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(persist_dir: Path) -> Iterator[dict[str, Run]]:
    scratch = Path(tempfile.mkdtemp(prefix="keel-wl-", dir="/tmp"))
    fault_file = scratch / "fault.json"
    fault_file.write_text(json.dumps({"id": "crash-1", "kind": "crash", "rank": 1, "params": {"at_step": 3}}))
    procs = {
        "a": _torchrun({}),
        "b": _torchrun({}),
        "crash": _torchrun({"KEEL_FAULT_FILE": str(fault_file)},
                           ["--persist-every", "2", "--persist-dir", str(persist_dir)]),
    }
    try:
        yield {name: _finish(p) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
        shutil.rmtree(scratch, ignore_errors=True)


def _finish(proc: subprocess.Popen[str]) -> Run:
    output, _ = proc.communicate(timeout=_TIMEOUT_S)
    return Run(proc.returncode, output)


def test_dp2_pp2_run_completes_and_learns(runs: dict[str, Run]) -> None:
    run = runs["a"]
    assert run.returncode == 0, run.output[-3000:]
    losses = [float(loss) for _, loss, _ in run.losses()]
    assert len(losses) == 6, run.output[-3000:]
    assert losses[-1] < losses[0] - 0.1
    assert "world 4 dp 2 pp 2" in run.output and "done steps 6" in run.output


def test_two_runs_print_identical_losses(runs: dict[str, Run]) -> None:
    assert runs["a"].losses() == runs["b"].losses() != []


def test_injected_crash_kills_the_job_with_a_recognisable_line(runs: dict[str, Run]) -> None:
    run = runs["crash"]
    assert run.returncode != 0
    assert "keel injected crash: fault crash-1 on rank 1 after step 2" in run.output
    assert "RuntimeError: keel injected crash" in run.output
    # Steps before the fault are the same computation as the clean run.
    assert run.losses()[:3] == runs["a"].losses()[:3] and len(run.losses()) <= 3


def test_a_restarted_run_resumes_from_the_persisted_checkpoint_bitwise(runs: dict[str, Run], persist_dir: Path) -> None:
    crashed = runs["crash"]
    # Steps 1 and 3 are persisted (every 2 steps); the crash after step 2 leaves step 1 as the newest.
    assert re.search(r"^persist step 1 save_s [0-9.]+ t_unix", crashed.output, re.M), crashed.output[-3000:]
    assert sorted(p.name for p in persist_dir.iterdir()) == ["step-000000001"]
    assert len(list((persist_dir / "step-000000001").glob("rank-*.shard"))) == 4
    resumed = _finish(_torchrun({}, ["--persist-every", "2", "--persist-dir", str(persist_dir)]))
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "keel.workload: restored step 1 from shard " in resumed.output, resumed.output[-3000:]
    clean = runs["a"].loss_hex()
    assert sorted(clean) == list(range(6))
    assert resumed.loss_hex() == {s: h for s, h in clean.items() if s >= 2}
    # It persisted steps 3 and 5 and keeps each rank's two newest files.
    assert all(sorted(p.name for p in (persist_dir / f"step-00000000{s}").iterdir()) == [f"rank-0000{r}.shard" for r in range(4)]
               for s in (3, 5))
    assert not list((persist_dir / "step-000000001").glob("*.shard"))
