"""The detection benchmark's peers: plain ``torchrun`` and NVIDIA resiliency-ext's ``ft_launcher``.

Both run the same workload as the Keel cluster (``bench._workload``: the example GPT, 8 ranks, PP 2,
eval and checkpoint phases) in **one launcher process for all 8 ranks** (``--standalone --nnodes 1
--nproc-per-node 8``: four launchers with a static rendezvous would only add four more agent
processes to two cores, and detection of a local worker's exit does not depend on it). Workload faults
are injected exactly as in the Keel cluster: by writing the SDK's fault file (``KEEL_FAULT_FILE``),
which the ranks read without an agent.

Detection of a crash = the first line the *launcher* (not a worker) writes about the failed worker
(``Sending process … closing signal``, ``failed (exitcode: …)``, ``ChildFailedError``, …), each
output line timestamped on arrival, minus the time the fault file was written.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Lines only the elastic agent (torchrun / ft_launcher) writes once it has noticed a failed worker.
AGENT_FAILURE = re.compile(
    r"closing signal|failed \(exitcode|ChildFailedError|Worker group FAILED|worker group .*failed|"
    r"Rank monitor .*(detected|terminat)|FT:.*(fail|terminat|hang)",
    re.IGNORECASE,
)
STEP_LINE = re.compile(r"^step (\d+) ")


def ft_available() -> tuple[bool, str]:
    """Whether nvidia-resiliency-ext imports here; the reason when it does not."""
    try:
        import importlib.metadata

        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # noqa: F401

        return True, importlib.metadata.version("nvidia-resiliency-ext")
    except Exception as exc:  # noqa: BLE001 - any import failure means: peer unavailable
        return False, f"{type(exc).__name__}: {exc}"


def ft_default_timeouts() -> dict[str, float | None]:
    from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig

    cfg = FaultToleranceConfig()
    return {
        "initial_rank_heartbeat_timeout_s": cfg.initial_rank_heartbeat_timeout,
        "rank_heartbeat_timeout_s": cfg.rank_heartbeat_timeout,
        "workload_check_interval_s": cfg.workload_check_interval,
        "node_health_check_interval_s": cfg.node_health_check_interval,
    }


def gloo_default_timeout_s() -> float:
    from torch.distributed.constants import default_pg_timeout

    return default_pg_timeout.total_seconds()


@dataclass
class Launcher:
    """One launcher process and its timestamped output lines."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    lines: list[tuple[float, str]] = field(default_factory=list)
    process: subprocess.Popen | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        with open(self.log_path, "a", encoding="utf-8") as log:
            for raw in iter(self.process.stdout.readline, b""):
                now = time.time()
                text = raw.decode(errors="replace").rstrip("\n")
                with self._lock:
                    self.lines.append((now, text))
                log.write(f"{now:.3f} {text}\n")
                log.flush()

    def snapshot(self) -> list[tuple[float, str]]:
        with self._lock:
            return list(self.lines)

    def last_step(self) -> tuple[int, float] | None:
        for at, text in reversed(self.snapshot()):
            match = STEP_LINE.match(text)
            if match:
                return int(match.group(1)), at
        return None

    def stop(self) -> None:
        """SIGTERM the launcher's process group (it and the workers it started), SIGKILL after 10 s."""
        if self.process is None:
            return
        pgid = self.process.pid
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait_s)
                # the launcher is gone; its workers share its process group
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            except subprocess.TimeoutExpired:
                continue


def steady_point(launcher: Launcher, eval_every: int, ckpt_every: int, min_step: int, timeout_s: float) -> int:
    """Wait until rank 0 has just finished a step ``>= min_step`` that is at least 3 steps away from an
    eval or a checkpoint (so that an injected fault fires at the very next step boundary). Returns it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        last = launcher.last_step()
        if last is not None:
            step, at = last
            if step >= min_step and time.time() - at < 0.3 and _far_from_phase(step, eval_every, ckpt_every):
                return step
        if launcher.process is not None and launcher.process.poll() is not None:
            raise RuntimeError(f"launcher exited with {launcher.process.returncode} before training was steady; "
                               f"see {launcher.log_path}")
        time.sleep(0.02)
    raise TimeoutError(f"no steady training step within {timeout_s:.0f}s; see {launcher.log_path}")


def _far_from_phase(step: int, eval_every: int, ckpt_every: int, margin: int = 3) -> bool:
    for every in (eval_every, ckpt_every):
        if every and (every - (step + 1) % every) % every < margin:
            return False
    return True


def write_fault(path: Path, kind: str, rank: int | None, params: dict[str, Any] | None = None) -> tuple[str, float]:
    fault_id = str(uuid.uuid4())
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"id": fault_id, "kind": kind, "rank": rank, "params": params or {}}))
    at = time.time()
    os.replace(tmp, path)
    return fault_id, at


def measure_crash(name: str, argv: list[str], env: dict[str, str], work: Path, kind: str, rank: int,
                  eval_every: int, ckpt_every: int, at_step_ahead: int = 2, start_timeout_s: float = 150.0,
                  detect_timeout_s: float = 60.0, min_step: int = 5) -> dict[str, Any]:
    """Start the launcher, wait for steady training (rank 0 past ``min_step``), inject ``kind`` into
    ``rank``, time the launcher."""
    fault_file = work / f"{name}-fault.json"
    fault_file.unlink(missing_ok=True)
    launcher = Launcher(argv, {**env, "KEEL_FAULT_FILE": str(fault_file)}, work / f"{name}.log")
    t_start = time.monotonic()
    launcher.start()
    try:
        step = steady_point(launcher, eval_every, ckpt_every, min_step=min_step, timeout_s=start_timeout_s)
        startup_s = time.monotonic() - t_start
        fault_id, injected_at = write_fault(fault_file, kind, rank, {"at_step": step + at_step_ahead})
        deadline = time.monotonic() + detect_timeout_s
        while time.monotonic() < deadline:
            for at, text in launcher.snapshot():
                if at >= injected_at and AGENT_FAILURE.search(text):
                    return {"detect_s": round(at - injected_at, 3), "line": text.strip()[-300:], "injected_after_step": step,
                            "startup_s": round(startup_s, 1)}
            if launcher.process is not None and launcher.process.poll() is not None:
                time.sleep(0.2)  # let the pump read what is left
                for at, text in launcher.snapshot():
                    if at >= injected_at and AGENT_FAILURE.search(text):
                        return {"detect_s": round(at - injected_at, 3), "line": text.strip()[-300:],
                                "injected_after_step": step, "startup_s": round(startup_s, 1)}
                return {"detect_s": round(time.time() - injected_at, 3), "line": f"launcher exited {launcher.process.returncode}",
                        "injected_after_step": step, "startup_s": round(startup_s, 1)}
            time.sleep(0.02)
        return {"detect_s": None, "error": f"not detected within {detect_timeout_s:.0f}s", "injected_after_step": step}
    finally:
        launcher.stop()


def launcher_argv(name: str, workload_args: list[str], wrapper_args: list[str]) -> list[str]:
    common = ["--standalone", "--nnodes", "1", "--nproc-per-node", "8", "-m", "bench._workload", *wrapper_args, "--",
              *workload_args]
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *common]
    ft = Path(sys.executable).with_name("ft_launcher")
    return [str(ft) if ft.exists() else "ft_launcher", *common]
