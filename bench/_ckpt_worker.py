"""One rank of the checkpoint benchmark (``bench/checkpoint.py``): train, checkpoint every step, report.

    torchrun --standalone --nproc-per-node 1 -m bench._ckpt_worker --variant V --out RESULT.json [...]
    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=P python -m bench._ckpt_worker ...

Every variant runs in its own fresh process: one rank, a gloo process group, the model wrapped in DDP
(DLRover under torchrun, as it is meant to run: its engine forks its saver process from local rank 0).
The model is the example GPT (``keel.workload.model``) with AdamW, trained on one fixed synthetic batch.

What one run does:

1. Two plain steps (the optimizer state exists afterwards); the memory baseline is taken.
2. The variant's checkpointer is created, then ``--warmup`` more steps *with* checkpointing (first
   allocations, page faults, the DLRover saver's start) that are not measured.
3. ``--steps`` measured checkpointed steps, in blocks of ``--block`` interleaved with blocks of as many
   plain steps (ABBA: ckpt, plain, plain, ckpt, ...; the same process, so drift and noisy neighbours
   hit both kinds alike). A checkpointed block ends with one plain step (the last save's background
   work overlaps it, as every save's overlaps the next step) and then waits, timed, for whatever is
   still running (DCP's future, Keel's copy). Overhead per checkpoint, per round = (checkpointed
   block's time - its step count x that round's plain step time) / checkpoints; the median over the
   rounds is reported (and the pooled mean beside it); steps/s with checkpointing = 1 / (median plain
   step + overhead); retention = their ratio. Per checkpointed step: wall time (from
   ``zero_grad`` to the end of the checkpoint call) and blocking time, what the training thread spends
   inside checkpointing:

   - ``torch_save``: ``state_dict()`` + ``torch.save`` to a local file (the same file every step);
   - ``dcp_async``: ``state_dict()`` + waiting for the previous ``async_save`` future (DCP allows
     one in flight) + the ``async_save`` call (staging);
   - ``dlrover``: ``state_dict()`` + ``DdpCheckpointer.save_checkpoint(..., StorageType.MEMORY)``;
   - ``keel_nobackup`` / ``keel``: ``Checkpointer.snapshot(step)`` + the time its optimizer pre-hook
     waits for the previous snapshot's copy (timed by hooks registered around Keel's own).

4. Memory at the end, restore timings, JSON to ``--out``.

Host memory per rank: the growth of the anonymous memory of the rank and its child processes
(proportional share, ``Pss_Anon`` of ``/proc/<pid>/smaps_rollup``: shared pages of a forked saver are
not counted twice) plus the shared-memory files the variant keeps (Keel's slot files, DLRover's
segment), counted by their allocated blocks. Page cache of files written to disk is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VARIANTS = ("none", "torch_save", "dcp_async", "dlrover", "keel_nobackup", "keel")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench._ckpt_worker")
    p.add_argument("--variant", required=True, choices=VARIANTS)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--size", default="bench")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="checkpointed steps measured (as many plain ones)")
    p.add_argument("--block", type=int, default=5, help="steps per block of the ABBA interleaving")
    p.add_argument("--scratch", type=Path, required=True, help="a folder on local disk for file checkpoints")
    p.add_argument("--shm-dir", type=Path, required=True, help="a folder under /dev/shm for Keel's slots")
    p.add_argument("--persist-root", type=Path, default=None, help="keel: the persistent tier's root (agent writes it)")
    p.add_argument("--restore-repeats", type=int, default=5,
                   help="restores timed per tier (each into a fresh model and optimizer); the median is reported")
    p.add_argument("--job", default="ckptbench")
    p.add_argument("--agent-ready", type=Path, default=None,
                   help="keel: wait for this file (the node agent's checkpoint process is up) before training")
    p.add_argument("--agent-done", type=Path, default=None,
                   help="keel: after training, write the last step here and wait for <path>.ack (agent drained)")
    return p.parse_args(argv)


# -- measurement helpers -------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return out


def _pss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss_Anon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def anon_bytes_tree(pid: int | None = None) -> int:
    """``Pss_Anon`` of a process and all its descendants."""
    root = os.getpid() if pid is None else pid
    total, todo, seen = 0, [root], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _pss_anon(p)
        todo.extend(_children(p))
    return total


def allocated_bytes(paths: list[Path]) -> int:
    """Allocated blocks of files (recursively for folders): what a tmpfs file really holds in RAM."""
    total = 0
    for path in paths:
        if path.is_dir():
            for sub in path.rglob("*"):
                try:
                    if sub.is_file():
                        total += sub.stat().st_blocks * 512
                except OSError:
                    continue
        elif path.exists():
            total += path.stat().st_blocks * 512
    return total


def evict_from_page_cache(path: Path) -> bool:
    """fsync a file and ask the kernel to drop its pages, so that the next read comes from the disk
    (``POSIX_FADV_DONTNEED``; on tmpfs or an overlay this may be a no-op: reported, not hidden)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def timed_restores(repeats: int, once: Any) -> tuple[float, bool, list[float]]:
    """Run ``once()`` (one restore into a fresh model: returns its seconds and whether the result is
    bitwise right) ``repeats`` times: the median seconds, whether every one was right, and every figure.
    The machine has two cores shared with background work: one restore's time is noise, a median is not."""
    runs = [once() for _ in range(max(1, repeats))]
    seconds = [s for s, _ in runs]
    return statistics.median(seconds), all(ok for _, ok in runs), seconds


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    idx = lambda q: ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]  # noqa: E731
    return {"mean": statistics.fmean(ordered), "p50": statistics.median(ordered), "p99": idx(0.99), "max": ordered[-1]}


