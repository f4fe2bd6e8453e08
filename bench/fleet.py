"""ETTR on a simulated fleet: Keel's real controller against the baselines, on the same failure traces.

    python -m bench.fleet [--quick | --smoke] [--json PATH] [--charts DIR] [--nodes N] [--days D] [--seeds 1,2,3]
    python -m bench.fleet --charts-from bench/results/fleet.json --charts docs/img/fleet

``keel.sim`` (docs/fleet-sim.md) generates a failure trace from the default mix (``keel.sim/failures.yaml``:
Llama 3's and ByteRobust's published figures), then runs every system over it: Keel and its ablations with
the real controller's decider on a simulated clock, and the conventional, torchelastic and oracle cost models.
Full: 1,200 machines (9,600 GPUs), 90 days, seeds 1-3, and a sensitivity table (failure rate x0.5, x2, x4;
seed 1). ``--quick``: 30 days, one seed, no sensitivity table (at x4 the failures, and Keel's simulated time,
quadruple). ``--smoke``: 32 machines for 3 days (seconds; the test suite's), with the sensitivity table.
Every system of every run is a task of its own, spread over ``--jobs`` worker processes (default: every core);
``sim_wall_s`` is the wall time of all of them, ``sim_wall_s_summed`` the sum of their own wall times.
``--scale-curve 150,1200,12500 [--days 2]``: Keel and the baselines at each machine count (to 100,000 GPUs),
with what simulating Keel cost per event, written to ``--json``.
``--charts DIR`` writes ``ettr.svg`` (every system's cumulative ETTR by day, the target dashed) and
``lost_time.svg`` (Keel's lost hours by phase and mechanism, every system's by phase) and, where Debian's headless
Chromium is installed, their PNGs (``keel.sim.charts``); ``--charts-from PATH`` draws them from a results file
already written, without simulating anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench._provenance import provenance
from keel.sim.charts import write_charts
from keel.sim.config import load_calibration, load_mix
from keel.sim.run import SYSTEMS, run_many, table

SENSITIVITY = (0.5, 2.0, 4.0)
SENSITIVITY_SYSTEMS = ("keel", "conventional", "torchelastic", "oracle")
TARGETS = {"ettr_keel_min": 0.985, "worst_window_min_keel_max": 20.0}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="30 days, one seed")
    mode.add_argument("--smoke", action="store_true", help="32 machines, 3 days, one seed (seconds)")
    mode.add_argument("--scale-curve", metavar="MACHINES",
                      help="comma-separated machine counts (e.g. 150,1200,12500): Keel and the baselines at each, "
                           "for --days (default 2), seed 1; ETTR and the simulation's cost per point")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--nodes", type=int, help="machines of 8 GPUs (default 1,200; --smoke 32)")
    parser.add_argument("--days", type=float, help="simulated days (default 90; --quick 30; --smoke 3)")
    parser.add_argument("--seeds", help="comma-separated seeds (default 1,2,3; --quick and --smoke 1)")
    parser.add_argument("--mix", type=Path, help="a failure mix YAML (default: keel.sim's failures.yaml)")
    parser.add_argument("--calibration", type=Path, help="a calibration YAML (default: keel.sim's)")
    parser.add_argument("--no-sensitivity", action="store_true",
                        help="leave out the sensitivity table (--quick always does)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="worker processes, one system of one run each (default: every core)")
    parser.add_argument("--charts", type=Path, metavar="DIR",
                        help="write ettr.svg and lost_time.svg here, and their PNGs where a headless Chromium is "
                             "installed (without one: the SVGs only, said on stderr)")
    parser.add_argument("--charts-from", type=Path, metavar="PATH",
                        help="draw the --charts from this results file (a --json of an earlier run) and exit: "
                             "nothing is simulated")
    args = parser.parse_args(argv)
    if args.charts_from is not None:
        if args.charts is None:
            parser.error("--charts-from needs --charts DIR")
        return charts_from(args.charts_from, args.charts)
    if args.scale_curve:
        if args.charts is not None:
            parser.error("--charts draws a run's ETTR and lost time; --scale-curve has neither by day")
        return scale_curve(argv, args)
    mode_name = "smoke" if args.smoke else "quick" if args.quick else "full"
    nodes = args.nodes or (32 if args.smoke else 1200)
    days = args.days or (3.0 if args.smoke else 30.0 if args.quick else 90.0)
    seeds = [int(s) for s in (args.seeds or ("1" if args.smoke or args.quick else "1,2,3")).split(",")]
    mix, cal = load_mix(args.mix), load_calibration(args.calibration)
    gpus = nodes * int(cal.job["gpus_per_node"])
    jobs = max(1, args.jobs)
    started = time.perf_counter()
    factors = () if args.quick or args.no_sensitivity else SENSITIVITY
    plan = [(seed, 1.0, SYSTEMS) for seed in seeds] + [(seeds[0], f, SENSITIVITY_SYSTEMS) for f in factors]
    done = run_many(mix, cal, nodes=nodes, days=days, runs=plan, jobs=jobs)
    sim_wall_s = time.perf_counter() - started
    runs = done[:len(seeds)]
    for seed, run in zip(seeds, runs, strict=True):
        print(f"seed {seed}: {run['failures']} failures on {gpus} GPUs over {days:g} days")
        print(table(run), flush=True)
    sensitivity: dict[str, Any] = {}
    for factor, run in zip(factors, done[len(seeds):], strict=True):
        sensitivity[f"x{factor:g}"] = {s: {"ettr": round(v["ettr"], 5), "worst_window_min": round(v["worst_window_min"], 2)}
                                       for s, v in run["systems"].items()}
        print(f"failure rate x{factor:g}: " + ", ".join(f"{s} {v['ettr']:.4f}" for s, v in
                                                       sensitivity[f'x{factor:g}'].items()), flush=True)

    def mean(system: str, key: str) -> float:
        return round(sum(r["systems"][system][key] for r in runs) / len(runs), 5)

    result: dict[str, Any] = {
        **provenance(argv, "bench.fleet"),
        "mode": mode_name, "gpus": gpus, "nodes": nodes, "days": days, "seeds": seeds,
        "calibration_sources": list(cal.sources),
        "ettr": {s: mean(s, "ettr") for s in SYSTEMS},
        "worst_window_min": {s: mean(s, "worst_window_min") for s in SYSTEMS},
        "lost_h_by_mechanism": runs[0]["systems"]["keel"]["lost_h_by_mechanism"],
        "lost_h_by_phase": runs[0]["systems"]["keel"]["lost_h_by_phase"],
        "sim_wall_s": round(sim_wall_s, 2),
        "jobs": jobs,
        "sim_wall_s_keel": round(sum(r["systems"]["keel"]["sim_wall_s"] for r in runs), 2),
        "sim_wall_s_summed": round(sum(v["sim_wall_s"] for r in done for v in r["systems"].values()), 2),
        "per_seed": runs,
        "sensitivity": sensitivity,
        "targets": TARGETS,
    }
    ok = result["ettr"]["keel"] >= TARGETS["ettr_keel_min"] and \
        result["worst_window_min"]["keel"] <= TARGETS["worst_window_min_keel_max"]
    result["verdict"] = "PASS" if ok else "FAIL"
    print(f"keel ETTR {result['ettr']['keel']:.4f} (target >= {TARGETS['ettr_keel_min']}), worst 1-hour window "
          f"{result['worst_window_min']['keel']:.1f} min (target <= {TARGETS['worst_window_min_keel_max']:g}); "
          f"simulated in {sim_wall_s:.1f} s: {result['verdict']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.charts:
        _report_charts(write_charts(result, args.charts))
    return 0


def charts_from(path: Path, directory: Path) -> int:
    """The charts of a results file already written (``--charts-from``): no simulation."""
    try:
        result = json.loads(path.read_text())
        written = write_charts(result, directory)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"cannot draw charts from {path}: {exc}", file=sys.stderr)
        return 2
    _report_charts(written)
    return 0


def _report_charts(written: list[Path]) -> None:
    print("charts: " + ", ".join(str(p) for p in written))


CURVE_SYSTEMS = ("keel", "conventional", "torchelastic", "oracle")


def scale_curve(argv: list[str], args: argparse.Namespace) -> int:
    """ETTR and what the simulation costs as the job grows (issue 21, item 5): Keel and the baselines at each
    machine count, one seed, the same mix. The cost per event staying flat is the check that no decider's cost
    grows faster than linearly with the job; the events themselves grow with machines x failures. The cost is
    CPU time (``sim_cpu_s``): on a shared machine wall time measures the neighbours."""
    machines = [int(n) for n in args.scale_curve.split(",")]
    days = args.days or 2.0
    seed = int((args.seeds or "1").split(",")[0])
    mix, cal = load_mix(args.mix), load_calibration(args.calibration)
    per_node = int(cal.job["gpus_per_node"])
    points = []
    print(f"{'GPUs':>8} {'failures':>8} {'keel ETTR':>9} {'worst (min)':>11} {'events':>9} {'CPU (s)':>9} "
          f"{'us/event':>8}")
    started = time.perf_counter()
    for nodes in machines:
        [run] = run_many(mix, cal, nodes=nodes, days=days, runs=[(seed, 1.0, CURVE_SYSTEMS)], jobs=max(1, args.jobs))
        keel = run["systems"]["keel"]
        point = {"nodes": nodes, "gpus": nodes * per_node, "days": days, "failures": run["failures"],
                 "ettr": {s: round(v["ettr"], 5) for s, v in run["systems"].items()},
                 "worst_window_min": {s: round(v["worst_window_min"], 2) for s, v in run["systems"].items()},
                 "keel_events": keel["events"], "keel_decisions": keel["decisions"],
                 "keel_sim_wall_s": keel["sim_wall_s"], "keel_sim_cpu_s": keel["sim_cpu_s"],
                 "keel_us_per_event": round(keel["sim_cpu_s"] / max(1, keel["events"]) * 1e6, 2),
                 "keel_job_stops": keel["job_stops"], "keel_incidents_by_rung": keel["incidents_by_rung"]}
        points.append(point)
        _write(args.json, {**provenance(argv, "bench.fleet"), "mode": "scale_curve", "days": days, "seed": seed,
                           "systems": list(CURVE_SYSTEMS), "points": points,
                           "sim_wall_s": round(time.perf_counter() - started, 2)})
        print(f"{point['gpus']:>8} {point['failures']:>8} {keel['ettr']:>9.4f} {keel['worst_window_min']:>11.1f} "
              f"{keel['events']:>9} {keel['sim_cpu_s']:>9.1f} {point['keel_us_per_event']:>8.1f}", flush=True)
    return 0


def _write(path: Path | None, result: dict[str, Any]) -> None:
    """The curve so far (after each point: a long curve cut short keeps the points it has)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
