"""Train the example GPT with real data and pipeline parallelism on gloo, reporting to keel.sdk.

    torchrun --standalone --nproc-per-node 4 -m keel.workload.train --pp 2      # DP=2 x PP=2
    torchrun --standalone --nproc-per-node 2 -m keel.workload.train --pp 2      # DP=1 x PP=2
    python -m keel.workload.train                                                # one process

Topology (``topology``): ``world_size = DP x PP`` and ``pp_rank = rank % PP``, ``dp_rank = rank // PP``.
The ranks of one pipeline are consecutive (``[0, 1]``, ``[2, 3]`` for world 4, PP 2), so with one
pipeline per node a PP group is a node; a DP group is the ranks that hold the same stage
(``[0, 2]``, ``[1, 3]``).

One step (GPipe): the per-replica batch of ``--batch`` sequences is cut into ``--micro-batches``
micro-batches. Each stage runs the forward of every micro-batch, receiving activations from the previous
stage and sending its output to the next with ``dist.send``/``dist.recv``; then the backward of every
micro-batch in reverse, receiving activation gradients from the next stage and sending input gradients
to the previous. Gradients are averaged across the DP group with one all-reduce, the global gradient
norm and the loss are all-reduced over the world (one 2-element all-reduce), gradients are clipped to
norm 1, and AdamW steps with a warmup + cosine LR schedule. A stuck rank therefore blocks its pipeline
peers in ``recv`` and the other replicas in the all-reduce, as in production.

Deterministic: every RNG is seeded from ``--seed`` and gloo's CPU reductions are deterministic for a
fixed world, so two runs with the same arguments print bitwise-identical losses.

Checkpointing (``keel.sdk.Checkpointer``), on when ``$KEEL_CKPT_DIR`` or ``--ckpt-dir`` is set: every
step is snapshotted into shared-memory slots, and a (re)started run restores in its setup phase (the
agent's restore plan, else the newest step every rank holds in the slot folder) and continues at the
next step, with the LR schedule, the sampler and every RNG where they were: its losses and final state
are bitwise those of an uninterrupted run. ``--save-final PATH`` writes each rank's final state to
``PATH.rank<R>`` (a shard file, ``keel.sdk.shard``).

Periodic persistent checkpoint, as a plain torchrun job does it (``--persist-every N --persist-dir D``,
used by ``bench/recovery.py``'s baselines): after every N-th step each rank writes its whole state
synchronously with ``Checkpointer.save_file`` to ``D/step-<s:09d>/rank-<r:05d>.shard`` (atomic, fsynced),
then the ranks meet in one all-reduce of their save times (the step is saved once every rank is done;
rank 0 prints ``persist step S save_s C`` with the slowest rank's time). A run started with ``--persist-dir``
that restored nothing from memory resumes from the newest step every rank has there (agreed by an
all-reduce) and continues bitwise as the uninterrupted run would. Each rank keeps its two newest files.
``--save-on-sigterm`` (with ``--persist-dir``) is a careful operator's deploy with that tooling (Megatron's
``--exit-signal-handler``): SIGTERM (what ``scancel``, a preemption or ``kill`` of ``torchrun``, which
forwards it to its workers, sends) only sets a flag; after every step the ranks agree on it in one
one-element all-reduce, and at the first step where any rank saw it, every rank persists that step,
rank 0 prints ``keel.workload: saved step S on SIGTERM t_unix T`` and the run ends cleanly (exit 0): the
next launch, on new code, resumes from that step with nothing to recompute.
Every step line ends with ``t_unix`` (wall clock when the step was done), for measuring recovery; rank 0's
setup line gives ``setup_s`` (since ``main`` began), ``restore_s`` (of which restoring) and ``t_unix``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import keel.protocol.replay
import keel.sdk
from keel.events.units import parse_duration
from keel.sdk.checkpoint import Checkpointer
from keel.workload.data import MarkovDataset, ShardedSampler, collate
from keel.workload.model import SIZES, PipelineStage, build_model, split_stages

__all__ = ["topology", "main", "parse_args"]

_MAX_GRAD_NORM = 1.0


def topology(world_size: int, pp: int) -> dict[str, Any]:
    """Each rank's data- and pipeline-parallel coordinates and groups, for ``world_size = DP x pp``.

    Returns ``{"world_size", "pp", "dp", "pp_groups": [[rank, ...] per pipeline, by dp_rank],
    "dp_groups": [[rank, ...] per stage, by pp_rank], "ranks": [{"rank", "dp_rank", "pp_rank",
    "pp_group", "dp_group"} per rank]}`` with ``pp_rank = rank % pp`` and ``dp_rank = rank // pp``.
    Raises ``ValueError`` when ``world_size`` is not a positive multiple of ``pp``.
    """
    if pp < 1 or world_size < 1 or world_size % pp:
        raise ValueError(f"world size {world_size} is not a positive multiple of pp {pp}")
    dp = world_size // pp
    pp_groups = [[d * pp + s for s in range(pp)] for d in range(dp)]
    dp_groups = [[d * pp + s for d in range(dp)] for s in range(pp)]
    ranks = [
        {"rank": r, "dp_rank": r // pp, "pp_rank": r % pp, "pp_group": pp_groups[r // pp], "dp_group": dp_groups[r % pp]}
        for r in range(world_size)
    ]
    return {"world_size": world_size, "pp": pp, "dp": dp, "pp_groups": pp_groups, "dp_groups": dp_groups, "ranks": ranks}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m keel.workload.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to run")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages; WORLD_SIZE must be a multiple")
    p.add_argument("--micro-batches", type=int, default=2, help="GPipe micro-batches per step")
    p.add_argument("--batch", type=int, default=8, help="sequences per step per data-parallel replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warmup steps (default: steps // 10)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=0, help="run an eval phase every K steps (0: never)")
    p.add_argument("--eval-steps", type=int, default=2, help="batches per eval phase")
    p.add_argument("--pg-timeout", type=parse_duration, default=timedelta(minutes=10),
                   help="gloo timeout for a blocked send/recv/all-reduce, with a unit (e.g. '10m')")
    p.add_argument("--ckpt-dir", default=None,
                   help="slot folder for every-step checkpoints (default: $KEEL_CKPT_DIR; unset: off)")
    p.add_argument("--ckpt-slots", type=int, default=2, help="ring slots per rank")
    p.add_argument("--min-step-time", type=parse_duration, default=timedelta(0),
                   help="pace: sleep so that a step takes at least this long (a unit is required, e.g. 100ms); "
                        "numerics are unchanged")
    p.add_argument("--bug-at-step", type=int, default=None, metavar="STEP",
                   help="simulate a bug in this training code: rank --bug-rank raises KeyError at STEP")
    p.add_argument("--bug-rank", type=int, default=0, help="the rank that hits the bug; -1: every rank (shared code)")
    p.add_argument("--bug-file", default=None, metavar="PATH",
                   help="the bug is present only while PATH exists (removing it stands in for rolling the "
                        "code back to the last stable version; default: always present)")
    p.add_argument("--save-final", default=None, metavar="PATH",
                   help="after the last step, each rank writes its whole state to PATH.rank<R>")
    p.add_argument("--persist-every", type=int, default=0, metavar="N",
                   help="every N steps each rank saves its whole state synchronously to --persist-dir "
                        "(a torchrun-style periodic checkpoint; 0: never)")
    p.add_argument("--persist-dir", default=None, metavar="DIR",
                   help="folder of --persist-every's checkpoints (DIR/step-<s>/rank-<r>.shard); a run that restored "
                        "nothing from memory resumes from the newest step every rank saved there")
    p.add_argument("--save-on-sigterm", action="store_true",
                   help="on SIGTERM, every rank persists the step it is at to --persist-dir and exits cleanly "
                        "(the ranks agree on the step with one all-reduce per step)")
    args = p.parse_args(argv)
    if args.batch % args.micro_batches:
        p.error(f"--batch {args.batch} is not divisible by --micro-batches {args.micro_batches}")
    for name in ("steps", "pp", "micro_batches", "batch", "eval_steps", "ckpt_slots"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.persist_every < 0:
        p.error("--persist-every must be >= 0")
    if args.persist_every and not args.persist_dir:
        p.error("--persist-every needs --persist-dir")
    if args.save_on_sigterm and not args.persist_dir:
        p.error("--save-on-sigterm needs --persist-dir")
    return args


@dataclass
class _Ctx:
    rank: int
    world_size: int
    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    dp_group: Any  # a ProcessGroup, or None for the default group
    distributed: bool
    waiting: Callable[[str], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    """Wraps every collective of a training step, by name (``Session.waiting``): the step's time outside
    them is what this rank computed, what the analyzer compares to find a fail-slow node, and a rank stuck
    inside one far longer than usual is what the agent calls a hang."""

    @property
    def prev_rank(self) -> int:
        return self.rank - 1

    @property
    def next_rank(self) -> int:
        return self.rank + 1


def _setup_dist(pp: int, timeout: timedelta) -> _Ctx:
    """Join the job (``env://``, as set by torchrun or the keel agent) and create the DP groups.

    Without ``WORLD_SIZE`` in the environment this is a single-process run and nothing is initialised.
    """
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = 0, 1
    topo = topology(world_size, pp)
    me = topo["ranks"][rank]
    dp_group = None
    if distributed and topo["dp"] > 1 and pp > 1:
        # Every rank must create every group, in the same order.
        for members in topo["dp_groups"]:
            group = dist.new_group(members)
            if rank in members:
                dp_group = group
    return _Ctx(rank, world_size, pp, topo["dp"], me["pp_rank"], me["dp_rank"], dp_group, distributed)


def _lr_lambda(steps: int, warmup: int) -> Callable[[int], float]:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine decay to 10 % at ``steps``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _pipeline_forward(stage: PipelineStage, ctx: _Ctx, inputs: torch.Tensor, mb_shape: tuple[int, int, int],
                      *, grad: bool, scale: float = 1.0) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Forward one micro-batch through this stage: returns ``(stage input, stage output)``.

    The first stage reads ``inputs`` (token ids); the others receive ``[B, T, d]`` activations from the
    previous stage. All but the last stage send their output on to the next.
    """
    if stage.is_first:
        x = inputs
        received = None
    else:
        received = torch.empty(mb_shape)
        with ctx.waiting("pp_recv_activations"):
            dist.recv(received, src=ctx.prev_rank)
        received.requires_grad_(grad)
        x = received
    out = stage(x)
    if not stage.is_last:
        if scale != 1.0:
            out = out * scale
        with ctx.waiting("pp_send_activations"):
            dist.send(out.detach().contiguous(), dst=ctx.next_rank)
    return received, out


def _train_step(stage: PipelineStage, ctx: _Ctx, inputs: torch.Tensor, targets: torch.Tensor, micro_batches: int,
                d_model: int, nan_factor: float) -> torch.Tensor:
    """Forward and backward of one step over all micro-batches (GPipe). Returns this pipeline's mean
    loss on the last stage and 0 elsewhere (a 0-dim tensor, no grad)."""
    mb_inputs, mb_targets = inputs.chunk(micro_batches), targets.chunk(micro_batches)
    saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    total = torch.zeros(())
    for m in range(micro_batches):
        shape = (mb_inputs[m].shape[0], mb_inputs[m].shape[1], d_model)
        received, out = _pipeline_forward(stage, ctx, mb_inputs[m], shape, grad=True, scale=nan_factor)
        if stage.is_last:
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), mb_targets[m].reshape(-1)) * nan_factor / micro_batches
            total += loss.detach()
            saved.append((received, loss))
        else:
            saved.append((received, out))
    for m in reversed(range(micro_batches)):
        received, out = saved[m]
        if stage.is_last:
            out.backward()
        else:
            grad_out = torch.empty_like(out)
            with ctx.waiting("pp_recv_gradients"):
                dist.recv(grad_out, src=ctx.next_rank)
            out.backward(grad_out)
        if not stage.is_first:
            assert received is not None and received.grad is not None
            with ctx.waiting("pp_send_gradients"):
                dist.send(received.grad.contiguous(), dst=ctx.prev_rank)
    return total


