"""The example GPT trained with sharded state on gloo, checkpointed every step.

    WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python -m keel.workload.fsdp --steps 20

``--sharding`` picks what is sharded over the ranks:

- ``fsdp2`` (the default; ZeRO-3): FSDP2 (``torch.distributed.fsdp.fully_shard``). Every rank holds a shard of
  every parameter and of the AdamW state (one DTensor per parameter, sharded on dim 0 over all ranks); each
  block is its own FSDP unit.
- ``zero2``: the same, with ``reshard_after_forward=False``: parameters stay gathered from the forward to the
  backward; gradients and optimizer state are sharded (ZeRO-2, FSDP's ``SHARD_GRAD_OP``).
- ``zero1``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer``: every rank holds all parameters and
  gradients, and the AdamW state of its own partition of the parameters only.
 ``keel.sdk.Checkpointer`` snapshots the local
shards every step through ``torch.distributed.checkpoint.state_dict`` and resumes them bitwise on the same
layout (the same world size). Prints the same step lines as ``keel.workload.train``
(``step N loss X ... loss_hex H``), so the local cluster and the tests read both alike.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import keel.sdk
from keel.events.units import parse_duration
from keel.sdk import Checkpointer
from keel.workload.data import MarkovDataset, ShardedSampler, collate
from keel.workload.model import GPT, SIZES, build_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m keel.workload.fsdp", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to run")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size")
    p.add_argument("--batch", type=int, default=8, help="sequences per step per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (cosine decay to 10 %% over --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--pg-timeout", type=parse_duration, default=timedelta(minutes=10),
                   help="collective timeout, e.g. 600s")
    p.add_argument("--ckpt-dir", default=None, help="slot folder (default $KEEL_CKPT_DIR; neither: no snapshots)")
    p.add_argument("--min-step-time", type=parse_duration, default=timedelta(0),
                   help="pace: sleep so that a step takes at least this long (a unit is required, e.g. 100ms); "
                        "numerics are unchanged")
    p.add_argument("--sharding", choices=("fsdp2", "zero2", "zero1"), default="fsdp2",
                   help="what is sharded: fsdp2 everything (ZeRO-3), zero2 gradients and optimizer state, zero1 "
                        "optimizer state (DDP + ZeroRedundancyOptimizer)")
    p.add_argument("--save-final", default=None, metavar="PATH",
                   help="write the final state as a shard file PATH.rank<R> (for bitwise comparisons)")
    p.add_argument("--reshard-from", nargs="+", default=None, metavar="PATH",
                   help="resume from a checkpoint that another layout (world size) saved: a persistent-tier step "
                        "directory, or every saved rank's slot or shard file (Checkpointer.load_resharded)")
    p.add_argument("--dcp-save-at", type=int, default=None, metavar="STEP",
                   help="after STEP, save the model and optimizer synchronously with torch.distributed.checkpoint "
                        "into --dcp-dir, the scheduler's and sampler's state as JSON beside them: the reference a "
                        "resharded restore is compared against")
    p.add_argument("--dcp-load", action="store_true",
                   help="resume from --dcp-dir on this run's layout, resharded by torch.distributed.checkpoint")
    p.add_argument("--dcp-dir", default=None, metavar="DIR", help="the folder of --dcp-save-at and --dcp-load")
    args = p.parse_args(argv)
    if (args.dcp_save_at is not None or args.dcp_load) and not args.dcp_dir:
        p.error("--dcp-save-at and --dcp-load need --dcp-dir")
    if args.reshard_from and args.dcp_load:
        p.error("--reshard-from and --dcp-load are two ways to resume: pick one")
    return args


def dcp_save(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, sampler: ShardedSampler) -> None:
    """A synchronous torch.distributed.checkpoint save of the model and optimizer (every rank writes its
    shards, a collective), the scheduler's and this rank's sampler's state as JSON (``extra-rank<R>.json``)."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    extra = {"scheduler": scheduler.state_dict(), "sampler": sampler.state_dict()}
    with open(os.path.join(directory, f"extra-rank{dist.get_rank()}.json"), "w") as f:
        json.dump(extra, f)


def dcp_load(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, sampler: ShardedSampler) -> int:
    """Load ``dcp_save``'s folder on this run's layout (DCP reshards the model and optimizer; the sampler follows
    ``ShardedSampler.reshard_state_dict``, as under Keel). Returns the step it holds."""
    import glob
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)  # in place, into these dicts
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    files = sorted(glob.glob(os.path.join(directory, "extra-rank*.json")), key=lambda f: int(f.rsplit("rank", 1)[1][:-5]))
    extras = [json.loads(Path(f).read_text()) for f in files]
    scheduler.load_state_dict(extras[0]["scheduler"])
    sampler.load_state_dict(sampler.reshard_state_dict([e["sampler"] for e in extras]))
    return int(extras[0]["scheduler"]["last_epoch"]) - 1


