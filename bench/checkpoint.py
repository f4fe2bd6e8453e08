"""What checkpointing every step costs a training job: Keel against the baselines, in one run.

    python -m bench.checkpoint [--quick] [--json PATH] [--size bench] [--variants a,b,...]

Same model, same machine, one variant after the other (never in parallel), each in a fresh process of
one rank (a gloo process group of one, the model in DDP, ``--threads`` intra-op threads for every
variant: with one, the machine's second core is what background checkpoint work gets, as a GPU job's
spare host cores would), checkpointing after every optimizer step (``bench/_ckpt_worker.py`` says
exactly what is timed):

- ``none``: no checkpoint, the reference throughput;
- ``torch_save``: synchronous ``torch.save`` of the full state (model + optimizer) to a local file;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` to a local folder (the previous save's
  future is awaited before the next, as DCP requires);
- ``dlrover``: DLRover's Flash Checkpoint, ``DdpCheckpointer.save_checkpoint(...,
  StorageType.MEMORY)`` every step (a synchronous copy into a shared-memory segment; its saver process
  is started by the engine itself under plain torchrun). No peer copy. Benchmark-only dependency
  (``dlrover[torch]``); skipped, with the reason printed, when it is not installed;
- ``keel_nobackup``: Keel's ``Checkpointer`` alone (a snapshot into shared-memory slots every step,
  copied off the critical path): the like-for-like comparison with DLRover;
- ``keel``: Keel as shipped: the same, plus the node agent's duties in a separate process
  (``bench/_ckpt_agent.py``): every committed step sent to a backup peer's ``ShardStore`` over gRPC,
  the persistent tier written every ``--persist-every`` steps (default 10: the broker's floor for
  Young's K, i.e. the most often it ever schedules it).

How throughput is compared: a machine shared with other work drifts by tens of percent over a
minute, more than the effect measured. So each variant's process interleaves blocks of ``--block``
checkpointed steps with blocks of as many plain steps (ABBA order), and retention = steps/s of its
checkpointed blocks ÷ steps/s of its plain blocks; overhead = the extra wall time per step (per
round of one checkpointed and one plain block; the median over the rounds, robust to a burst of
outside load in one block). A
checkpointed block ends with one plain step (the last save's background work overlaps it as every
save's overlaps the next step) and then waits, timed, for what is still running (DCP's future,
Keel's copy, and for Keel as shipped the agent's transfer or persist still running: that wait is
charged in full although in steady state it would overlap the next steps, so it over-charges, never
under; the agent's CPU time is printed), so no checkpoint work escapes it. The ``none`` variant's two kinds of blocks are both plain: its "retention" is the noise
floor. Retention against the separate ``none`` run is printed too ("vs none").

Figures per variant: steps/s and throughput retention, per-step overhead (ms), blocking time of the
training thread in checkpointing (mean, p99), host memory per rank (growth of anonymous memory of
the rank and its children, plus the shared-memory files it keeps; for Keel as shipped plus the peer
backup its node holds for another rank). Restore per tier: Keel from its memory slot, from the peer
(gRPC fetch of the backup + load), from the persistent tier (its shard file, evicted from the page
cache first); every restore is the median of ``--restore-repeats`` (5) into a fresh model, checked
bitwise against the newest checkpoint, its verification included (Keel's memory figure: the rank
hashing the slot, not trusting the agent's inventory hash); the baselines' restores for comparison (``torch.load`` of the ``torch.save`` file, also
evicted first; DCP's ``load``; DLRover's load from its shared memory).

DLRover runs under ``torchrun`` (as its documentation has it: the engine forks its saver process from
local rank 0); the others are started directly with torchrun's environment for one rank (it saves a
second torch import per variant, and their process layout is otherwise the same).

Targets (this CPU machine): Keel throughput retention ≥ 95%; blocking ≥ 20× lower than torch.save and
≥ 3× lower than async_save; per-step overhead (wall time) of Keel without peer backup no higher than
DLRover's; restore from local memory ≥ 3× faster than from disk, and (verification included) no slower than
DLRover's from its shared memory. Printed as MET / NOT MET; the exit
status is 0 either way (1 only when a variant failed to run).

``--smoke`` (about 15 s): the tiny model, 2 + 2 steps, variants torch_save, dlrover (skipped, and said so,
when not installed) and keel, 2 restores per tier; it checks the bench runs and its figures are sane
(``tests/integration/test_bench_smoke.py``), targets are not judged. ``--quick`` (under two minutes on an idle machine): 10 + 10 steps in blocks of 5, which is indicative
only (its noise is several percent); the full run measures 60 + 60 in blocks of 10. ``--json PATH`` writes every figure (the keys listed in
``JSON_KEYS`` first, then the per-variant details).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from keel.infra.config import CheckpointSettings

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ORDER = ("none", "torch_save", "dcp_async", "dlrover", "keel_nobackup", "keel", "fsdp")
JSON_KEYS = (
    "retention", "blocking_ms_keel", "blocking_ms_torch_save", "blocking_ms_dcp_async", "blocking_ratio_vs_torch_save",
    "blocking_ratio_vs_dcp_async", "blocking_ms_dlrover", "overhead_ms_keel_nobackup", "overhead_ms_keel",
    "overhead_ms_dlrover", "restore_s_memory", "restore_s_dlrover_memory", "restore_s_peer", "restore_s_disk",
    "restore_verified", "host_bytes_per_rank", "blocking_ms_keel_fsdp", "blocking_ms_dcp_async_fsdp",
    "blocking_ratio_vs_dcp_async_fsdp", "overhead_ms_keel_fsdp", "overhead_ms_dcp_async_fsdp", "restore_s_keel_fsdp",
    "restore_s_dcp_fsdp", "restore_s_reshard",
)
TARGETS = {"retention": 0.95, "vs_torch_save": 20.0, "vs_dcp_async": 3.0, "restore_memory_vs_disk": 3.0}
# --smoke: seconds, not minutes; it checks that the bench runs end to end and its figures are sane, not the figures.
SMOKE_VARIANTS = ("torch_save", "dlrover", "keel", "fsdp")
FSDP_WORLD = 2  # ranks of the FSDP2 variant (bench._ckpt_fsdp): Keel and DCP async_save on the same sharded state
VARIANT_TIMEOUT_S = 600


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps (under two minutes)")
    p.add_argument("--smoke", action="store_true",
                   help="seconds: the tiny model, a few steps, variants torch_save,dlrover,keel (DLRover skipped when "
                        "not installed); for the test that keeps the bench from rotting, not for figures")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    p.add_argument("--size", default="bench", help="model size: bench (default, ~64 MB of state), tiny, small, medium")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, the same for every variant")
    p.add_argument("--steps", type=int, default=None, help="measured checkpointed steps per variant, and as "
                                                           "many plain ones (default 60, --quick 10)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured checkpointed steps before the measured ones "
                                                            "(default 5, --quick 2)")
    p.add_argument("--block", type=int, default=None, help="steps per block of the ABBA interleaving of checkpointed "
                                                           "and plain steps (default 10, --quick 5)")
    p.add_argument("--persist-every", type=int, default=10, help="keel: the persistent tier's K (steps)")
    p.add_argument("--variants", default=",".join(ORDER), help="comma-separated subset of " + ",".join(ORDER))
    p.add_argument("--restore-repeats", type=int, default=None,
                   help="restores timed per tier and variant, each into a fresh model (median reported; default 5, "
                        "--smoke 2)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folders")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        if args.size == "bench":
            args.size = "tiny"
        if args.variants == ",".join(ORDER):
            args.variants = ",".join(SMOKE_VARIANTS)
        args.steps = args.steps or 2
        args.warmup = args.warmup or 1
        args.block = args.block or 1
        args.restore_repeats = args.restore_repeats or 2
        args.persist_every = min(args.persist_every, 2)  # so that the disk tier is written, and restored
    args.steps = args.steps or (10 if args.quick else 60)
    args.warmup = args.warmup or (2 if args.quick else 5)
    args.block = args.block or (5 if args.quick else 10)
    args.restore_repeats = args.restore_repeats or 5
    if args.restore_repeats < 1:
        p.error(f"--restore-repeats must be at least 1, got {args.restore_repeats}")
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variant_list) - set(ORDER))
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(ORDER)}")
    return args


# -- running one variant ----------------------------------------------------------------------------


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = str(args.threads)
    env.setdefault("DLROVER_LOG_LEVEL", "WARNING")  # DLRover logs every save at INFO otherwise
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _sock_entries() -> set[str]:
    try:
        return set(os.listdir("/tmp/ckpt_sock"))
    except OSError:
        return set()


def run_variant(variant: str, tag: str, args: argparse.Namespace, scratch: Path, shm_root: Path) -> dict[str, Any]:
    out = scratch / f"{tag}.json"
    log_path = scratch / f"{tag}.log"
    work = scratch / tag
    node_dir = shm_root / tag / "node"
    work.mkdir(parents=True, exist_ok=True)
    worker_args = ["-m", "bench._ckpt_worker", "--variant", variant, "--out", str(out), "--size", args.size,
                   "--batch", str(args.batch), "--threads", str(args.threads), "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--block", str(args.block), "--scratch", str(work),
                   "--shm-dir", str(node_dir), "--restore-repeats", str(args.restore_repeats)]
    env = _env(args)
    if variant == "dlrover":
        # DLRover as documented: under torchrun (its engine then forks its saver process from local rank 0).
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *worker_args]
    else:
        # The others need no elastic agent: one rank with torchrun's environment (saves a second torch import).
        from keel.infra.embedded import free_port

        cmd = [sys.executable, *worker_args]
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    agent: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None
    agent_log = scratch / f"{tag}.agent.log"
    shm_before, sock_before = _shm_entries(), _sock_entries()
    started = time.monotonic()
    try:
        if variant == "keel":
            ready, done = scratch / f"{tag}.agent-ready.json", scratch / f"{tag}.agent-done.json"
            persist_root = work / "persist"
            with open(agent_log, "wb") as f:
                agent = subprocess.Popen(
                    [sys.executable, "-m", "bench._ckpt_agent", "--node-dir", str(node_dir),
                     "--peer-dir", str(shm_root / tag / "peer"), "--persist-root", str(persist_root),
                     "--persist-every", str(args.persist_every), "--ready", str(ready), "--done", str(done)],
                    cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 60
            while not ready.exists():
                if agent.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the node agent's checkpoint process did not start:\n{_tail(agent_log)}")
                time.sleep(0.05)
            cmd += ["--agent-ready", str(ready), "--agent-done", str(done), "--persist-root", str(persist_root)]
        with open(log_path, "wb") as f:
            # its own session: an interrupt of the bench ends the worker (and DLRover's saver) below, by pid
            worker = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        returncode = worker.wait(VARIANT_TIMEOUT_S)
        try:
            result = json.loads(out.read_text())
        except (OSError, ValueError):
            result = {"ok": False, "error": f"no result (exit status {returncode})"}
        if not result.get("ok"):
            result.setdefault("error", f"exit status {returncode}")
            result["log_tail"] = _tail(log_path)
    except subprocess.TimeoutExpired:
        result = {"ok": False, "error": f"timed out after {VARIANT_TIMEOUT_S}s", "log_tail": _tail(log_path)}
    except RuntimeError as exc:
        result = {"ok": False, "error": str(exc)}
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)  # the worker's own process group (torchrun, rank, saver)
            try:
                worker.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
        if agent is not None:
            agent.send_signal(signal.SIGINT)
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        # DLRover's shared-memory segment and local sockets outlive its processes: remove the ones this
        # run created (only those: the names that were not there before).
        for name in _shm_entries() - shm_before:
            if "ckpt_shm" in name:
                try:
                    os.unlink(f"/dev/shm/{name}")
                except OSError:
                    pass
        for name in _sock_entries() - sock_before:
            shutil.rmtree(f"/tmp/ckpt_sock/{name}", ignore_errors=True)
        shutil.rmtree(shm_root / tag, ignore_errors=True)
    result["wall_s"] = time.monotonic() - started
    return result


def run_fsdp(args: argparse.Namespace, scratch: Path, shm_root: Path) -> dict[str, Any]:
    """The FSDP2 variant: ``FSDP_WORLD`` gloo ranks of ``bench._ckpt_fsdp`` (Keel and DCP in the same run)."""
    from keel.infra.embedded import free_port

    out, work = scratch / "fsdp.json", scratch / "fsdp"
    work.mkdir(parents=True, exist_ok=True)
    env = _env(args)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(FSDP_WORLD),
               LOCAL_WORLD_SIZE=str(FSDP_WORLD))
    rounds = 1 if args.smoke else max(2, args.steps // args.block // 2)
    cmd = [sys.executable, "-m", "bench._ckpt_fsdp", "--out", str(out), "--size", args.size, "--batch",
           str(args.batch), "--rounds", str(rounds), "--block", str(args.block), "--warmup", str(args.warmup),
           "--scratch", str(work), "--shm-dir", str(shm_root / "fsdp" / "node"),
           "--restore-repeats", str(args.restore_repeats)]
    started = time.monotonic()
    procs: list[subprocess.Popen] = []
    logs = [scratch / f"fsdp.rank{r}.log" for r in range(FSDP_WORLD)]
    try:
        for rank in range(FSDP_WORLD):
            with open(logs[rank], "wb") as f:
                procs.append(subprocess.Popen(cmd, cwd=REPO, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                              stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + VARIANT_TIMEOUT_S
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
        try:
            result = json.loads(out.read_text())
        except (OSError, ValueError):
            result = {"ok": False, "error": f"no result (exit statuses {codes})"}
        if any(codes):
            result = {"ok": False, "error": f"exit statuses {codes}"}
    except subprocess.TimeoutExpired:
        result = {"ok": False, "error": f"timed out after {VARIANT_TIMEOUT_S}s"}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(shm_root / "fsdp", ignore_errors=True)
    if not result.get("ok"):
        result["log_tail"] = "\n".join(_tail(log) for log in logs)
    result["wall_s"] = time.monotonic() - started
    return result


# -- figures ----------------------------------------------------------------------------------------


def _get(d: dict[str, Any] | None, *keys: str) -> Any:
    for key in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def figures(results: dict[str, dict[str, Any]], args: argparse.Namespace, skipped: dict[str, str]) -> dict[str, Any]:
    ok = {tag: r for tag, r in results.items() if r.get("ok")}
    none = ok.get("none")
    # The separate no-checkpoint run (its "checkpointed" blocks checkpoint nothing: every step of it is plain).
    ref_sps = statistics.fmean([none["steps_per_s"], none["plain_steps_per_s"]]) if none else None
    ref_step_ms = 1e3 / ref_sps if ref_sps else None
    per: dict[str, Any] = {}
    for tag in ORDER:
        r = ok.get(tag)
        if r is None or tag == "fsdp":  # its own keys (_fsdp_figures): two ranks, not the single-rank table
            continue
        per[tag] = {
            "steps_per_s": r["steps_per_s"],
            "plain_steps_per_s": r["plain_steps_per_s"],
            "retention": r["retention"],
            "overhead_ms": r["overhead_ms"],
            "overhead_ms_pooled": r.get("overhead_ms_pooled"),
            "overhead_ms_per_round": r.get("overhead_ms_per_round"),
            "retention_vs_none_run": _ratio(r["steps_per_s"], ref_sps),
            "step_ms_mean": r["step_ms"]["mean"],
            "step_ms_p99": r["step_ms"]["p99"],
            "plain_step_ms_mean": r["plain_step_ms"]["mean"],
            "compute_ms_mean": r["compute_ms"]["mean"],
            "drain_ms_mean": r["drain_ms"]["mean"],
            "blocking_ms_mean": r["blocking_ms"]["mean"],
            "blocking_ms_p99": r["blocking_ms"]["p99"],
            "host_bytes_per_rank": r["host_bytes_per_rank"],
            "host_anon_bytes": r["host_anon_bytes"],
            "host_shm_bytes": r["host_shm_bytes"],
            "launcher": r.get("launcher"),
        }
    keel, nob = ok.get("keel", {}), ok.get("keel_nobackup", {})
    agent = keel.get("agent") or {}
    blocking = lambda tag: _get(per, tag, "blocking_ms_mean")  # noqa: E731
    out: dict[str, Any] = {
        "retention": _get(per, "keel", "retention"),
        "blocking_ms_keel": blocking("keel"),
        "blocking_ms_torch_save": blocking("torch_save"),
        "blocking_ms_dcp_async": blocking("dcp_async"),
        "blocking_ratio_vs_torch_save": _ratio(blocking("torch_save"), blocking("keel")),
        "blocking_ratio_vs_dcp_async": _ratio(blocking("dcp_async"), blocking("keel")),
        "blocking_ms_dlrover": blocking("dlrover"),
        "overhead_ms_keel_nobackup": _get(per, "keel_nobackup", "overhead_ms"),
        "overhead_ms_keel": _get(per, "keel", "overhead_ms"),
        "overhead_ms_dlrover": _get(per, "dlrover", "overhead_ms"),
        "restore_s_memory": keel.get("restore_s_memory", nob.get("restore_s_memory")),
        "restore_s_dlrover_memory": _get(ok, "dlrover", "restore_s_dlrover_memory"),
        # DLRover's restore with its segment attached anew, as a restarted rank does (the figure above is
        # the process that saved, whose mapping of the segment is already there): for comparison only.
        "restore_s_dlrover_memory_reattached": _get(ok, "dlrover", "restore_s_dlrover_memory_reattached"),
        "restore_s_peer": keel.get("restore_s_peer"),
        "restore_s_disk": keel.get("restore_s_disk"),
        # Per restore measured: whether every timed restore came back bitwise equal (weights, step), its
        # verification included in the time. None: not measured (variant skipped or failed).
        "restore_verified": {name: value for name, value in (
            ("keel_memory", keel.get("restore_memory_ok", nob.get("restore_memory_ok"))),
            ("keel_peer", keel.get("restore_peer_ok")), ("keel_disk", keel.get("restore_disk_ok")),
            ("torch_load", _get(ok, "torch_save", "restore_torch_load_ok")),
            ("dcp", _get(ok, "dcp_async", "restore_dcp_ok")),
            ("dlrover_memory", _get(ok, "dlrover", "restore_dlrover_ok")),
            ("dlrover_memory_reattached", _get(ok, "dlrover", "restore_dlrover_reattached_ok"))) if value is not None},
        # Keel as shipped, per rank: its process's growth + its slots + the backup its node holds for a peer
        # rank (every node holds one backup per peer rank, so per rank it is one shard) + the growth of
        # the node agent's process (one rank per node here, so all of it is this rank's).
        "host_bytes_per_rank": (keel["host_bytes_per_rank"] + int(agent.get("peer_backup_bytes") or 0)
                                + max(0, int(agent.get("agent_anon_bytes") or 0))) if keel else None,
        # -- extras
        "retention_keel_nobackup": _get(per, "keel_nobackup", "retention"),
        "retention_dlrover": _get(per, "dlrover", "retention"),
        "retention_torch_save": _get(per, "torch_save", "retention"),
        "retention_dcp_async": _get(per, "dcp_async", "retention"),
        "retention_vs_none_run": {tag: p["retention_vs_none_run"] for tag, p in per.items()},
        "blocking_ms_keel_nobackup": blocking("keel_nobackup"),
        "blocking_p99_ms": {tag: p["blocking_ms_p99"] for tag, p in per.items()},
        "blocking_ratio_vs_dlrover": _ratio(blocking("dlrover"), blocking("keel")),
        "overhead_ms_torch_save": _get(per, "torch_save", "overhead_ms"),
        "overhead_ms_dcp_async": _get(per, "dcp_async", "overhead_ms"),
        "restore_s_memory_nobackup": nob.get("restore_s_memory"),
        "restore_s_torch_load": _get(ok, "torch_save", "restore_s_torch_load"),
        "restore_s_dcp": _get(ok, "dcp_async", "restore_s_dcp"),
        "restore_s_memory_agent_verified": keel.get("restore_s_memory_agent_verified",
                                                    nob.get("restore_s_memory_agent_verified")),
        "restore_verify_s_memory_agent": keel.get("restore_verify_s_memory", nob.get("restore_verify_s_memory")),
        "restore_s_runs": {k.removeprefix("restore_s_").removesuffix("_runs"): v for r in ok.values()
                           for k, v in r.items() if k.startswith("restore_s_") and k.endswith("_runs")},
        "restore_memory_vs_dlrover": _ratio(keel.get("restore_s_memory", nob.get("restore_s_memory")),
                                            _get(ok, "dlrover", "restore_s_dlrover_memory")),
        "agent_sync_ms_keel": _get(ok, "keel", "agent_sync_ms", "mean"),
        "restore_peer_fetch_s": keel.get("restore_peer_fetch_s"),
        "restore_disk_evicted": keel.get("restore_disk_evicted"),
        # Why DLRover's memory restore is faster, measured: its optimizer adopts views of the checkpoint
        # segment, which the next step then rewrites; Keel's restore copies, and its slot stays intact.
        "restore_dlrover_state_in_checkpoint": _get(ok, "dlrover", "dlrover_restored_state_in_checkpoint"),
        "restore_dlrover_checkpoint_changed_by_next_step": _get(ok, "dlrover",
                                                                "dlrover_checkpoint_changed_by_next_step"),
        "restore_keel_slot_changed_by_next_step": keel.get("restore_slot_changed_by_next_step",
                                                           nob.get("restore_slot_changed_by_next_step")),
        "restore_memory_vs_disk": _ratio(keel.get("restore_s_disk"), keel.get("restore_s_memory", nob.get("restore_s_memory"))),
        "host_bytes_per_rank_by_variant": {tag: p["host_bytes_per_rank"] for tag, p in per.items()},
        **_fsdp_figures(ok.get("fsdp")),
        "keel_agent": agent or None,
        # Keel's own per-snapshot figures (Checkpointer.stats(), seconds; warmup snapshots included): a
        # cross-check of the blocking time measured here, and the background copy / hash times.
        "keel_stats": keel.get("keel_stats"),
        "keel_nobackup_stats": nob.get("keel_stats"),
        "reference_steps_per_s": ref_sps,
        "reference_step_ms": ref_step_ms,
        "noise_floor_retention": _get(per, "none", "retention"),
        "state_bytes": next((r.get("state_bytes") for r in ok.values() if r.get("state_bytes")), None),
        "variants": per,
        "skipped": skipped,
        "failed": {tag: r.get("error") for tag, r in results.items() if not r.get("ok")},
        "config": {"mode": "smoke" if args.smoke else "quick" if args.quick else "full", "restore_repeats": args.restore_repeats, "size": args.size, "batch": args.batch,
                   "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
                   "persist_every": args.persist_every, "cpus": os.cpu_count(), "world_size": 1},
        "versions": _versions(),
    }
    return out


def _fsdp_figures(r: dict[str, Any] | None) -> dict[str, Any]:
    """The FSDP2 variant's keys (None when it did not run). ``restore_s_reshard``: Keel's ``load_resharded`` of every
    rank's slot into another layout, beside ``restore_s_dcp_reshard``, DCP's load of its own save into it."""
    r = r or {}
    keys = ("blocking_ms_keel_fsdp", "blocking_ms_dcp_async_fsdp", "blocking_ms_keel_fsdp_median",
            "blocking_ms_dcp_async_fsdp_median", "overhead_ms_keel_fsdp", "overhead_ms_dcp_async_fsdp",
            "restore_s_keel_fsdp", "restore_s_dcp_fsdp", "restore_fsdp_bitwise", "restore_fsdp_bitwise_keel",
            "restore_fsdp_bitwise_dcp", "plain_step_ms", "state_bytes_per_rank", "world_size")
    out = {(k if "fsdp" in k else f"fsdp_{k}"): r.get(k) for k in keys}
    out["blocking_ratio_vs_dcp_async_fsdp"] = _ratio(r.get("blocking_ms_dcp_async_fsdp"), r.get("blocking_ms_keel_fsdp"))
    out["blocking_ratio_vs_dcp_async_fsdp_median"] = _ratio(r.get("blocking_ms_dcp_async_fsdp_median"),
                                                            r.get("blocking_ms_keel_fsdp_median"))
    for key in ("restore_s_reshard", "restore_s_dcp_reshard", "restore_reshard_bitwise_keel", "restore_reshard_bitwise_dcp"):
        out[key] = r.get(key)  # the same step into another layout (an HSDP mesh), from every rank's shard
    out["fsdp_measured_by_rank"] = r.get("measured_by_rank")
    return out


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for dist in ("torch", "dlrover", "grpcio"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _fmt(value: Any, spec: str = ".1f", unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and value != value:
        return "nan"
    return f"{value:{spec}}{unit}"


def report(fig: dict[str, Any], results: dict[str, dict[str, Any]]) -> list[tuple[str, bool | None, str]]:
    per = fig["variants"]
    mb = lambda b: None if b is None else b / 1e6  # noqa: E731
    state = fig.get("state_bytes")
    print()
    print(f"model+optimizer state: {_fmt(mb(state), '.1f', ' MB')}   no-checkpoint run: "
          f"{_fmt(fig['reference_steps_per_s'], '.3f', ' steps/s')} ({_fmt(fig['reference_step_ms'], '.1f', ' ms/step')}); "
          f"noise floor (its two kinds of blocks, both plain): retention {_fmt(fig['noise_floor_retention'], '.1%')}")
    print("retention and overhead: checkpointed vs plain blocks interleaved in the same process (ABBA); "
          "'vs none' = against the separate no-checkpoint run")
    print()
    header = f"{'variant':<15}{'steps/s':>9}{'plain':>8}{'retention':>11}{'vs none':>9}{'overhead ms':>13}" \
             f"{'blocking ms':>13}{'p99':>8}{'host MB/rank':>14}"
    print(header)
    print("-" * len(header))
    for tag in ORDER:
        p = per.get(tag)
        if p is None:
            why = fig["skipped"].get(tag) or fig["failed"].get(tag) or (
                "two ranks: see the FSDP2 target below" if tag == "fsdp" else None)
            if why:
                print(f"{tag:<15}  ({why})")
            continue
        host = p["host_bytes_per_rank"]
        if tag == "keel" and fig.get("host_bytes_per_rank") is not None:
            host = fig["host_bytes_per_rank"]
        print(f"{tag:<15}{p['steps_per_s']:>9.3f}{p['plain_steps_per_s']:>8.3f}{_fmt(p['retention'], '.1%'):>11}"
              f"{_fmt(p['retention_vs_none_run'], '.1%'):>9}{_fmt(p['overhead_ms'], '+.1f'):>13}"
              f"{p['blocking_ms_mean']:>13.2f}{p['blocking_ms_p99']:>8.2f}{_fmt(mb(host), '.1f'):>14}")
    print()
    print(f"restore (median of {fig['config']['restore_repeats']} into a fresh model + optimizer each; "
          "Keel's figures include their digest check):")
    rows = [("keel, local memory slot", fig["restore_s_memory"]), ("keel, peer (gRPC fetch + load)", fig["restore_s_peer"]),
            ("keel, persistent tier (disk)", fig["restore_s_disk"]), ("torch.load of the torch.save file", fig["restore_s_torch_load"]),
            ("DCP load", fig["restore_s_dcp"]), ("DLRover, shared memory", fig["restore_s_dlrover_memory"]),
            ("DLRover, segment attached anew", fig.get("restore_s_dlrover_memory_reattached"))]
    for name, value in rows:
        print(f"  {name:<36}{_fmt(None if value is None else value * 1e3, '.1f', ' ms'):>12}")
    agent = fig.get("keel_agent")
    if agent:
        print()
        persists = agent.get("persists") or []
        write_s = statistics.fmean(p["write_s"] for p in persists) if persists else None
        print(f"keel's node agent (as shipped): {agent.get('sends')} backups sent to the peer, every "
              f"{agent.get('backup_every_steps')} step(s) at the end (the broker's interval for a "
              f"{CheckpointSettings().backup_max_duty:.0%} transfer duty, rounds at least the broker's minimum period apart; "
              f"{_fmt(agent.get('send_s_mean'), '.3f', ' s')} each, {_fmt(agent.get('send_mb_per_s_mean'), '.0f', ' MB/s')}), "
              f"{len(persists)} persists (write {_fmt(write_s, '.3f', ' s')} each), "
              f"agent CPU {_fmt(agent.get('agent_cpu_s'), '.1f', ' s')} (sender and the peer's receiver: on a cluster every "
              f"node does both)")
        keel = per.get("keel") or {}
        print(f"keel host memory per rank: rank process {_fmt(mb(keel.get('host_anon_bytes')), '.1f', ' MB')} + slots "
              f"{_fmt(mb(keel.get('host_shm_bytes')), '.1f', ' MB')} + peer backup held "
              f"{_fmt(mb(agent.get('peer_backup_bytes')), '.1f', ' MB')}"
              f" + agent process {_fmt(mb(agent.get('agent_anon_bytes')), '.1f', ' MB')}")
    floor = fig.get("noise_floor_retention")
    if floor is not None and abs(floor - 1) > 0.03:
        print(f"\nWARNING: the no-checkpoint run's two kinds of blocks differ by {abs(floor - 1):.0%}: the machine was busy; "
              "differences of that size are noise")
    checks: list[tuple[str, bool | None, str]] = []

    def check(name: str, value: float | None, ok: bool | None, detail: str) -> None:
        checks.append((name, None if value is None else ok, detail))

    r = fig["retention"]
    check("throughput retention ≥ 95% (keel as shipped)", r, r is not None and r >= TARGETS["retention"],
          f"{_fmt(r, '.1%')} (without peer backup: {_fmt(fig['retention_keel_nobackup'], '.1%')})")
    v = fig["blocking_ratio_vs_torch_save"]
    check("blocking ≥ 20× lower than torch.save", v, v is not None and v >= TARGETS["vs_torch_save"],
          f"{_fmt(v, '.1f', '×')} ({_fmt(fig['blocking_ms_torch_save'], '.2f')} ms vs {_fmt(fig['blocking_ms_keel'], '.2f')} ms)")
    v = fig["blocking_ratio_vs_dcp_async"]
    check("blocking ≥ 3× lower than DCP async_save", v, v is not None and v >= TARGETS["vs_dcp_async"],
          f"{_fmt(v, '.1f', '×')} ({_fmt(fig['blocking_ms_dcp_async'], '.2f')} ms vs {_fmt(fig['blocking_ms_keel'], '.2f')} ms)")
    a, b = fig["overhead_ms_keel_nobackup"], fig["overhead_ms_dlrover"]
    check("per-step overhead ≤ DLRover Flash Checkpoint (no peer backup)", None if a is None or b is None else a,
          a is not None and b is not None and a <= b,
          f"keel {_fmt(a, '+.1f', ' ms')} vs DLRover {_fmt(b, '+.1f', ' ms')} per step "
          f"(keel as shipped {_fmt(fig['overhead_ms_keel'], '+.1f', ' ms')})")
    v = fig["restore_memory_vs_disk"]
    ms = lambda x: None if x is None else x * 1e3  # noqa: E731
    check("restore from local memory ≥ 3× faster than from disk", v, v is not None and v >= TARGETS["restore_memory_vs_disk"],
          f"{_fmt(v, '.1f', '×')} (memory {_fmt(ms(fig['restore_s_memory']), '.1f', ' ms')}, "
          f"disk {_fmt(ms(fig['restore_s_disk']), '.1f', ' ms')}"
          f"{'' if fig.get('restore_disk_evicted') in (None, True) else ', page cache NOT evicted'})")
    print("after a memory restore and one training step: DLRover's optimizer state inside its checkpoint "
          f"segment {_fmt(fig['restore_dlrover_state_in_checkpoint'], '.0%')}, its checkpoint changed "
          f"{fig['restore_dlrover_checkpoint_changed_by_next_step']}; Keel's slot changed "
          f"{fig['restore_keel_slot_changed_by_next_step']}")
    a, b = fig["restore_s_memory"], fig["restore_s_dlrover_memory"]
    check("restore from local memory (verified) no slower than DLRover's", None if a is None or b is None else a,
          a is not None and b is not None and a <= b,
          f"keel {_fmt(ms(a), '.1f', ' ms')} (XXH3-128 included) vs DLRover {_fmt(ms(b), '.1f', ' ms')} (no check; "
          f"its segment attached anew, as after a restart: "
          f"{_fmt(ms(fig.get('restore_s_dlrover_memory_reattached')), '.1f', ' ms')}); "
          f"keel trusting the agent's hash {_fmt(ms(fig['restore_s_memory_agent_verified']), '.1f', ' ms')}, "
          f"that hash alone {_fmt(ms(fig['restore_verify_s_memory_agent']), '.1f', ' ms')}")
    v = fig["blocking_ratio_vs_dcp_async_fsdp"]
    check("FSDP2: blocking ≥ 3× lower than DCP async_save", v, v is not None and v >= TARGETS["vs_dcp_async"],
          f"{_fmt(v, '.1f', '×')} ({_fmt(fig['blocking_ms_dcp_async_fsdp'], '.2f')} ms vs "
          f"{_fmt(fig['blocking_ms_keel_fsdp'], '.2f')} ms per step, the slower of {fig['fsdp_world_size']} ranks; "
          f"medians {_fmt(fig['blocking_ratio_vs_dcp_async_fsdp_median'], '.1f', '×')}; "
          f"overhead {_fmt(fig['overhead_ms_dcp_async_fsdp'], '+.1f')} vs {_fmt(fig['overhead_ms_keel_fsdp'], '+.1f')} ms "
          f"per step; restore, same layout {_fmt(ms(fig['restore_s_dcp_fsdp']), '.1f')} vs "
          f"{_fmt(ms(fig['restore_s_keel_fsdp']), '.1f', ' ms')}, bitwise: keel {fig['restore_fsdp_bitwise_keel']}, "
          f"DCP {fig['restore_fsdp_bitwise_dcp']})")
    a, b = fig["restore_s_reshard"], fig["restore_s_dcp_reshard"]
    check("FSDP2: restore with resharding onto another layout, bitwise (restore_s_reshard, beside DCP's)", a,
          a is not None and fig["restore_reshard_bitwise_keel"] is True,
          f"keel {_fmt(ms(a), '.1f', ' ms')} (every rank's slot read and verified) vs DCP {_fmt(ms(b), '.1f', ' ms')}; "
          f"bitwise: keel {fig['restore_reshard_bitwise_keel']}, DCP {fig['restore_reshard_bitwise_dcp']}")
    print()
    if fig["config"]["mode"] == "smoke":
        print("targets: not judged in a smoke run (tiny model, a few steps: it proves the bench runs, not the figures)")
        return checks
    print("targets:")
    for name, ok, detail in checks:
        verdict = "n/a (not measured)" if ok is None else ("MET" if ok else "NOT MET")
        print(f"  {verdict:<8} {name}: {detail}")
    return checks


# -- main -------------------------------------------------------------------------------------------


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # clean up (workers, agent, scratch) on SIGTERM as on ^C
    started = time.monotonic()
    skipped: dict[str, str] = {}
    if "dlrover" in args.variant_list and importlib.util.find_spec("dlrover") is None:
        skipped["dlrover"] = "not installed: pip install 'dlrover[torch]' (benchmark-only; `make bench-checkpoint` does)"
        log("DLRover is not installed: its variant is skipped, and with it the restore comparison against it "
            "(benchmark-only dependency; `make bench-checkpoint` installs it)")
    if any(v.startswith("keel") for v in args.variant_list) and importlib.util.find_spec("keel.sdk.checkpoint") is None:
        for v in ("keel_nobackup", "keel"):
            skipped[v] = "keel.sdk.checkpoint is not available"
    scratch = Path(tempfile.mkdtemp(prefix="keel-bench-ckpt-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    shm_root = Path(tempfile.mkdtemp(prefix="keel-bench-ckpt-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    plan = [v for v in ORDER if v in args.variant_list and v not in skipped]
    tags = [(v, v) for v in plan]
    log(f"checkpoint benchmark ({'smoke' if args.smoke else 'quick' if args.quick else 'full'}): size {args.size}, batch {args.batch}, "
        f"{args.threads} thread(s), {args.warmup} warmup and {args.steps} + {args.steps} measured steps per variant "
        f"(checkpointed + plain, blocks of {args.block}); "
        f"variants: {', '.join(t for _, t in tags)}; scratch {scratch}, {shm_root}")
    results: dict[str, dict[str, Any]] = {}
    try:
        for variant, tag in tags:
            if variant == "fsdp":
                result = results[tag] = run_fsdp(args, scratch, shm_root)
                if result.get("ok"):
                    log(f"fsdp ({FSDP_WORLD} ranks): blocking keel {result['blocking_ms_keel_fsdp']:.2f} ms, DCP async "
                        f"{result['blocking_ms_dcp_async_fsdp']:.2f} ms [{result['wall_s']:.0f} s]")
                else:
                    log(f"fsdp: FAILED: {result.get('error')}\n{result.get('log_tail', '')}")
                continue
            result = run_variant(variant, tag, args, scratch, shm_root)
            results[tag] = result
            if result.get("ok"):
                log(f"{tag}: {result['steps_per_s']:.3f} steps/s, step {result['step_ms']['mean']:.1f} ms, "
                    f"blocking {result['blocking_ms']['mean']:.2f} ms (p99 {result['blocking_ms']['p99']:.2f}) "
                    f"[{result['wall_s']:.0f} s]")
            else:
                log(f"{tag}: FAILED: {result.get('error')}\n{result.get('log_tail', '')}")
    except KeyboardInterrupt:
        log("interrupted; workers stopped, scratch removed")
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm_root, ignore_errors=True)
    fig = figures(results, args, skipped)
    from bench.control_plane import provenance

    fig["provenance"] = provenance(args.argv, "bench.checkpoint")
    fig["bench_wall_s"] = time.monotonic() - started
    checks = report(fig, results)
    fig["targets"] = {name: ok for name, ok, _ in checks}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        ordered = {"provenance": fig["provenance"]} | {k: fig[k] for k in JSON_KEYS} | {
            k: v for k, v in fig.items() if k not in JSON_KEYS}
        args.json.write_text(json.dumps(ordered, indent=1) + "\n")
        log(f"wrote {args.json}")
    log(f"done in {fig['bench_wall_s']:.0f} s")
    return 1 if fig["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
