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
- **Whole path** (``whole_path_s_16k``, ``whole_path_by_ranks``): a capture round of jobs of 1,024,
  4,096, 16,384 and 65,536 ranks (``--quick``: up to 16,384), TP 8 x PP 8 x DP, 8 ranks (one TP group)
  per node, every rank a main process and two dataloader workers, from events in to verdict out, through
  the analyzer service's own code: the controller's ``StacksRequested`` and every node's
  ``StacksCaptured`` parts, built as the agent builds them (``bench._stackgen``: py-spy-like dumps that
  differ per rank in frames, line numbers, thread sets and per-rank scratch paths; two culprits on one
  node stuck inside the forward pass) and encoded as on the wire, are decoded (``decode_wire``, the
  consumer's), folded and decided (``DeciderSession.observe``, the runner's loop body; the last part
  completes the round and runs ``keel.analyzer.rung3.judge``: topology, frames parsed, aggregation) until
  ``StacksAnalyzed`` comes out. Phases: ``decode_s``, ``collect_s`` (every part but the last),
  ``judge_s``, and ``total_s``, the path's own clock; ``topology_s``, ``parse_s`` and ``aggregate_s``
  split ``judge`` (timed afterwards on the same captures). The verdict must name exactly the culprits and
  their node (asserted: a wrong verdict fails the run). One run per size, the collector on as in the
  service. Not included: the signature check of each event (off unless signing is configured) and NATS
  delivery itself (the bus benchmark's).
- **SDC localisation** (``replays_by_machines``): ``keel.rules.sdc.simulate`` plans the dual-phase
  replay for 24, 96 and 1,200 machines and runs it against every possible bad machine; the figure is
  the worst number of replay rounds, beside ``ceil(log2 n)`` for a binary search
  (``binary_search_by_machines``); every machine must be located exactly.

Targets: docs/benchmarks.md set <= 2 s for aggregating 16,384 ranks; it was set for ``aggregate()``
alone and is held here against the whole path (``whole_path_s_16k``). Capture plus the whole path of
16,384 ranks within one fail-slow round (10 s); 2 replays for each machine count, every bad machine
found. A missed target exits 1. ``--quick``: 3 capture trials instead of 10, no 65,536-rank job.
``--smoke`` (seconds): 1 capture trial, 128 and 512 ranks, 24 machines; exits 1 only when a verdict is
wrong. The results carry their provenance (``bench._provenance``).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import _stackgen  # noqa: E402
from bench._provenance import provenance  # noqa: E402
from keel.agent.stack_capture import split_parts  # noqa: E402
from keel.analyzer.aggregate import Topology, aggregate  # noqa: E402
from keel.analyzer.core import AnalyzerDecider  # noqa: E402
from keel.analyzer.rung3 import frame_of, process_of, topology_of  # noqa: E402
from keel.events.envelope import Event, decode_wire  # noqa: E402
from keel.events.types import RankTopology, StacksAnalyzed, StacksCaptured, StacksRequested  # noqa: E402
from keel.infra.config import BusSettings  # noqa: E402
from keel.kernel.decider import DeciderSession  # noqa: E402
from keel.rules.sdc import binary_search_rounds, replays_needed, simulate  # noqa: E402
from keel.rules.stacks import classify_role, parse_pyspy_json  # noqa: E402
from tests.fixtures.stacks import make_fixtures as mf  # noqa: E402

AGGREGATE_TARGET_S = 2.0
JOB = "bench-analyzer"
TP, PP, RANKS_PER_NODE = 8, 8, 8  # TP inside a node of 8 GPUs, as Megatron places it
PROCESSES_PER_RANK = 3  # the rank and two dataloader workers
MAX_EVENT_BYTES = int(BusSettings().max_event_bytes)
ROUND_S = 10.0  # the fail-slow round interval: capture + aggregation must fit in it
REPLAYS_TARGET = 2
RANKS_SMOKE = (128, 512)
RANKS_QUICK = (1024, 4096, 16384)
RANKS_FULL = (1024, 4096, 16384, 65536)
MACHINES = (24, 96, 1200)
MACHINES_SMOKE = (24,)
HEADLINE_RANKS = 16384


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


# ------------------------------------------------------------------------------------------ whole path


def job(n_ranks: int) -> tuple[Topology, tuple[int, int]]:
    """The job's layout and its two planted culprits (two ranks of one node in the middle of the job)."""
    topo = Topology.grid(dp=n_ranks // (PP * TP), pp=PP, tp=TP, ranks_per_node=RANKS_PER_NODE)
    middle = (n_ranks // 2) // RANKS_PER_NODE * RANKS_PER_NODE
    return topo, (middle + 3, middle + 5)


def round_messages(n_ranks: int) -> tuple[list[bytes], Topology, tuple[int, int]]:
    """The capture round as it reaches the analyzer: the controller's ``StacksRequested``, then every node's
    ``StacksCaptured`` parts (``keel.agent.stack_capture``'s ``captured_threads`` and ``split_parts``, as the
    agent builds them from py-spy's JSON), each encoded as on the wire. Setup, not timed."""
    topo, bad = job(n_ranks)
    start = datetime(2026, 12, 1, tzinfo=UTC)
    nodes = sorted(topo.node_ranks, key=lambda n: int(n.rsplit("-", 1)[1]))
    request = Event.create(StacksRequested(round=1, nodes=nodes, timeout_s=30.0, expires_at=start + timedelta(seconds=60),
                                           reason="step timeout: no progress for 25 s"),
                           job_id=JOB, subject=f"job/{JOB}", producer="controller", occurred_at=start)
    out = [request.to_json()]
    dumps = _stackgen.Dumps(seed=n_ranks)
    for node in nodes:
        processes = []
        for rank in topo.node_ranks[node]:
            stage = topo.placements[rank].pp.index(rank)
            processes += dumps.rank_processes(rank, stage, culprit=rank in bad)
        p = topo.placements
        ranks = [RankTopology(rank=r, tp=list(p[r].tp), pp=list(p[r].pp), dp=list(p[r].dp)) for r in topo.node_ranks[node]]
        parts = split_parts(processes, MAX_EVENT_BYTES // 2)  # the agent's budget: half the event limit
        for index, chunk in enumerate(parts):
            captured = StacksCaptured(node_id=node, request_id=str(request.id), round=1, processes=chunk,
                                      ranks=ranks if index == 0 else [], part=index, parts=len(parts), duration_s=0.13)
            out.append(Event.create(captured, job_id=JOB, subject=f"node/{node}", producer="node-agent",
                                    occurred_at=start + timedelta(seconds=1), causation_id=request.id).to_json())
    return out, topo, bad


def time_round(n_ranks: int) -> dict[str, Any]:
    """Events in to verdict out, through the analyzer service's own code, timed by phase.

    The timed path is the service's loop body: ``decode_wire`` on each message (the consumer's decode), then
    ``DeciderSession.observe`` (the runner's evolve and decide) on each event; the last node's part completes
    the round and its ``observe`` runs ``judge`` (topology, frames parsed, aggregation) and emits the verdict.
    The split of ``judge`` into its three steps is timed afterwards, on the same captures, by calling the
    functions ``judge`` calls, so that the total is the real path's own clock and not a sum of parts.
    """
    t0 = time.perf_counter()
    messages, topo, bad = round_messages(n_ranks)
    build_s = time.perf_counter() - t0
    wire_bytes = sum(len(m) for m in messages)
    n_messages = len(messages)
    session = DeciderSession(AnalyzerDecider())
    frame_of.cache_clear()  # a first round: no frame text parsed before (a long-lived service keeps some)
    gc.collect()
    t0 = time.perf_counter()
    events = [decode_wire(m, max_bytes=MAX_EVENT_BYTES)[1] for m in messages]
    t1 = time.perf_counter()
    for event in events[:-1]:
        session.observe(event)
    t2 = time.perf_counter()
    emitted = session.observe(events[-1]).emitted
    t3 = time.perf_counter()
    verdicts = [e.payload for e in emitted if isinstance(e.payload, StacksAnalyzed)]
    node = topo.placements[bad[0]].node
    verdict = verdicts[0] if verdicts else None
    correct = (verdict is not None and verdict.conclusive and tuple(verdict.outlier_ranks) == bad
               and verdict.group_nodes == [node])
    # The split of judge: the same steps on the same captures (keel.analyzer.rung3.judge's body).
    captures = [e.payload for e in events[1:] if isinstance(e.payload, StacksCaptured)]
    frame_of.cache_clear()
    s0 = time.perf_counter()
    topology = topology_of(captures, {}, 0)
    s1 = time.perf_counter()
    processes = [process_of(p) for c in captures for p in c.processes]
    s2 = time.perf_counter()
    direct = aggregate(processes, topology)
    s3 = time.perf_counter()
    del events, captures, processes, messages
    gc.collect()
    return {
        "ranks": n_ranks, "nodes": len(topo.node_ranks), "processes": n_ranks * PROCESSES_PER_RANK,
        "messages": n_messages,
        "wire_mb": wire_bytes / 1e6, "build_s": build_s,
        "decode_s": t1 - t0, "collect_s": t2 - t1, "judge_s": t3 - t2, "total_s": t3 - t0,
        "topology_s": s1 - s0, "parse_s": s2 - s1, "aggregate_s": s3 - s2,
        "correct": correct and tuple(direct.outlier_ranks) == bad,
        "verdict": (f"{verdict.group_kind} {verdict.group_nodes}: {verdict.reason[:160]}" if verdict is not None
                    else "no verdict emitted"),
    }


# ------------------------------------------------------------------------------------------------ sdc


def measure_sdc(machines: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"sdc_machines": list(machines), "replays_by_machines": {}, "binary_search_by_machines": {}, "sdc_all_correct": {},
                           "sdc_grid_by_machines": {}, "sdc_simulate_s": {}}
    for n in machines:
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
    whole = result["whole_path_s_16k"]
    round_s = result["capture_s_node_max"] + whole
    t: dict[str, dict[str, Any]] = {
        # The documented 2 s target was set for aggregation alone; it is held here against the whole path.
        "whole_path_s_16k": {"value": whole, "target": f"<= {AGGREGATE_TARGET_S:g} s (set for aggregation alone)",
                             "met": whole <= AGGREGATE_TARGET_S and result["whole_path_16k_correct"]},
        "round_s_16k": {"value": round_s, "target": f"<= {ROUND_S:g} s (capture max + whole path)",
                        "met": round_s <= ROUND_S and not result["capture_problems"]},
    }
    for n in result["sdc_machines"]:
        k = str(n)
        t[f"replays_{n}"] = {"value": result["replays_by_machines"][k], "target": f"<= {REPLAYS_TARGET}, all found",
                             "met": result["replays_by_machines"][k] <= REPLAYS_TARGET and result["sdc_all_correct"][k]}
    ok = all(row["correct"] for row in result["whole_path_by_ranks"])
    t["verdicts"] = {"value": ok, "target": "planted culprits found at every size", "met": ok}
    return t


def print_table(result: dict[str, Any]) -> None:
    print()
    print(f"analyzer benchmark ({result['mode']} run, {result['cores']} cores, {result['cpu_model']})")
    print(f"capture, one node ({result['capture_processes']} processes, py-spy --nonblocking, in parallel): "
          f"median {result['capture_s_node'] * 1e3:.0f} ms, max {result['capture_s_node_max'] * 1e3:.0f} ms over "
          f"{result['capture_trials']} trials")
    print("whole path, events in to verdict out (seconds):")
    header = (f"{'ranks':>7} {'wire MB':>8} {'decode':>7} {'collect':>8} {'judge':>7} {'TOTAL':>7} | {'topology':>8} "
              f"{'parse':>7} {'aggregate':>9}  verdict")
    print(header)
    print("-" * len(header))
    for row in result["whole_path_by_ranks"]:
        print(f"{row['ranks']:>7} {row['wire_mb']:>8.1f} {row['decode_s']:>7.2f} {row['collect_s']:>8.2f} "
              f"{row['judge_s']:>7.2f} {row['total_s']:>7.2f} | {row['topology_s']:>8.2f} {row['parse_s']:>7.2f} "
              f"{row['aggregate_s']:>9.2f}  {'ok' if row['correct'] else 'WRONG: ' + row['verdict']}")
    header = f"{'machines':>9} {'grid':>7} {'dual-phase':>11} {'binary search':>14}  all found"
    print(header)
    print("-" * len(header))
    for n in result["sdc_machines"]:
        k = str(n)
        print(f"{n:>9} {result['sdc_grid_by_machines'][k]:>7} {result['replays_by_machines'][k]:>11} "
              f"{result['binary_search_by_machines'][k]:>14}  {result['sdc_all_correct'][k]}")
    print("targets:")
    for name, t in result["targets"].items():
        value = t["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {name:<20} {shown:>8}  {t['target']:<48} {'met' if t['met'] else 'NOT MET'}")
    for problem in result["capture_problems"]:
        print(f"capture problem: {problem}")
    print(f"wall time {result['wall_s']:.0f}s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.analyzer", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="3 capture trials, up to 16,384 ranks")
    size.add_argument("--smoke", action="store_true", help="seconds: 1 capture trial, 128 and 512 ranks, 24 machines")
    parser.add_argument("--json", help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    started = time.monotonic()
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    result: dict[str, Any] = {"mode": mode, **provenance(argv, "bench.analyzer")}
    work = Path(tempfile.mkdtemp(prefix="keel-bench-analyzer-"))
    try:
        log("capture: 2 ranks + 2 dataloader workers")
        result.update(measure_capture(1 if args.smoke else 3 if args.quick else 10, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for n in RANKS_SMOKE if args.smoke else RANKS_QUICK if args.quick else RANKS_FULL:
        log(f"whole path: {n} ranks")
        rows.append(time_round(n))
        log(f"  {rows[-1]['total_s']:.2f} s ({'ok' if rows[-1]['correct'] else 'WRONG'})")
    result["whole_path_by_ranks"] = rows
    result["whole_path_s_by_ranks"] = {str(r["ranks"]): r["total_s"] for r in rows}
    headline = next((r for r in rows if r["ranks"] == HEADLINE_RANKS), rows[-1])
    result["headline_ranks"] = headline["ranks"]
    result["whole_path_s_16k"] = headline["total_s"]
    result["whole_path_16k_correct"] = headline["correct"]
    result["whole_path_16k_verdict"] = headline["verdict"]
    log("sdc: simulate every bad machine")
    result.update(measure_sdc(MACHINES_SMOKE if args.smoke else MACHINES))
    result["wall_s"] = time.monotonic() - started
    result["targets"] = targets(result)
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.json}")
    if args.smoke:
        # A smoke run checks that the bench works (verdicts right), not the targets of full sizes; a py-spy
        # dump that fails now and then under load (a torn --nonblocking read) is listed, not fatal here.
        return 0 if result["targets"]["verdicts"]["met"] else 1
    return 0 if all(t["met"] for t in result["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
