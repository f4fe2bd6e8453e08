"""Time to put a new code version into a running job: Keel in place against a full requeue.

    python -m bench.hot_update [--quick] [--json PATH] [--keep]

The same job as ``bench.recovery`` (4 nodes x 2 ranks of the example GPT, DP 4 x PP 2 over gloo, paced to
100 ms steps). **Time to new code** = from the order (``keel deploy --urgent``; for the requeue, the
moment every process is stopped) until the job is back at the step it had reached when the order was
given, running the new version. Every time comes from rank 0's step lines (``t_unix``).

- **Keel, in place**: ``keel up``'s services as processes (controller, checkpoint broker, analyzer,
  actuator, hot-update), a local cluster of agents forking ranks from their zygotes. The bench snapshots
  and validates a version (``keel deploy``'s own code, in this process: the validation's interpreter
  included) and publishes it as urgent; hot-update asks for the rollout, the controller restarts every
  node in place onto it (a planned restart), the agents keep their node stores and the ranks restore
  from memory. Every step is in memory, so where in a persistent interval the deploy falls does not
  matter.
- **Requeue**: at the order every process is SIGKILLed and the job starts afresh (4 new torchrun
  launchers, new ranks, a new rendezvous) from the persistent tier, written every N steps with N from
  Young's formula sqrt(2 C MTBF) / step time (C measured in the same run, MTBF 3 h, as in
  ``bench.recovery``). Deploy times fall at stratified offsets over that interval (trial i of n at
  (i + 1/2) / n x N steps after a persist), so the mean recomputation is that of a uniform deploy time
  (the first trial can fall before the first persist of the new interval, whose restore point is then
  older: its recomputation is corrected to the planned offset, measured and corrected both reported).
  The requeued job runs the same workload module: the versions differ by a comment, and a requeue's cost
  does not depend on it. No scheduler queue, pod creation or image pull is added (see docs/benchmarks.md: they
  dominate at scale).

``--quick`` (about three minutes): one trial each. Target: in place >= 5x faster (``ratio`` =
requeue_s / inplace_s, means). JSON keys: ``inplace_s``, ``requeue_s``, ``ratio``, and every trial.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._servers import BENCH_OPERATOR, Servers, scratch_dir  # noqa: E402
from bench.recovery import (  # noqa: E402
    FULL,
    JOB_ID,
    QUICK,
    Chain,
    KeelStack,
    Mode,
    TrialFailed,
    _last_before,
    _phases,
    back_from,
    calibrate,
    fault_offset,
    fault_step,
    log,
    relaunch,
    step_lines,
    wait_step,
    young,
)

TARGET_RATIO = 5.0
VERSION = """\
# version {n} of the training code (bench.hot_update)
import runpy

