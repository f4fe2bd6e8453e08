"""Every system on the same trace, in one run: Keel and its ablations (the real controller), the baselines
(cost models), with ETTR, the worst 1-hour window and lost time for each (pure but for the wall clock
reading that times the simulation, and the worker processes ``run_many`` may fork).

``run_many`` runs several seeds and failure-rate factors at once, each system of each run in its own task,
over ``jobs`` worker processes: the systems of a run share nothing but the trace, which each task draws again
from the seed (the same trace: generation is deterministic). A forked child inherits its task and writes its
result as JSON text into a file of its own: nothing crosses between processes as pickle.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from keel.sim.baselines import BASELINES, baseline_losses
from keel.sim.config import Calibration, FailureMix
from keel.sim.engine import VARIANTS, KeelSim
from keel.sim.metrics import summarise
from keel.sim.trace import Trace, generate

SYSTEMS = (*VARIANTS, *BASELINES)
COST_ORDER = ("keel_no_memory_ckpt", "keel_no_analyzer", "keel", "keel_no_hot_update", "keel_no_standby")
"""The Keel variants, slowest to simulate first (a long restore ticks every machine's heartbeat through it):
handed out in this order, the workers finish together."""


def _check(systems: tuple[str, ...]) -> None:
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")


def _header(mix: FailureMix, trace: Trace, *, nodes: int, days: float, seed: int) -> dict[str, Any]:
    return {"seed": seed, "nodes": nodes, "days": days, "failures": len(trace.failures),
            "failures_by_kind": {k.name: trace.count(k.name) for k in mix.kinds},
            "code_changes": len(trace.code_changes_s), "systems": {}}


def run_system(system: str, trace: Trace, cal: Calibration, *, seed: int) -> dict[str, Any]:
    """One system over ``trace``: its summary (JSON-ready), with the wall and CPU time its simulation took (on a
    shared machine the CPU time is the steadier measure of its cost)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    extra: dict[str, Any] = {}
    if system in VARIANTS:
        result = KeelSim(trace, cal, variant=VARIANTS[system], seed=seed).run()
        losses = result.losses
        extra = {"incidents_by_rung": result.incidents_by_rung, "evicted_nodes": result.evicted_nodes,
                 "over_evicted_nodes": result.over_evicted_nodes, "standbys_promoted": result.standbys_promoted,
                 "standbys_provisioned": result.standbys_provisioned, "job_stops": result.job_stops,
                 "events": result.events, "decisions": result.decisions}
    else:
        losses = baseline_losses(system, trace, cal, seed=seed)
    summary = asdict(summarise(losses, trace.horizon_s))
    return {**summary, **extra, "sim_wall_s": round(time.perf_counter() - started, 3),
            "sim_cpu_s": round(time.process_time() - cpu_started, 3)}


def run_all(mix: FailureMix, cal: Calibration, *, nodes: int, days: float, seed: int,
            systems: tuple[str, ...] = SYSTEMS, jobs: int = 1) -> dict[str, Any]:
    """One seed: a trace, then every system in ``systems`` over it. Returns a JSON-ready dict."""
    return run_many(mix, cal, nodes=nodes, days=days, runs=[(seed, 1.0, systems)], jobs=jobs)[0]


_WORK: dict[str, Any] = {}
"""What the forked workers read: the mix, the calibration and the run's shape (set before the children fork)."""


def _in_children(tasks: list[tuple[int, float, str]], jobs: int) -> dict[tuple[int, float, str], str]:
    """Each task in a forked child, at most ``jobs`` at once, in ``tasks``' order: the child runs ``_task`` and
    writes its JSON text to a file of its own, which the parent reads once the child exits 0. A child that fails
    stops the others and raises here, with its exit status (its traceback went to stderr)."""
    done: dict[tuple[int, float, str], str] = {}
    running: dict[int, tuple[tuple[int, float, str], Path]] = {}
    queue = list(enumerate(tasks))
    with tempfile.TemporaryDirectory(prefix="keel-sim-") as scratch:
        try:
            while queue or running:
                while queue and len(running) < jobs:
                    index, task = queue.pop(0)
                    out = Path(scratch) / f"task{index}.json"
                    pid = os.fork()
                    if pid == 0:  # the child: one task, then exit without running the parent's cleanup
                        status = 1
                        try:
                            out.write_text(_task(task))
                            status = 0
                        except BaseException:
                            traceback.print_exc()
                        finally:
                            os._exit(status)
                    running[pid] = (task, out)
                pid, wait_status = os.waitpid(-1, 0)
                if pid not in running:
                    continue  # not one of ours
                task, out = running.pop(pid)
                code = os.waitstatus_to_exitcode(wait_status)
                if code != 0:
                    raise RuntimeError(f"simulating {task[2]} (seed {task[0]}, failure rates x{task[1]}) failed in "
                                       f"its worker process (exit status {code})")
                done[task] = out.read_text()
        finally:
            for pid in running:
                os.kill(pid, signal.SIGKILL)
            for pid in running:
                os.waitpid(pid, 0)
    return done


def _task(key: tuple[int, float, str]) -> str:
    seed, factor, system = key
    mix: FailureMix = _WORK["mix"]
    trace = generate(mix.scaled(factor) if factor != 1.0 else mix, nodes=_WORK["nodes"], days=_WORK["days"], seed=seed)
    return json.dumps(run_system(system, trace, _WORK["cal"], seed=seed))


def run_many(mix: FailureMix, cal: Calibration, *, nodes: int, days: float,
             runs: list[tuple[int, float, tuple[str, ...]]], jobs: int = 1) -> list[dict[str, Any]]:
    """Each ``(seed, failure-rate factor, systems)`` of ``runs``: its trace and every one of its systems over
    it, in ``jobs`` worker processes (1: in this one). Returns one JSON-ready dict per run, in order; each
    system's summary is the same whatever ``jobs`` is, but for its ``sim_wall_s`` and ``sim_cpu_s``."""
    for _, _, systems in runs:
        _check(systems)

    def cost(task: tuple[int, float, str]) -> tuple[int, float]:
        system = task[2]
        return (COST_ORDER.index(system) if system in COST_ORDER else len(COST_ORDER), -task[1])

    tasks = sorted({(seed, factor, system) for seed, factor, systems in runs for system in systems}, key=cost)
    _WORK.update(mix=mix, cal=cal, nodes=nodes, days=days)
    if jobs > 1 and len(tasks) > 1 and hasattr(os, "fork"):
        done = _in_children(tasks, jobs)
    else:
        done = {task: _task(task) for task in tasks}
    out = []
    for seed, factor, systems in runs:
        scaled = mix.scaled(factor) if factor != 1.0 else mix
        result = _header(scaled, generate(scaled, nodes=nodes, days=days, seed=seed), nodes=nodes, days=days, seed=seed)
        result["systems"] = {system: json.loads(done[(seed, factor, system)]) for system in systems}
        out.append(result)
    return out


def table(result: dict[str, Any]) -> str:
    """The run as a table: one line per system."""
    lines = [f"{'system':<22} {'ETTR':>8} {'worst 1h (min)':>15} {'lost (h)':>9} {'wall (s)':>9}"]
    for system, s in result["systems"].items():
        lines.append(f"{system:<22} {s['ettr']:>8.4f} {s['worst_window_min']:>15.1f} {s['lost_h']:>9.2f} "
                     f"{s['sim_wall_s']:>9.2f}")
    return "\n".join(lines)