# -- the training job ------------------------------------------------------------------------------


class Job:
    """Model (DDP on gloo, one rank), AdamW, and one fixed synthetic batch."""

    def __init__(self, size: str, batch: int, seed: int = 0) -> None:
        import torch
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel as DDP

        from bench._ckpt_common import config_of
        from keel.workload.model import build_model

        self.torch, self.F = torch, F
        self.cfg = config_of(size)
        self.module = build_model(self.cfg, seed)
        self.model = DDP(self.module)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1)
        g = torch.Generator().manual_seed(seed + 1)
        self.x = torch.randint(0, self.cfg.vocab_size, (batch, self.cfg.seq_len), generator=g)
        self.y = torch.randint(0, self.cfg.vocab_size, (batch, self.cfg.seq_len), generator=g)

    def step(self) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(self.x)
        loss = self.F.cross_entropy(logits.flatten(0, 1), self.y.flatten())
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def state_bytes(self) -> int:
        sd = self.state_dict()
        total = 0

        def walk(v: Any) -> None:
            nonlocal total
            if self.torch.is_tensor(v):
                total += v.numel() * v.element_size()
            elif isinstance(v, dict):
                for x in v.values():
                    walk(x)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    walk(x)

        walk(sd)
        return total

    def fresh(self) -> Job:
        """Another model + optimizer of the same shape (a restarted rank), different weights, same process group."""
        other = object.__new__(Job)
        other.torch, other.F, other.cfg = self.torch, self.F, self.cfg
        from keel.workload.model import build_model

        other.module = build_model(self.cfg, 12345)
        other.model = other.module  # no DDP wrapper needed to load state
        other.optimizer = self.torch.optim.AdamW(other.module.parameters(), lr=3e-4, weight_decay=0.1)
        other.x, other.y = self.x, self.y
        return other

    def load(self, sd: dict[str, Any]) -> None:
        self.module.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])

    def same_weights(self, other: Job) -> bool:
        """Bitwise the same model and optimizer state (every AdamW moment and step count)."""
        a, b = self.module.state_dict(), other.module.state_dict()
        if a.keys() != b.keys() or not all(self.torch.equal(a[k], b[k]) for k in a):
            return False
        sa, sb = self.optimizer.state_dict()["state"], other.optimizer.state_dict()["state"]
        return sa.keys() == sb.keys() and all(
            sa[i].keys() == sb[i].keys() and all(self.torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa)


# -- variants --------------------------------------------------------------------------------------


class Variant:
    name = "none"

    def __init__(self, job: Job, args: argparse.Namespace) -> None:
        self.job, self.args = job, args

    def setup(self) -> None: ...

    def save(self, step: int) -> float:
        """Checkpoint after the optimizer step of ``step``; the blocking seconds."""
        return 0.0

    def extra_blocking(self) -> float:
        """Blocking seconds spent elsewhere in the last step (Keel: its optimizer pre-hook wait)."""
        return 0.0

    def drain(self) -> None:
        """Wait until the checkpoints saved so far are complete (timed: part of the checkpointed block)."""

    def sync_agent(self) -> None:
        """Let background work outside the rank (the node agent's checkpoint process) finish (timed, in the block)."""

    def shm_paths(self) -> list[Path]:
        return []

    def restore(self) -> dict[str, Any]:
        return {}

    def close(self) -> None: ...


class TorchSave(Variant):
    name = "torch_save"

    def setup(self) -> None:
        self.path = self.args.scratch / "torch_save" / "state.pt"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        self.job.torch.save(self.job.state_dict(), self.path)
        return time.perf_counter() - t0

    def restore(self) -> dict[str, Any]:
        evicted: list[bool] = []

        def once() -> tuple[float, bool]:
            evicted.append(evict_from_page_cache(self.path))
            fresh = self.job.fresh()
            t0 = time.perf_counter()
            sd = self.job.torch.load(self.path, map_location="cpu", weights_only=True)
            fresh.load(sd)
            return time.perf_counter() - t0, fresh.same_weights(self.job)

        median_s, ok, runs = timed_restores(self.args.restore_repeats, once)
        return {"restore_s_torch_load": median_s, "restore_s_torch_load_runs": runs,
                "restore_torch_load_evicted": all(evicted), "restore_torch_load_ok": ok,
                "file_bytes_torch_save": self.path.stat().st_size}


class DcpAsync(Variant):
    name = "dcp_async"

    def setup(self) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.dir = self.args.scratch / "dcp"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.future: Any = None
        self.wait_s: list[float] = []

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        if self.future is not None:
            self.future.result()
        t1 = time.perf_counter()
        self.wait_s.append(t1 - t0)
        self.future = self.dcp.async_save(self.job.state_dict(), checkpoint_id=str(self.dir))
        return time.perf_counter() - t0

    def drain(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def restore(self) -> dict[str, Any]:
        def once() -> tuple[float, bool]:
            fresh = self.job.fresh()
            t0 = time.perf_counter()
            sd = fresh.state_dict()
            self.dcp.load(sd, checkpoint_id=str(self.dir))
            fresh.load(sd)
            return time.perf_counter() - t0, fresh.same_weights(self.job)

        median_s, ok, runs = timed_restores(self.args.restore_repeats, once)
        return {"restore_s_dcp": median_s, "restore_s_dcp_runs": runs, "restore_dcp_ok": ok,
                "dcp_wait_prev_ms_mean": 1e3 * statistics.fmean(self.wait_s) if self.wait_s else 0.0}


class DLRover(Variant):
    """DLRover Flash Checkpoint: ``DdpCheckpointer`` to shared memory every step.

    Under plain torchrun the engine starts its own saver process (``start_saver_process``: local rank
    0, when not launched by ``dlrover-run``), which serves the shared lock, queue and metadata over
    local sockets under ``/tmp/ckpt_sock/<run id>``; the state is copied synchronously into a POSIX
    shared-memory segment ``/dev/shm/<run id>_ckpt_shm_0``. No peer copy (``replica_count=0``).
    """

    name = "dlrover"

    def setup(self) -> None:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        self.StorageType = StorageType
        self.dir = self.args.scratch / "dlrover"
        self.ck = DdpCheckpointer(str(self.dir))
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        self.ck.save_checkpoint(step, self.job.state_dict(), str(self.dir / f"{step}.pt"),
                                storage_type=self.StorageType.MEMORY)
        return time.perf_counter() - t0

    def shm_paths(self) -> list[Path]:
        name = f"{self.run_id}_ckpt_shm_0" if self.run_id else "ckpt_shm_0"
        return [Path("/dev/shm") / name]

    def restore(self) -> dict[str, Any]:
        # DLRover verifies nothing on this path (no digest of the segment): its figure is the load alone.
        def once() -> tuple[float, bool]:
            fresh = self.job.fresh()
            t0 = time.perf_counter()
            sd = self.ck.load_checkpoint()
            fresh.load(sd)
            return time.perf_counter() - t0, fresh.same_weights(self.job)

        median_s, ok, runs = timed_restores(self.args.restore_repeats, once)

        # The same restore as a restarted rank makes it: its process has no mapping of the segment yet, so
        # ``load_state_dict`` attaches it anew (``SharedMemory(name)``) and the first touches fault its pages
        # in, as Keel's rank maps its slot anew. Dropping the handler's mapping (not closing it: the earlier
        # restores' tensors still view it) makes the next load take that path.
        def once_reattached() -> tuple[float, bool]:
            fresh = self.job.fresh()
            self.ck._engine._shm_handler.shared_memory = None  # noqa: SLF001 - as in a new process
            t0 = time.perf_counter()
            sd = self.ck.load_checkpoint()
            fresh.load(sd)
            return time.perf_counter() - t0, fresh.same_weights(self.job)

        cold_s, cold_ok, cold_runs = timed_restores(self.args.restore_repeats, once_reattached)
        return {"restore_s_dlrover_memory": median_s, "restore_s_dlrover_memory_runs": runs, "restore_dlrover_ok": ok,
                "restore_s_dlrover_memory_reattached": cold_s, "restore_s_dlrover_memory_reattached_runs": cold_runs,
                "restore_dlrover_reattached_ok": cold_ok, **self.aliasing()}

    def aliasing(self) -> dict[str, Any]:
        """What DLRover's fast restore costs in safety, measured: the share of the restored optimizer's state
        tensors that live inside its checkpoint segment (``torch.frombuffer`` views the optimizer adopts),
        and whether one training step after the restore changed the checkpoint's bytes while the checkpoint
        still claims its step (a crash in that step would then restore a mix of two steps)."""
        import hashlib

        torch = self.job.torch

        def digest(state: Any) -> str:
            h = hashlib.sha256()

            def walk(v: Any) -> None:
                if torch.is_tensor(v):
                    h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
                elif isinstance(v, dict):
                    for key in sorted(v, key=str):
                        walk(v[key])
                elif isinstance(v, list | tuple):
                    for x in v:
                        walk(x)

            walk(state)
            return h.hexdigest()

        try:
            segment = self.ck._engine._shm_handler.shared_memory.buf  # noqa: SLF001 - where its tensors live
            base = torch.frombuffer(segment, dtype=torch.uint8).data_ptr()
            end = base + len(segment)
        except Exception as exc:  # noqa: BLE001 - an internal of another project: report, do not fail the run
            return {"dlrover_aliasing_error": repr(exc)}
        fresh = self.job.fresh()
        fresh.load(self.ck.load_checkpoint())
        states = [t for per_param in fresh.optimizer.state.values() for t in per_param.values()
                  if torch.is_tensor(t) and t.numel() > 1]
        inside = sum(1 for t in states if base <= t.data_ptr() < end)
        before = digest(self.ck.load_checkpoint())
        fresh.step()
        after = digest(self.ck.load_checkpoint())
        return {"dlrover_restored_state_in_checkpoint": inside / len(states) if states else None,
                "dlrover_checkpoint_changed_by_next_step": before != after}

    def close(self) -> None:
        try:
            self.ck._engine._shm_handler.unlink()  # noqa: SLF001 - the segment would outlive the run
        except Exception:  # noqa: BLE001 - best effort
            pass


class Keel(Variant):
    """Keel's Checkpointer (``keel.sdk.checkpoint``): a snapshot every step into shared-memory slots.

    ``keel_nobackup``: the rank side only. ``keel``: the same rank side, with the node agent's
    checkpoint duties (peer backup over gRPC every committed step, the persistent tier every K steps)
    running beside it in a separate process (``bench._ckpt_agent``), as they would on a node.
    """

    name = "keel"

    def setup(self) -> None:
        from bench import _ckpt_keel

        self.adapter = _ckpt_keel.RankSide(self.job, self.args)

    def save(self, step: int) -> float:
        return self.adapter.snapshot(step)

    def extra_blocking(self) -> float:
        return self.adapter.take_prehook_wait()

    def drain(self) -> None:
        self.adapter.drain()

    def sync_agent(self) -> None:
        self.adapter.sync_agent()

    def shm_paths(self) -> list[Path]:
        return self.adapter.shm_paths()

    def restore(self) -> dict[str, Any]:
        return self.adapter.restore()

    def close(self) -> None:
        self.adapter.close()


def make_variant(name: str, job: Job, args: argparse.Namespace) -> Variant:
    cls = {"none": Variant, "torch_save": TorchSave, "dcp_async": DcpAsync, "dlrover": DLRover,
           "keel_nobackup": Keel, "keel": Keel}[name]
    variant = cls(job, args)
    variant.name = name
    return variant


def checkpointed_steps(job: Job, variant: Variant, step: int, count: int) -> int:
    """``count`` unmeasured steps, each checkpointed, then drained: returns the last step's number."""
    for _ in range(count):
        step += 1
        job.step()
        variant.save(step)
        variant.extra_blocking()
    variant.drain()
    variant.sync_agent()
    return step


# -- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    result: dict[str, Any] = {"variant": args.variant, "threads": args.threads, "size": args.size, "batch": args.batch,
                              "world_size": dist.get_world_size(), "launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ
                              else "direct"}
    try:
        job = Job(args.size, args.batch)
        for _ in range(2):  # the optimizer state exists after the first step
            job.step()
        result["state_bytes"] = job.state_bytes()
        anon0 = anon_bytes_tree()
        variant = make_variant(args.variant, job, args)
        t0 = time.perf_counter()
        variant.setup()
        result["setup_s"] = time.perf_counter() - t0
        step = checkpointed_steps(job, variant, 0, args.warmup)

        # Measured: rounds of one checkpointed block and one plain block of --block steps each, in
        # ABBA order (ckpt, plain, plain, ckpt, ...), so that the machine's drift and noisy neighbours
        # hit both alike. A checkpointed block's time ends after the last save has drained (DCP's
        # future, Keel's copy), so that no checkpoint work is left out of it or leaks into the
        # plain block; the agent's checkpoint process is then let go idle, timed too.
        walls, blocks, computes, plain_walls = [], [], [], []
        ckpt_block_s, plain_block_s, drains, ckpt_block_steps = 0.0, 0.0, [], 0
        agent_syncs: list[float] = []
        round_ckpt: list[float] = []  # per round: the checkpointed block's seconds
        round_plain: list[float] = []  # per round: the plain block's seconds per step
        losses = []
        rounds = max(1, args.steps // args.block)
        for r in range(rounds):
            order = ("ckpt", "plain") if r % 2 == 0 else ("plain", "ckpt")
            for kind in order:
                if kind == "plain":
                    b0 = time.perf_counter()
                    for _ in range(args.block):
                        t0 = time.perf_counter()
                        job.step()
                        plain_walls.append(time.perf_counter() - t0)
                    plain_block_s += time.perf_counter() - b0
                    round_plain.append((time.perf_counter() - b0) / args.block)
                    continue
                variant.extra_blocking()  # discard what the plain steps' hooks accumulated
                b0 = time.perf_counter()
                for _ in range(args.block):
                    step += 1
                    t0 = time.perf_counter()
                    losses.append(job.step())
                    t1 = time.perf_counter()
                    blocking = variant.save(step)
                    t2 = time.perf_counter()
                    blocking += variant.extra_blocking()
                    walls.append(t2 - t0)
                    computes.append(t1 - t0)
                    blocks.append(blocking)
                # One trailing plain step inside the block: the last save's background work overlaps it
                # as every other save's overlaps the next step (Keel's pre-hook wait lands here and is
                # charged to that save); what is still running after it is drained, timed.
                job.step()
                blocks[-1] += variant.extra_blocking()
                d0 = time.perf_counter()
                variant.drain()
                drains.append(time.perf_counter() - d0)
                # Keel as shipped: the agent's transfer still running (the block's last backup, a persist)
                # is waited for inside the block, timed, so no transfer escapes the measurement. This
                # over-charges slightly (in steady state it would overlap the next steps), never under.
                a0 = time.perf_counter()
                variant.sync_agent()
                agent_syncs.append(time.perf_counter() - a0)
                ckpt_block_s += time.perf_counter() - b0
                ckpt_block_steps += args.block + 1
                round_ckpt.append(time.perf_counter() - b0)
        # One more checkpointed step, drained: the job's state is then exactly the newest checkpoint's, so
        # each restore below can be checked bitwise against it (the measured loop ends with plain steps).
        step = checkpointed_steps(job, variant, step, 1)
        result["last_step"] = step
        shm = allocated_bytes(variant.shm_paths())
        anon = anon_bytes_tree() - anon0
        n = len(walls)
        # Per round (a checkpointed block and the plain block next to it): the overhead per checkpoint,
        # with the block's trailing plain step at that round's plain speed. The median over rounds is
        # what is reported (a burst of outside load in one block moves the mean, not the median).
        per_round = [(c - (args.block + 1) * p) / args.block for c, p in zip(round_ckpt, round_plain)]
        plain_step_s = statistics.median(round_plain)
        overhead_s = statistics.median(per_round)
        pooled_plain_s = plain_block_s / len(plain_walls)
        result.update(
            steps=n,
            rounds=rounds,
            block=args.block,
            steps_per_s=1.0 / (plain_step_s + overhead_s),
            plain_steps_per_s=1.0 / plain_step_s,
            retention=plain_step_s / (plain_step_s + overhead_s),
            overhead_ms=1e3 * overhead_s,
            overhead_ms_per_round=[1e3 * x for x in per_round],
            overhead_ms_pooled=1e3 * (ckpt_block_s - ckpt_block_steps * pooled_plain_s) / n,
            step_ms={k: 1e3 * v for k, v in summary(walls).items()},
            plain_step_ms={k: 1e3 * v for k, v in summary(plain_walls).items()},
            compute_ms={k: 1e3 * v for k, v in summary(computes).items()},
            blocking_ms={k: 1e3 * v for k, v in summary(blocks).items()},
            drain_ms={k: 1e3 * v for k, v in summary(drains).items()},
            agent_sync_ms={k: 1e3 * v for k, v in summary(agent_syncs).items()},
            host_anon_bytes=anon,
            host_shm_bytes=shm,
            host_bytes_per_rank=max(0, anon) + shm,
            final_loss=losses[-1] if losses else None,
        )
        result.update(variant.restore())
        variant.close()
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which prints it
        import traceback

        traceback.print_exc()
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