def _flat_gradients(stage: PipelineStage) -> torch.Tensor:
    """This stage's gradients as one new flat tensor (parameter order)."""
    return torch.cat([p.grad.reshape(-1) for p in stage.parameters() if p.grad is not None])


def _sync_gradients(stage: PipelineStage, ctx: _Ctx, local_loss: torch.Tensor,
                    corrupt: Callable[[torch.Tensor], bool] = lambda _: False) -> tuple[float, float]:
    """Average gradients over the DP group, then all-reduce ``[loss, grad_norm²/DP]`` over the world.

    ``corrupt`` sees this rank's flat local gradients before the reduction (``Session.corrupt``: a local
    cluster's simulated silent data corruption, which the all-reduce then spreads to every replica).
    Returns ``(mean loss over replicas, global gradient norm)``. Must run after every micro-batch's
    backward and before clipping and ``optimizer.step``.
    """
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    if ctx.distributed and ctx.dp > 1:
        flat = _flat_gradients(stage)
        corrupt(flat)
        with ctx.waiting("dp_all_reduce"):
            dist.all_reduce(flat, group=ctx.dp_group)
        flat /= ctx.dp
        offset = 0
        for grad in grads:
            n = grad.numel()
            grad.copy_(flat[offset : offset + n].view_as(grad))
            offset += n
    elif grads:
        corrupt(grads[0])
    sq = torch.zeros(())
    for grad in grads:
        sq += grad.pow(2).sum()
    # DP replicas now hold identical gradients: each contributes 1/DP of its stage's squared norm.
    stats = torch.stack([local_loss, sq / ctx.dp])
    if ctx.distributed:
        with ctx.waiting("world_all_reduce"):
            dist.all_reduce(stats)
    return float(stats[0]) / ctx.dp, math.sqrt(float(stats[1]))


