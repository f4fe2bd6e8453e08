"""``keel.workload.train --save-on-sigterm``: the deploy a careful operator does with torchrun tooling
(bench/hot_update.py's primary requeue baseline). SIGTERM makes the run persist the step it is at and
exit cleanly; the next run resumes from exactly that step, with nothing to recompute."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

_STEP = re.compile(r"^step (\d+) ", re.MULTILINE)


def _train(persist_dir: Path, *extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_") and k not in ("RANK", "WORLD_SIZE")}
    return subprocess.Popen([sys.executable, "-m", "keel.workload.train", "--min-step-time", "100ms",
                             "--persist-dir", str(persist_dir), *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_sigterm_saves_the_step_the_run_is_at_and_the_next_run_resumes_from_it(tmp_path: Path) -> None:
    run = _train(tmp_path, "--steps", "100000", "--save-on-sigterm")
    assert run.stdout is not None
    seen = []
    for line in run.stdout:
        seen.append(line)
        if line.startswith("step 3 "):
            run.send_signal(signal.SIGTERM)
            break
    rest, _ = run.communicate(timeout=60)
    out = "".join(seen) + rest
    assert run.returncode == 0, out[-2000:]
    saved = re.search(r"^keel\.workload: saved step (\d+) on SIGTERM t_unix [0-9.]+$", out, re.MULTILINE)
    assert saved, out[-2000:]
    step = int(saved.group(1))
    assert step == max(int(s) for s in _STEP.findall(out)) and step >= 3  # the last step done, none after it
    assert "done steps" not in out

    resumed, _ = _train(tmp_path, "--steps", str(step + 3)).communicate(timeout=120)
    assert f"keel.workload: restored step {step} from" in resumed, resumed[-2000:]
    assert [int(s) for s in _STEP.findall(resumed)] == [step + 1, step + 2]


def test_save_on_sigterm_needs_a_persist_dir() -> None:
    done = subprocess.run([sys.executable, "-m", "keel.workload.train", "--save-on-sigterm"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--save-on-sigterm needs --persist-dir" in done.stderr