def shard_model(model: GPT, *, reshard_after_forward: bool = True) -> GPT:
    """FSDP2 over every rank: each transformer block is a unit, the root holds embedding and head."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


def build_sharded(model: GPT, sharding: str, lr: float, weight_decay: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model to train and its AdamW, sharded as ``--sharding`` says."""
    betas = (0.9, 0.95)
    if sharding == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=lr,
                                            weight_decay=weight_decay, betas=betas)
    sharded = shard_model(model, reshard_after_forward=sharding == "fsdp2")
    return sharded, torch.optim.AdamW(sharded.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    session = keel.sdk.init()
    start_s = time.monotonic()
    with session.phase("setup"):
        torch.manual_seed(args.seed)
        random.seed(args.seed)
        np.random.seed(args.seed)
        if "WORLD_SIZE" not in os.environ:
            raise SystemExit("keel.workload.fsdp needs torch.distributed's env:// variables (WORLD_SIZE, RANK, "
                             "MASTER_ADDR, MASTER_PORT), as torchrun or keel run set them")
        dist.init_process_group("gloo", init_method="env://", timeout=args.pg_timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
        cfg = SIZES[args.size]
        model, optimizer = build_sharded(build_model(cfg, args.seed), args.sharding, args.lr, args.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, s / max(1, args.steps)))))
        dataset = MarkovDataset(cfg.vocab_size, cfg.seq_len, seed=args.seed)
        sampler = ShardedSampler(dataset.num_samples, batch_size=args.batch, dp_rank=rank, dp_size=world, seed=args.seed)
        # FSDP and ZeRO shard over all ranks: the shard group is the data-parallel group.
        ckpt = Checkpointer(session, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                            groups={"dp": list(range(world)), "pp": [rank], "tp": [rank]}, rank=rank, world_size=world,
                            ckpt_dir=args.ckpt_dir or os.environ.get("KEEL_CKPT_DIR") or None)
        if args.reshard_from:
            sources = args.reshard_from[0] if len(args.reshard_from) == 1 else args.reshard_from
            restored = ckpt.load_resharded(sources)
        elif args.dcp_load:
            restored = dcp_load(args.dcp_dir, model, optimizer, scheduler, sampler)
            ckpt.restored_from = f"torch.distributed.checkpoint {args.dcp_dir}"
        else:
            restored = ckpt.restore()
    if rank == 0:
        print(f"keel.workload.fsdp: size {args.size} world {world} sharding {args.sharding} sharded {ckpt.sharded} "
              f"zero {ckpt.zero} "
              f"setup_s {time.monotonic() - start_s:.2f}", flush=True)
        if restored >= 0:
            print(f"keel.workload: restored step {restored} from {ckpt.restored_from}", flush=True)
    loss = float("nan")
    last_step = restored
    with session.phase("step"):
        for step in range(restored + 1, args.steps):
            t0 = time.monotonic()
            inputs, targets = collate(dataset, sampler.next_indices())
            optimizer.zero_grad(set_to_none=True)
            logits = model(inputs)
            local = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            local.backward()  # FSDP2 reduce-scatters the gradients, DDP all-reduces them (averaged over the ranks)
            with session.waiting("loss_all_reduce"):
                total = local.detach().clone()
                dist.all_reduce(total)
            loss = float(total) / world
            optimizer.step()
            scheduler.step()
            ckpt.snapshot(step)
            if step == args.dcp_save_at:
                dcp_save(args.dcp_dir, model, optimizer, scheduler, sampler)
            last_step = step
            # The step line goes out before the pacing sleep, as in keel.workload.train.
            worked_s = time.monotonic() - t0
            step_s = max(worked_s, args.min_step_time.total_seconds())
            if rank == 0:
                print(f"step {step} loss {loss:.6f} step_time_s {step_s:.3f} loss_hex {loss.hex()} "
                      f"t_unix {time.time():.3f}", flush=True)
            if step_s > worked_s:
                time.sleep(step_s - worked_s)
            session.step_done(step, loss=loss, tokens=args.batch * cfg.seq_len)
    ckpt.close()
    if args.save_final:
        ckpt.save_file(f"{args.save_final}.rank{rank}", step=last_step)
    if rank == 0:
        print(f"done steps {args.steps} final_loss {loss:.6f} wall_s {time.monotonic() - start_s:.2f}", flush=True)
    session.done()
    dist.barrier()
    # DDP's reducer (zero1) holds the process group and threads of gloo's: release it before the group is torn
    # down, or the teardown at exit aborts now and then ("terminate called without an active exception").
    del model, optimizer, scheduler, ckpt
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