def _evaluate(stage: PipelineStage, ctx: _Ctx, dataset: MarkovDataset, batch: int, steps: int, d_model: int) -> float:
    """Mean eval loss over ``steps`` batches of the eval split, sharded by DP rank (same batches every call)."""
    sampler = ShardedSampler(dataset.num_samples, batch_size=batch, dp_rank=ctx.dp_rank, dp_size=ctx.dp, seed=dataset.seed + 1)
    total = torch.zeros(())
    stage.eval()
    with torch.no_grad():
        for _ in range(steps):
            inputs, targets = collate(dataset, sampler.next_indices(), split="eval")
            _, out = _pipeline_forward(stage, ctx, inputs, (inputs.shape[0], inputs.shape[1], d_model), grad=False)
            if stage.is_last:
                total += F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
    stage.train()
    stats = torch.stack([total / steps])
    if ctx.distributed:
        with ctx.waiting("eval_all_reduce"):
            dist.all_reduce(stats)
    return float(stats[0]) / ctx.dp


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    session = keel.sdk.init()
    start_s = time.monotonic()
    with session.phase("setup"):
        # Every global RNG, even those this loop does not draw from: a checkpoint holds them all, so a
        # resumed run's final state equals an uninterrupted one's only if they start the same.
        torch.manual_seed(args.seed)
        random.seed(args.seed)
        np.random.seed(args.seed)
        ctx = _setup_dist(args.pp, args.pg_timeout)
        ctx.waiting = session.waiting
        cfg = SIZES[args.size]
        stage = split_stages(build_model(cfg, args.seed), args.pp)[ctx.pp_rank]
        optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(args.steps, warmup))
        dataset = MarkovDataset(cfg.vocab_size, cfg.seq_len, seed=args.seed)
        sampler = ShardedSampler(dataset.num_samples, batch_size=args.batch, dp_rank=ctx.dp_rank, dp_size=ctx.dp, seed=args.seed)
        n_params = sum(p.numel() for p in stage.parameters())
        me = topology(ctx.world_size, ctx.pp)["ranks"][ctx.rank]
        ckpt = Checkpointer(session, model=stage, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                            groups={"dp": me["dp_group"], "pp": me["pp_group"], "tp": [ctx.rank]},
                            rank=ctx.rank, world_size=ctx.world_size, slots=args.ckpt_slots,
                            ckpt_dir=args.ckpt_dir or os.environ.get("KEEL_CKPT_DIR") or None)
        restore_t0 = time.monotonic()
        restored = ckpt.restore()  # -1: fresh; a collective when resuming from the slot folder
        if restored < 0 and args.persist_dir:
            restored = _restore_persisted(ckpt, ctx, args.persist_dir)
        restore_s = time.monotonic() - restore_t0
    replay = keel.protocol.replay.replay_spec()
    if replay is not None:
        return _sdc_replay(replay, session, ckpt, stage, ctx, dataset, sampler, args, cfg.d_model, restored)
    if ctx.rank == 0:
        print(f"keel.workload: size {args.size} world {ctx.world_size} dp {ctx.dp} pp {ctx.pp} "
              f"stage0_params {n_params} setup_s {time.monotonic() - start_s:.2f} restore_s {restore_s:.3f} "
              f"t_unix {time.time():.3f}", flush=True)
        if restored >= 0:
            print(f"keel.workload: restored step {restored} from {ckpt.restored_from}", flush=True)

    tokens = args.batch * cfg.seq_len
    loss = float("nan")
    last_step = restored
    terminate = _TermFlag.install() if args.save_on_sigterm else None
    with session.phase("step"):
        for step in range(restored + 1, args.steps):
            t0 = time.monotonic()
            if step == args.bug_at_step and args.bug_rank in (ctx.rank, -1) and (
                    args.bug_file is None or os.path.exists(args.bug_file)):
                _lookup_head(step)
            inputs, targets = collate(dataset, sampler.next_indices())
            optimizer.zero_grad(set_to_none=True)
            local_loss = _train_step(stage, ctx, inputs, targets, args.micro_batches, cfg.d_model, session.nan_factor())
            loss, grad_norm = _sync_gradients(stage, ctx, local_loss, session.corrupt)
            _clip(stage, grad_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()  # its pre-hook waits for the copy of the previous snapshot
            scheduler.step()
            ckpt.snapshot(step)  # a no-op without a slot folder
            last_step = step
            # The step line goes out before the pacing sleep: a rank stopped during the sleep (a planned
            # restart) has its step snapshotted, so the resumed run starts after it and never prints it.
            worked_s = time.monotonic() - t0
            paced = args.min_step_time.total_seconds() - worked_s
            step_s = max(worked_s, args.min_step_time.total_seconds())
            if ctx.rank == 0:
                print(f"step {step} loss {loss:.6f} grad_norm {grad_norm:.6f} lr {lr:.3e} "
                      f"step_time_s {step_s:.3f} tokens_per_s {tokens / step_s:.0f} loss_hex {loss.hex()} "
                      f"t_unix {time.time():.3f}", flush=True)
            if paced > 0:
                time.sleep(paced)
            persisted = bool(args.persist_every and (step + 1) % args.persist_every == 0)
            if persisted:
                _persist(ckpt, ctx, args.persist_dir, step)
            session.step_done(step, loss=loss, grad_norm=grad_norm, tokens=tokens)
            if terminate is not None and terminate.agreed(ctx):
                if not persisted:
                    _persist(ckpt, ctx, args.persist_dir, step)
                if ctx.rank == 0:
                    print(f"keel.workload: saved step {step} on SIGTERM t_unix {time.time():.3f}", flush=True)
                break
            if args.eval_every and (step + 1) % args.eval_every == 0:
                with session.phase("eval"):
                    eval_loss = _evaluate(stage, ctx, dataset, args.batch, args.eval_steps, cfg.d_model)
                if ctx.rank == 0:
                    print(f"eval step {step} loss {eval_loss:.6f}", flush=True)
    ckpt.close()
    if ckpt.enabled and ctx.rank == 0:
        st = ckpt.stats().summary()
        print(f"checkpoint snapshots {st['snapshots']:.0f} bytes {st['bytes']:.0f} "
              f"blocking_mean_ms {st['blocking_mean_s'] * 1e3:.3f} blocking_p99_ms {st['blocking_p99_s'] * 1e3:.3f} "
              f"capture_mean_ms {st['capture_mean_s'] * 1e3:.3f} wait_mean_ms {st['wait_mean_s'] * 1e3:.3f} "
              f"copy_mean_ms {st['copy_mean_s'] * 1e3:.3f} hash_mean_ms {st['hash_mean_s'] * 1e3:.3f}", flush=True)
    if args.save_final:
        ckpt.save_file(f"{args.save_final}.rank{ctx.rank}", step=last_step)
    if ctx.rank == 0 and not (terminate is not None and terminate.seen_by_all):
        print(f"done steps {args.steps} final_loss {loss:.6f} wall_s {time.monotonic() - start_s:.2f}", flush=True)
    session.done()
    if ctx.distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _sdc_replay(spec: keel.protocol.replay.ReplaySpec, session: keel.sdk.Session, ckpt: Checkpointer, stage: PipelineStage,
                ctx: _Ctx, dataset: MarkovDataset, sampler: ShardedSampler, args: argparse.Namespace, d_model: int,
                restored: int) -> int:
    """Rung 5 (``keel.protocol.replay``): replay step ``restored + 1`` once per phase, every replica on replica
    0's batch of that step, and compare this rank's gradients bitwise with the group's ranks that hold the
    same pipeline stage; write the answer and leave without training.

    Every rank creates every group's process group, in the same order (torch.distributed's rule), so the
    replay runs in the job's own world; a replica (a pipeline) is never split across groups, since groups
    are made of whole replay units. Deterministic: the same restored state and batch give bitwise-equal
    gradients on healthy hardware."""
    started = time.monotonic()
    topo = topology(ctx.world_size, ctx.pp)
    comparisons: dict[tuple[int, int], Any] = {}
    for phase in spec.phases:
        for gi, group in enumerate(phase.groups):
            for stage_index in range(ctx.pp):
                members = sorted(r for r in group if topo["ranks"][r]["pp_rank"] == stage_index)
                handle = dist.new_group(members) if ctx.distributed and members else None
                if ctx.rank in members:
                    comparisons[(phase.index, gi)] = (members, handle)
    replayed = ShardedSampler(dataset.num_samples, batch_size=args.batch, dp_rank=0, dp_size=ctx.dp, seed=args.seed)
    replayed.epoch, replayed.position = sampler.epoch, sampler.position
    inputs, targets = collate(dataset, replayed.next_indices())
    results: list[dict[str, Any]] = []
    with session.phase("eval"):  # the agent's generous eval timeout: a replay is not a hang
        for phase in spec.phases:
            key = (phase.index, phase.group_of(ctx.rank))
            if key not in comparisons:
                continue  # this rank's unit sits this phase out (a split phase tests some units only)
            members, handle = comparisons[key]
            stage.zero_grad(set_to_none=True)
            _train_step(stage, ctx, inputs, targets, args.micro_batches, d_model, 1.0)
            mine = _flat_gradients(stage)
            session.corrupt(mine)
            gathered = [torch.empty_like(mine) for _ in members]
            if handle is not None and len(members) > 1:
                dist.all_gather(gathered, mine, group=handle)
            else:
                gathered = [mine]
            differing = {r: int((g != mine).sum()) for r, g in zip(members, gathered, strict=True) if not torch.equal(g, mine)}
            digest = hashlib.sha256(mine.numpy().tobytes()).hexdigest()
            results.append({"phase": phase.index, "group": key[1], "consistent": not differing,
                            "digest": "" if differing else digest,
                            "detail": "" if not differing else "gradients differ from rank(s) " + ", ".join(
                                f"{r} ({n} of {mine.numel()} elements)" for r, n in sorted(differing.items()))})
    keel.protocol.replay.write_result(spec, ctx.rank, restored, results,
                                 detail=f"replayed step {restored + 1} after restoring step {restored} in "
                                        f"{time.monotonic() - started:.2f} s")
    if ctx.rank == 0:
        print(f"keel.workload: replay round {spec.round}: step {restored + 1} replayed in {len(results)} phase(s)",
              flush=True)
    ckpt.close()
    session.done()
    if ctx.distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


class _TermFlag:
    """``--save-on-sigterm``: the handler only records the signal; ``agreed`` turns it into a decision every
    rank takes at the same step (signals reach the ranks at different moments, a save must be of one step)."""

    def __init__(self) -> None:
        self.seen = False
        self.seen_by_all = False
        """The ranks agreed to stop: the run ends early (no ``done steps`` line)."""

    @classmethod
    def install(cls) -> _TermFlag:
        flag = cls()

        def on_term(signum: int, frame: Any) -> None:
            flag.seen = True

        signal.signal(signal.SIGTERM, on_term)
        return flag

    def agreed(self, ctx: _Ctx) -> bool:
        seen = torch.tensor([1 if self.seen else 0], dtype=torch.int64)
        if ctx.distributed:
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        self.seen_by_all = bool(seen[0])
        return self.seen_by_all


def _persist_path(root: str, step: int, rank: int) -> str:
    return os.path.join(root, f"step-{step:09d}", f"rank-{rank:05d}.shard")


def _persist(ckpt: Checkpointer, ctx: _Ctx, root: str, step: int) -> None:
    """``--persist-every``: this rank's whole state to ``root`` (synchronous, fsynced), then one all-reduce
    of the save times, so the step counts as saved only once every rank is done (rank 0 prints the
    slowest rank's time). Keeps this rank's two newest files."""
    t0 = time.monotonic()
    ckpt.save_file(_persist_path(root, step, ctx.rank), step=step)
    took = torch.tensor([time.monotonic() - t0])
    if ctx.distributed:
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
    if ctx.rank == 0:
        print(f"persist step {step} save_s {float(took[0]):.4f} t_unix {time.time():.3f}", flush=True)
    for old in sorted(_persisted_steps(root, ctx.rank))[:-2]:
        try:
            os.unlink(_persist_path(root, old, ctx.rank))
        except OSError:
            pass


def _persisted_steps(root: str, rank: int) -> set[int]:
    """The steps under ``root`` that hold a shard file of ``rank``."""
    steps: set[int] = set()
    try:
        names = os.listdir(root)
    except OSError:
        return steps
    for name in names:
        if name.startswith("step-") and name[5:].isdigit() and os.path.exists(_persist_path(root, int(name[5:]), rank)):
            steps.add(int(name[5:]))
    return steps


def _restore_persisted(ckpt: Checkpointer, ctx: _Ctx, root: str) -> int:
    """Load the newest step of ``root`` that every rank saved (-1: none); the ranks agree with an
    all-reduce (a collective when distributed)."""
    common: set[int] | None = None
    for rank in range(ctx.world_size):
        held = _persisted_steps(root, rank)
        common = held if common is None else common & held
    newest = torch.tensor([max(common) if common else -1], dtype=torch.int64)
    if ctx.distributed:
        dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    step = int(newest[0])
    if step < 0:
        return -1
    loaded = ckpt.load_file(_persist_path(root, step, ctx.rank))
    if loaded != step:
        raise RuntimeError(f"{_persist_path(root, step, ctx.rank)} holds step {loaded}, expected {step}")
    return loaded


def _lookup_head(step: int) -> None:
    """The simulated bug (``--bug-at-step``): an exception raised in this file, as a bad code push would."""
    heads: dict[str, int] = {}
    raise KeyError(f"lm_head_v2 (step {step}): {sorted(heads)}")


def _clip(stage: PipelineStage, grad_norm: float) -> None:
    """Clip to the *global* norm (all stages, computed in ``_sync_gradients``), as a non-pipelined
    model would; ``clip_grad_norm_`` on one stage would only see that stage's share."""
    coef = _MAX_GRAD_NORM / (grad_norm + 1e-6)
    if coef < 1.0 or math.isnan(coef):
        for p in stage.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)


if __name__ == "__main__":
    sys.exit(main())
