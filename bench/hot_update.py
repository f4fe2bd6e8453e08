"""Time to put a new code version into a running job: Keel in place against a full requeue.

    python -m bench.hot_update [--quick | --smoke] [--json PATH] [--keep]

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
- **Requeue, checkpointed at the deploy** (the primary baseline, ``requeue_s``): what a careful operator
  does with plain torchrun tooling. The job runs with ``--save-on-sigterm`` (Megatron's
  ``--exit-signal-handler``); at the order the bench sends SIGTERM to the 4 launchers (as ``scancel`` or a
  preemption does), torchrun forwards it to its ranks, the ranks agree on the step in one all-reduce and
  persist it; once rank 0 reports the save (every rank's file fsynced) the bench stops what is left at
  once (SIGKILL) and starts the job afresh on the new code (4 new torchrun launchers, new ranks, a new
  rendezvous), which restores that step: nothing to recompute. Save, then requeue: the ranks would exit
  cleanly by themselves, but their teardown (barrier, process groups, interpreter exit) took 4.4 s more
  on this 2-core machine, a cost an operator need not wait for once the save is durable. Phases
  (``checkpointed_requeue_phases``): save, stop, restart, setup and restore, recompute.
- **Requeue at a crash** (``requeue_sigkill_s``, the previous primary figure): at the order every process
  is SIGKILLed and the job starts afresh from the persistent tier, written every N steps with N from
  Young's formula sqrt(2 C MTBF) / step time (C measured in the same run, MTBF 3 h, as in
  ``bench.recovery``). Deploy times fall at stratified offsets over that interval (trial i of n at
  (i + 1/2) / n x N steps after a persist), so the mean recomputation is that of a uniform deploy time
  (the restore point can be older or newer than planned, the previous trial's deploy save included:
  its recomputation is corrected to the planned offset, measured and corrected both reported). Nobody
  deploys this way on purpose; it is what an unplanned requeue costs.

Both requeues run on one job, which has ``--save-on-sigterm`` throughout (its per-step all-reduce is
that tooling's cost), trial i of each one after the other. The requeued job runs the same workload
module: the versions differ by a comment, and a requeue's cost does not depend on it. No scheduler queue,
pod creation or image pull is added (see docs/benchmarks.md: they dominate at scale).

``--quick`` (about three minutes): one trial each. ``--smoke`` (under a minute;
``tests/integration/test_bench_smoke.py`` runs it): the same code on a 2-node job (DP 2 x PP 2), one in-place
deploy and one checkpointed requeue, the calibration over 3 persists; the requeue at a crash is not run (the
JSON's ``skipped`` says so) and the target is not judged (``met`` is null). Target: in place >= 5x faster than the checkpointed
requeue (``ratio`` = requeue_s / inplace_s, means; ``ratio_sigkill`` against the requeue at a crash).
JSON keys: ``inplace_s``, ``requeue_s``, ``ratio``, ``requeue_sigkill_s``, ``ratio_sigkill``, every trial,
and the run's provenance (commit, date, cores, CPU model, load average at start and end, command).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import _torchrun_group as tg  # noqa: E402
from bench._servers import BENCH_OPERATOR, Servers, scratch_dir  # noqa: E402
from bench.recovery import (  # noqa: E402
    FULL,
    JOB_ID,
    QUICK,
    SMOKE,
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
    host_facts,
    log,
    relaunch,
    step_lines,
    wait_steady,
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
    since = now_utc()
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
                          + "\n  ".join(stack.tail(since)))
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


def checkpointed_requeue_phases(order_at: float, saved_at: float | None, gone_at: float, main_at: float | None,
                                resumed_at: float | None, back_at: float | None) -> dict[str, float | None]:
    """A deploy by checkpoint and requeue, split at its marks: ``save`` (SIGTERM forwarded, the ranks agree on
    the step and persist it: rank 0's ``saved step`` line), ``stop`` (what is left of the job killed),
    ``restart`` (4 new launchers, new interpreters, ``import
    torch``: until rank 0's ``main``), ``setup_and_restore`` (rendezvous, process groups, model, restore:
    until the first step began), ``recompute`` (0 when the restored step is the deploy's or later). The
    phases add up to the time to new code, ``back_at - order_at``."""
    marks = {"fault": order_at, "saved": saved_at, "gone": gone_at, "main": main_at, "resumed": resumed_at,
             "back": back_at}
    return _phases(marks, ("save", "saved"), ("stop", "gone"), ("restart", "main"), ("setup_and_restore", "resumed"),
                   ("recompute", "back"))


def requeue_checkpointed_trial(chain: Chain, timeout_s: float = 240.0) -> dict[str, Any]:
    """The deploy a careful operator does without Keel: SIGTERM the job (it saves the step it is at), stop
    what is left once the save is durable, start the job afresh on the new code from that save."""
    group = chain.group
    assert group is not None
    wait_steady(group, 0.0)
    order_at = time.time()
    group.terminate()
    deadline = time.monotonic() + 60.0  # torchrun's grace is 30 s, then it SIGKILLs its workers
    saved: list[Any] = []
    while not saved and time.monotonic() < deadline:
        saved = [m for m in map(tg.SAVED.match, (line.text for line in group.lines(order_at))) if m]
        time.sleep(0.01)
    group.kill_all()  # the save is on disk (every rank fsynced, then the all-reduce): the teardown is not waited for
    gone_at = time.time()
    if not saved:
        raise TrialFailed(f"no 'saved step' line within 60 s of SIGTERM; {chain.where()}")
    s_d, _ = _last_before(step_lines([line.text for line in group.lines() if line.at <= order_at]))
    saved_step, saved_at = int(saved[-1].group(1)), float(saved[-1].group(2))
    new = chain.launch()  # the new code (a scheduler would start the resubmitted job now)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        back = back_from([line.text for line in new.lines()], s_d)
        if back.back_at is not None:
            break
        if len(new.exited()) >= len(new.launchers):
            raise TrialFailed(f"every requeued launcher exited {new.exited()}; {chain.where()}")
        time.sleep(0.05)
    else:
        raise TrialFailed(f"the requeued job did not get back to step {s_d} within {timeout_s:.0f}s; {chain.where()}")
    phases = checkpointed_requeue_phases(order_at, saved_at, gone_at, back.main_at, back.resumed_at, back.back_at)
    return {"s_d": s_d, "saved_step": saved_step, "restored_step": back.restored, "restore_s": back.restore_s,
            "lost_s": round(back.back_at - order_at, 3), "phases_s": phases}


def requeue_run(mode: Mode, work: Path, failures: list[str], sigkill: bool = True) -> dict[str, Any]:
    """Both requeues on one job, trial i of each in turn (``sigkill`` False: the checkpointed one only)."""
    out: dict[str, Any] = {"trials": [], "sigkill_trials": []}
    try:
        calibration, cal_chain = calibrate(work, mode.calibration_persists, mode.nodes)
    except TrialFailed as exc:
        failures.append(f"calibration: {exc}")
        log(f"FAILED: calibration: {exc}")
        return out
    n, raw, interval_s = young(calibration["save_cost_s"], calibration["step_time_s"])
    out.update(calibration=calibration, persist_every=n, young_interval_s=round(interval_s, 2))
    log(f"calibration: C = {calibration['save_cost_s'] * 1e3:.1f} ms, step {calibration['step_time_s'] * 1e3:.0f} ms; "
        f"Young (MTBF 3 h): every {n} steps")
    chain = Chain("requeue", work, n, 0, persist_dir=cal_chain.persist_dir, nodes=mode.nodes,
                  extra_args=("--save-on-sigterm",))
    try:
        out["relaunch"] = relaunch(cal_chain, chain)
        for i in range(mode.baseline_trials):
            if sigkill:
                trial = requeue_trial(chain, i, mode.baseline_trials, n, calibration["step_time_s"])
                out["sigkill_trials"].append(trial)
                log(f"  requeue at a crash (SIGKILL) #{i + 1}: {trial['lost_s']:.2f}s to step {trial['s_d']} (planned "
                    f"{trial['offset_steps']} steps after a persist; restored {trial['restored_step']}, measured "
                    f"{trial['lost_measured_s']:.2f}s, recompute corrected by {trial['recompute_correction_s']:+.2f}s; "
                    f"phases {trial['phases_s']})")
            trial = requeue_checkpointed_trial(chain)
            out["trials"].append(trial)
            log(f"  requeue checkpointed at the deploy #{i + 1}: {trial['lost_s']:.2f}s to step {trial['s_d']} (saved "
                f"and restored {trial['restored_step']}; phases {trial['phases_s']})")
    except TrialFailed as exc:
        failures.append(f"requeue: {exc}")
        log(f"FAILED: requeue: {exc}")
    finally:
        if chain.group is not None:
            chain.group.kill_all()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hot_update", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="one trial each (about three minutes)")
    size.add_argument("--smoke", action="store_true",
                      help="under a minute: 2 nodes, one in-place deploy and one checkpointed requeue, no requeue at "
                           "a crash; a check that the bench works, the target not judged")
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs)")
    args = parser.parse_args(argv)
    mode = SMOKE if args.smoke else QUICK if args.quick else FULL
    started = time.monotonic()
    failures: list[str] = []
    work = scratch_dir("keel-bench-hot-update-")
    log(f"hot-update benchmark ({mode.name}); scratch {work}")
    result: dict[str, Any] = {"mode": mode.name, "load_average_at_start": os.getloadavg()}
    try:
        servers = Servers(log=log, prefix="keel-bench-hot-update-servers-")
        servers.start()
        try:
            result["inplace"] = asyncio.run(inplace_run(mode, servers, work / "keel", failures))
        finally:
            servers.stop()
        result["requeue"] = requeue_run(mode, work / "requeue", failures, sigkill=not args.smoke)
    finally:
        if args.keep or failures:
            log(f"kept the scratch folder {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    inplace = [t["lost_s"] for t in result["inplace"]["trials"]]
    result["inplace_s"] = round(statistics.mean(inplace), 3) if inplace else None
    for key, trials in (("", "trials"), ("_sigkill", "sigkill_trials")):
        requeue = [t["lost_s"] for t in result["requeue"].get(trials, [])]
        result[f"requeue{key}_s"] = round(statistics.mean(requeue), 3) if requeue else None
        result[f"ratio{key}"] = round(result[f"requeue{key}_s"] / result["inplace_s"], 2) if inplace and requeue else None
    result["requeue_method"] = ("SIGTERM to the launchers at the deploy: the ranks persist the step they are at and "
                                "exit; the job restarts afresh on the new code from it (--save-on-sigterm)")
    result["requeue_sigkill_method"] = ("every process SIGKILLed at the deploy; the job restarts afresh from the "
                                        "periodic persistent checkpoint (Young's interval), recomputing the steps since")
    result["target_ratio"] = TARGET_RATIO
    # A smoke run's 2-node job on a loaded machine says nothing about the target: not judged (null).
    result["met"] = None if args.smoke else result["ratio"] is not None and result["ratio"] >= TARGET_RATIO
    result["skipped"] = ({"requeue_sigkill": "the requeue at a crash (SIGKILL) is not run in the smoke run: "
                                             "requeue_sigkill_s and ratio_sigkill are null"} if args.smoke else {})
    result["failures"] = failures
    result["duration_s"] = round(time.monotonic() - started, 1)
    result.update(host_facts(list(argv if argv is not None else sys.argv[1:]), "bench.hot_update"))
    print(f"time to new code: in place {result['inplace_s']} s; requeue checkpointed at the deploy "
          f"{result['requeue_s']} s, ratio {result['ratio']} (target >= {TARGET_RATIO:g}: "
          f"{'not judged in a smoke run' if result['met'] is None else 'met' if result['met'] else 'NOT met'}); requeue at a crash (SIGKILL) {result['requeue_sigkill_s']} s, "
          f"ratio {result['ratio_sigkill']}; {result['duration_s']} s in all; load average "
          f"{result['load_average_at_start']} at start, {result['load_average_at_end']} at the end")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
