"""The analyzer's costs: capturing a node's stacks, aggregating a big job's, locating an SDC machine.

    python -m bench.analyzer [--quick] [--json PATH]

Three measurements, each on real material:

- **Capture** (``capture_s_node``): one simulated node of a real job, 2 ranks of a gloo group on
  127.0.0.1 (``tests/fixtures/stacks/make_fixtures.py``'s ``train`` scenario: each rank steps through a
  ``DataLoader(num_workers=1)`` and an all-reduce until killed), so 4 training processes: 2 ranks and
  their dataloader workers, found through ``/proc``. A capture runs ``py-spy dump --pid P --json
  --nonblocking`` (Python frames only, no pause of the training) on all 4 at once and waits for the
  last; ``capture_s_node`` is the median over the trials (``capture_s_node_max`` the worst), with every
  dump parsed (``keel.rules.stacks.parse_pyspy_json``) and each worker classified as a dataloader.
  Nodes capture in parallel, so this is also the job's capture time.
- **Aggregation** (``aggregate_s_16k``, ``aggregate_s_by_ranks``): jobs of 1,024, 4,096, 16,384 and
  65,536 ranks (``--quick``: up to 16,384), DP x PP 8 x TP 2 with 8 ranks per node, every rank a main
  process and a dataloader worker built from the real dumps in ``tests/fixtures/stacks`` (a rank
  waiting in ``all_reduce`` and its idle worker; two planted outliers on one node stuck in
  ``pipeline_stage_forward``), timed for ``keel.analyzer.aggregate.aggregate`` alone (signatures,
  clustering, covering group), median of 3 runs; the verdict must name the planted ranks and their
  node. In the scaling series the dumps are parsed once and shared by the ranks; ``aggregate_s_16k``
  parses every rank's dumps from their JSON text separately (distinct objects, as when each rank's
  dump arrives in its own event; the parse time is ``parse_s_16k``, paid where the events are decoded).
- **SDC localisation** (``replays_by_machines``): ``keel.rules.sdc.simulate`` plans the dual-phase
  replay for 24, 96 and 1,200 machines and runs it against every possible bad machine; the figure is
  the worst number of replay rounds, beside ``ceil(log2 n)`` for a binary search
  (``binary_search_by_machines``); every machine must be located exactly.

Targets: ``aggregate_s_16k`` <= 2 s; capture plus aggregation of 16,384 ranks within one fail-slow
round (10 s); 2 replays for each machine count, every bad machine found. A missed target exits 1.
``--quick`` (under a minute): 3 capture trials instead of 10, no 65,536-rank job.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from keel.analyzer.aggregate import Topology, aggregate  # noqa: E402
from keel.rules.sdc import binary_search_rounds, replays_needed, simulate  # noqa: E402
from keel.rules.stacks import classify_role, parse_pyspy_json  # noqa: E402
from tests.fixtures.stacks import make_fixtures as mf  # noqa: E402
from tests.fixtures.stacks.scenarios import HUNG, replicate  # noqa: E402

AGGREGATE_TARGET_S = 2.0
ROUND_S = 10.0  # the fail-slow round interval: capture + aggregation must fit in it
REPLAYS_TARGET = 2
RANKS_QUICK = (1024, 4096, 16384)
RANKS_FULL = (1024, 4096, 16384, 65536)
MACHINES = (24, 96, 1200)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------------------------- capture


def capture_once(targets: list[tuple[int, str]], py_spy: Path) -> tuple[float, list[str]]:
    """Dump every (pid, role) at once; the wall time until the last is done, and any problems."""
    started = time.perf_counter()
    procs = [(pid, role, subprocess.Popen([str(py_spy), "dump", "--pid", str(pid), "--json", "--nonblocking"],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
             for pid, role in targets]
    outputs = [(pid, role, *p.communicate(timeout=60), p.returncode) for pid, role, p in procs]
    elapsed = time.perf_counter() - started
    problems = []
    for pid, role, out, err, rc in outputs:
        if rc != 0:
            problems.append(f"py-spy failed on {role} pid {pid}: {err.strip().splitlines()[:1]}")
            continue
        threads = parse_pyspy_json(out)
        if role == "dataloader" and classify_role(threads) != "dataloader":
            problems.append(f"pid {pid} is not recognised as a dataloader worker")
    return elapsed, problems


def measure_capture(trials: int, work: Path) -> dict[str, Any]:
    group = mf.start_group("train", 2, work)
    try:
        targets: list[tuple[int, str]] = []
        for pid in group.pids:
            targets += [(pid, "rank"), (mf.dataloader_worker(pid), "dataloader")]
        time.sleep(1.0)  # let the ranks settle into their steps
        times, problems = [], []
        for _ in range(trials):
            elapsed, issues = capture_once(targets, mf.DEFAULT_PYSPY)
            times.append(elapsed)
            problems += issues
            time.sleep(0.2)
        return {"capture_s_node": statistics.median(times), "capture_s_node_max": max(times),
                "capture_trials": trials, "capture_processes": len(targets), "capture_problems": problems}
    finally:
        group.stop()


# ----------------------------------------------------------------------------------------- aggregation


def job(n_ranks: int) -> tuple[Topology, tuple[int, int]]:
    topo = Topology.grid(dp=n_ranks // 16, pp=8, tp=2, ranks_per_node=8)
    middle = (n_ranks // 2) // 8 * 8  # the first rank of a node in the middle of the job
    return topo, (middle + 3, middle + 5)


def time_aggregate(n_ranks: int, parse_each: bool, repeats: int = 3) -> dict[str, Any]:
    topo, bad = job(n_ranks)
    gc.disable()  # building millions of frames: the collector's passes would only add noise
    try:
        t0 = time.perf_counter()
        procs = replicate(topo, dict.fromkeys(bad, HUNG), parse_each=parse_each)
        build_s = time.perf_counter() - t0
    finally:
        gc.enable()
    times = []
    verdict = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        verdict = aggregate(procs, topo)
        times.append(time.perf_counter() - t0)
    assert verdict is not None
    node = topo.placements[bad[0]].node
    ok = verdict.outlier_ranks == bad and verdict.group_kind == "node" and verdict.group_nodes == (node,)
    del procs
    gc.collect()
    return {"ranks": n_ranks, "processes": 2 * n_ranks, "aggregate_s": statistics.median(times), "build_s": build_s,
            "correct": ok, "verdict": f"{verdict.kind}: {verdict.reasons[0]}"}


# ------------------------------------------------------------------------------------------------ sdc


def measure_sdc() -> dict[str, Any]:
    out: dict[str, Any] = {"replays_by_machines": {}, "binary_search_by_machines": {}, "sdc_all_correct": {},
                           "sdc_grid_by_machines": {}, "sdc_simulate_s": {}}
    for n in MACHINES:
        t0 = time.perf_counter()
        sim = simulate(n)
        out["sdc_simulate_s"][str(n)] = time.perf_counter() - t0
        out["replays_by_machines"][str(n)] = sim.worst_rounds
        out["binary_search_by_machines"][str(n)] = binary_search_rounds(n)
        out["sdc_all_correct"][str(n)] = sim.all_correct and sim.worst_rounds == replays_needed(n)
        out["sdc_grid_by_machines"][str(n)] = f"{sim.rows}x{sim.cols}"
    return out


# ---------------------------------------------------------------------------------------------- report


def targets(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    round_s = result["capture_s_node_max"] + result["aggregate_s_16k"]
    t = {
        "aggregate_s_16k": {"value": result["aggregate_s_16k"], "target": f"<= {AGGREGATE_TARGET_S:g} s",
                            "met": result["aggregate_s_16k"] <= AGGREGATE_TARGET_S and result["aggregate_16k_correct"]},
        "round_s_16k": {"value": round_s, "target": f"<= {ROUND_S:g} s (capture max + aggregation)",
                        "met": round_s <= ROUND_S and not result["capture_problems"]},
    }
    for n in MACHINES:
        k = str(n)
        t[f"replays_{n}"] = {"value": result["replays_by_machines"][k], "target": f"<= {REPLAYS_TARGET}, all found",
                             "met": result["replays_by_machines"][k] <= REPLAYS_TARGET and result["sdc_all_correct"][k]}
    scaling_ok = all(row["correct"] for row in result["aggregate_by_ranks"])
    t["aggregate_verdicts"] = {"value": scaling_ok, "target": "planted outliers found at every size", "met": scaling_ok}
    return t


def print_table(result: dict[str, Any]) -> None:
    print()
    print(f"analyzer benchmark ({result['mode']} run, {result['cpus']} CPUs)")
    print(f"capture, one node ({result['capture_processes']} processes, py-spy --nonblocking, in parallel): "
          f"median {result['capture_s_node'] * 1e3:.0f} ms, max {result['capture_s_node_max'] * 1e3:.0f} ms over "
          f"{result['capture_trials']} trials")
    header = f"{'ranks':>8} {'processes':>10} {'aggregate':>10} {'build':>8}  verdict"
    print(header)
    print("-" * len(header))
    for row in result["aggregate_by_ranks"]:
        print(f"{row['ranks']:>8} {row['processes']:>10} {row['aggregate_s']:>9.3f}s {row['build_s']:>7.2f}s  "
              f"{'ok' if row['correct'] else 'WRONG'}")
    print(f"16,384 ranks, each rank's dumps parsed on their own: aggregate {result['aggregate_s_16k']:.3f}s "
          f"(parse {result['parse_s_16k']:.2f}s, paid where events are decoded)")
    header = f"{'machines':>9} {'grid':>7} {'dual-phase':>11} {'binary search':>14}  all found"
    print(header)
    print("-" * len(header))
    for n in MACHINES:
        k = str(n)
        print(f"{n:>9} {result['sdc_grid_by_machines'][k]:>7} {result['replays_by_machines'][k]:>11} "
              f"{result['binary_search_by_machines'][k]:>14}  {result['sdc_all_correct'][k]}")
    print("targets:")
    for name, t in result["targets"].items():
        value = t["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {name:<20} {shown:>8}  {t['target']:<44} {'met' if t['met'] else 'NOT MET'}")
    for problem in result["capture_problems"]:
        print(f"capture problem: {problem}")
    print(f"wall time {result['wall_s']:.0f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.analyzer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 capture trials, up to 16,384 ranks (< 1 min)")
    parser.add_argument("--json", help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    started = time.monotonic()
    mode = "quick" if args.quick else "full"
    result: dict[str, Any] = {"mode": mode, "cpus": os.cpu_count()}
    work = Path(tempfile.mkdtemp(prefix="keel-bench-analyzer-"))
    try:
        log("capture: 2 ranks + 2 dataloader workers")
        result.update(measure_capture(3 if args.quick else 10, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for n in RANKS_QUICK if args.quick else RANKS_FULL:
        log(f"aggregate: {n} ranks")
        rows.append(time_aggregate(n, parse_each=False))
    result["aggregate_by_ranks"] = rows
    result["aggregate_s_by_ranks"] = {str(r["ranks"]): r["aggregate_s"] for r in rows}
    log("aggregate: 16384 ranks, dumps parsed per rank")
    big = time_aggregate(16384, parse_each=True)
    result["aggregate_s_16k"] = big["aggregate_s"]
    result["parse_s_16k"] = big["build_s"]
    result["aggregate_16k_correct"] = big["correct"]
    result["aggregate_16k_verdict"] = big["verdict"]
    log("sdc: simulate every bad machine")
    result.update(measure_sdc())
    result["wall_s"] = time.monotonic() - started
    result["targets"] = targets(result)
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0 if all(t["met"] for t in result["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
