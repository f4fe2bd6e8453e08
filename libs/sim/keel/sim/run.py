"""Every system on the same trace, in one run: Keel and its ablations (the real controller), the baselines
(cost models), with ETTR, the worst 1-hour window and lost time for each (pure but for the wall clock
reading that times the simulation)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from keel.sim.baselines import BASELINES, baseline_losses
from keel.sim.config import Calibration, FailureMix
from keel.sim.engine import VARIANTS, KeelSim
from keel.sim.metrics import summarise
from keel.sim.trace import generate

SYSTEMS = (*VARIANTS, *BASELINES)


def run_all(mix: FailureMix, cal: Calibration, *, nodes: int, days: float, seed: int,
            systems: tuple[str, ...] = SYSTEMS) -> dict[str, Any]:
    """One seed: a trace, then every system in ``systems`` over it. Returns a JSON-ready dict."""
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    trace = generate(mix, nodes=nodes, days=days, seed=seed)
    out: dict[str, Any] = {"seed": seed, "nodes": nodes, "days": days, "failures": len(trace.failures),
                           "failures_by_kind": {k.name: trace.count(k.name) for k in mix.kinds},
                           "code_changes": len(trace.code_changes_s), "systems": {}}
    for system in systems:
        started = time.perf_counter()
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
        out["systems"][system] = {**summary, **extra, "sim_wall_s": round(time.perf_counter() - started, 3)}
    return out


def table(result: dict[str, Any]) -> str:
    """The run as a table: one line per system."""
    lines = [f"{'system':<22} {'ETTR':>8} {'worst 1h (min)':>15} {'lost (h)':>9} {'wall (s)':>9}"]
    for system, s in result["systems"].items():
        lines.append(f"{system:<22} {s['ettr']:>8.4f} {s['worst_window_min']:>15.1f} {s['lost_h']:>9.2f} "
                     f"{s['sim_wall_s']:>9.2f}")
    return "\n".join(lines)