runpy.run_module("keel.workload.train", run_name="__main__", alter_sys=True)
"""


def write_version(root: Path, n: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.py").write_text(VERSION.format(n=n))
    return root


async def inplace_trial(stack: KeelStack, i: int, timeout_s: float = 120.0) -> dict[str, Any]:
    from keel.cli.versions import deploy_event
    from keel.events.envelope import now_utc
    from keel.infra.config import Settings

    gen, _ = await stack.steady(min_steps=5)
    source = write_version(stack.work / "sources" / f"v{i}", i)
    s_d, _ = _last_before(step_lines(stack.rank0_lines(gen)))
    t0 = time.time()
    event = await asyncio.to_thread(deploy_event, Settings(home=stack.work / "home"), JOB_ID, str(source), entry=None,
                                    mode="urgent", deadline=None, by=BENCH_OPERATOR, why=f"trial {i}", now=now_utc())
    if event.type != "CodeVersionRegistered":
        raise TrialFailed(f"the version was rejected: {event.payload.reason}")
    await stack.log.bus.publish(event)  # signed by the bench's operator key, as `keel deploy` signs
    published = time.time()
    version = event.payload.version_id
    deadline = time.monotonic() + timeout_s
    back = None
    new_gen = None
    while time.monotonic() < deadline:
        applied = [e for e in stack.events("CodeVersionApplied") if e.payload.version_id == version]
        if applied:
            new_gen = applied[0].payload.generation
            back = back_from(stack.rank0_lines(new_gen), s_d)
            if back.back_at is not None:
                break
        await asyncio.sleep(0.05)
    else:
        raise TrialFailed(f"Keel: not back at step {s_d} on {version} within {timeout_s:.0f}s; {stack.where()}\n  "
                          + "\n  ".join(stack.tail(now_utc().replace(microsecond=0))))
    assert back is not None and new_gen is not None
    marks = {"fault": t0, "published": published, "main": back.main_at, "resumed": back.resumed_at,
             "back": back.back_at}
    plan = next((e for e in stack.events("CheckpointRestorePlanned") if e.payload.generation == new_gen), None)
    return {"version": version, "s_d": s_d, "generation": new_gen, "restored_step": back.restored,
            "restore_tiers": sorted(t for t, n in plan.payload.tiers.items() if n) if plan else None,
            "warm": all(e.payload.warm for e in stack.events("CodeVersionApplied") if e.payload.version_id == version),
            "lost_s": round(back.back_at - t0, 3),  # type: ignore[operator]
            # restart: hot-update's request, the controller's decision, the ranks stopped and forked
            "phases_s": _phases(marks, ("snapshot_and_validate", "published"), ("restart", "main"),
                                ("setup_and_restore", "resumed"), ("recompute", "back"))}


async def inplace_run(mode: Mode, servers: Servers, work: Path, failures: list[str]) -> dict[str, Any]:
    stack = KeelStack(servers, work, mode)
    stack.more_services = ("hot-update",)
    trials: list[dict[str, Any]] = []
    try:
        t0 = time.monotonic()
        await stack.start()
        await stack.steady(min_steps=10, timeout_s=300)
        log(f"keel: stepping after {time.monotonic() - t0:.1f}s")
        for i in range(mode.keel_trials):
            try:
                trial = await inplace_trial(stack, i)
            except TrialFailed as exc:
                failures.append(f"in place: {exc}")
                log(f"FAILED: {exc}")
                break
            trials.append(trial)
            log(f"  in place #{i + 1}: {trial['lost_s']:.2f}s to step {trial['s_d']} on {trial['version']} (restored "
                f"{trial['restored_step']} from {trial['restore_tiers']}, warm {trial['warm']}; phases {trial['phases_s']})")
    finally:
        await stack.stop()
    return {"trials": trials}


def requeue_trial(chain: Chain, i: int, n: int, every: int, step_time_s: float,
                  timeout_s: float = 240.0) -> dict[str, Any]:
    group = chain.group
    assert group is not None
    current, _ = _last_before(step_lines([line.text for line in group.lines()]))
    offset = fault_offset(i, n, every)
    target = fault_step(current, offset, every)
    wait_step(group, target, 0.0, timeout_s=(target - current) * 1.0 + 120)
    requeued = relaunch(chain, chain, timeout_s)  # every process stopped now, the job started afresh
    s_d, restored, lost = requeued["s_f"], requeued["restored_step"], requeued["lost_after_stop_s"]
    # The deploy was meant to fall ``offset`` steps after a persist; the newest persist may be older (the
    # first interval after the calibration's last persist): correct the recomputation to the plan.
    correction = (offset - (s_d - restored)) * step_time_s
    return {"s_d": s_d, "offset_steps": offset, "recomputed_steps": s_d - restored, "restored_step": restored,
            "lost_measured_s": lost, "recompute_correction_s": round(correction, 3),
            "lost_s": round(lost + correction, 3), "phases_s": requeued["phases_s"]}


def requeue_run(mode: Mode, work: Path, failures: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"trials": []}
    try:
        calibration, cal_chain = calibrate(work, mode.calibration_persists)
    except TrialFailed as exc:
        failures.append(f"calibration: {exc}")
        log(f"FAILED: calibration: {exc}")
        return out
    n, raw, interval_s = young(calibration["save_cost_s"], calibration["step_time_s"])
    out.update(calibration=calibration, persist_every=n, young_interval_s=round(interval_s, 2))
    log(f"calibration: C = {calibration['save_cost_s'] * 1e3:.1f} ms, step {calibration['step_time_s'] * 1e3:.0f} ms; "
        f"Young (MTBF 3 h): every {n} steps")
    chain = Chain("requeue", work, n, 0, persist_dir=cal_chain.persist_dir)
    try:
        out["relaunch"] = relaunch(cal_chain, chain)
        for i in range(mode.baseline_trials):
            trial = requeue_trial(chain, i, mode.baseline_trials, n, calibration["step_time_s"])
            out["trials"].append(trial)
            log(f"  requeue #{i + 1}: {trial['lost_s']:.2f}s to step {trial['s_d']} (planned {trial['offset_steps']} steps "
                f"after a persist; restored {trial['restored_step']}, measured {trial['lost_measured_s']:.2f}s, "
                f"recompute corrected by {trial['recompute_correction_s']:+.2f}s; phases {trial['phases_s']})")
    except TrialFailed as exc:
        failures.append(f"requeue: {exc}")
        log(f"FAILED: requeue: {exc}")
    finally:
        if chain.group is not None:
            chain.group.kill_all()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hot_update", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one trial each (about three minutes)")
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs)")
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else FULL
    started = time.monotonic()
    failures: list[str] = []
    work = scratch_dir("keel-bench-hot-update-")
    log(f"hot-update benchmark ({mode.name}); scratch {work}")
    result: dict[str, Any] = {"mode": mode.name}
    try:
        servers = Servers(log=log, prefix="keel-bench-hot-update-servers-")
        servers.start()
        try:
            result["inplace"] = asyncio.run(inplace_run(mode, servers, work / "keel", failures))
        finally:
            servers.stop()
        result["requeue"] = requeue_run(mode, work / "requeue", failures)
    finally:
        if args.keep or failures:
            log(f"kept the scratch folder {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    inplace = [t["lost_s"] for t in result["inplace"]["trials"]]
    requeue = [t["lost_s"] for t in result["requeue"]["trials"]]
    result["inplace_s"] = round(statistics.mean(inplace), 3) if inplace else None
    result["requeue_s"] = round(statistics.mean(requeue), 3) if requeue else None
    result["ratio"] = round(result["requeue_s"] / result["inplace_s"], 2) if inplace and requeue else None
    result["target_ratio"] = TARGET_RATIO
    result["met"] = result["ratio"] is not None and result["ratio"] >= TARGET_RATIO
    result["failures"] = failures
    result["duration_s"] = round(time.monotonic() - started, 1)
    print(f"time to new code: in place {result['inplace_s']} s, requeue {result['requeue_s']} s, ratio "
          f"{result['ratio']} (target >= {TARGET_RATIO:g}: {'met' if result['met'] else 'NOT met'}); "
          f"{result['duration_s']} s in all")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
