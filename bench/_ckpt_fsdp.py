"""The FSDP2 part of the checkpoint benchmark (``bench/checkpoint.py``, variant ``fsdp``): two gloo ranks.

    WORLD_SIZE=2 RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=P python -m bench._ckpt_fsdp --out R.json --scratch D --shm-dir S

The example GPT under ``fully_shard`` (each block a unit; every parameter and AdamW moment a DTensor shard),
AdamW, one fixed batch per rank. In the same processes, on the same sharded state, blocks of steps rotate
through three kinds (plain, Keel, DCP), so drift and noisy neighbours hit all alike:

- ``keel``: ``Checkpointer.snapshot(step)`` every step (local shards by reference through DCP's
  ``get_state_dict``, copied into shared-memory slots on the copy thread); blocking = the snapshot call
  plus the time the optimizer pre-hook waits for the previous copy (``Checkpointer.stats()``);
- ``dcp_async``: what DCP's documentation shows for asynchronous checkpoints every step: wait for the previous
  ``async_save`` future (one in flight), ``get_state_dict``, ``dcp.async_save`` on a process group of its
  own (its staging copy is inside the call); blocking = all three.

Both write to shared memory (``/dev/shm``: Keel's slots, DCP's checkpoint folder), so the storage medium is
not what differs. Overhead per checkpoint = (block wall time - steps x that round's plain-step median) / steps;
the median over the rounds. Blocking is reported as the mean and the median per step. Every figure is the
slower rank's (each rank's value, all-reduced with max): a synchronous job steps at its slowest rank; every
rank's samples are in ``measured_by_rank``. Restores, same layout, into a fresh sharded model and optimizer:
Keel's local slot (``load_file``: XXH3-128 verified while loading) against ``dcp.load`` + ``set_state_dict`` of
the same step, each checked bitwise (parameters, AdamW moments and step counts) on its own. Rank 0 writes the
JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench._ckpt_fsdp")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--size", default="bench")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4, help="rounds of (plain, keel, dcp_async) blocks, order rotating")
    p.add_argument("--block", type=int, default=5, help="steps per block")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps of each kind first")
    p.add_argument("--scratch", type=Path, required=True, help="a local-disk folder for DCP's files")
    p.add_argument("--shm-dir", type=Path, required=True, help="a folder under /dev/shm for Keel's slots")
    p.add_argument("--restore-repeats", type=int, default=3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from bench._ckpt_common import config_of
    from keel.sdk.checkpoint import Checkpointer
    from keel.workload.fsdp import shard_model
    from keel.workload.model import build_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config_of(args.size)

    def build(seed: int) -> tuple[Any, Any]:
        model = shard_model(build_model(cfg, seed))
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    model, optimizer = build(0)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        optimizer.step()

    ckpt = Checkpointer(model=model, optimizer=optimizer, rank=rank, world_size=world, ckpt_dir=args.shm_dir,
                        groups={"dp": list(range(world)), "pp": [rank], "tp": [rank]})
    dcp_dir = args.shm_dir.parent / "dcp"  # shared memory, as Keel's slots: the medium is not what is compared
    # DCP's documentation: async_save's background collectives need a process group of their own, or they
    # interleave with the training's (gloo aborts on the mismatch).
    dcp_group = dist.new_group(backend="gloo")
    dcp_state: dict[str, Any] = {"future": None, "blocking": []}

    def dcp_save(step: int) -> None:
        t0 = time.perf_counter()
        if dcp_state["future"] is not None:
            dcp_state["future"].result()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp_state["future"] = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(dcp_dir),
                                           process_group=dcp_group)
        dcp_state["blocking"].append(time.perf_counter() - t0)

    def dcp_drain() -> None:
        if dcp_state["future"] is not None:
            dcp_state["future"].result()
            dcp_state["future"] = None

    step = 0

    def block(kind: str, steps: int) -> float:
        nonlocal step
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step()
            if kind == "keel":
                ckpt.snapshot(step)
            elif kind == "dcp_async":
                dcp_save(step)
            step += 1
        train_step()  # the last save's background work overlaps one more step, as every save's does
        step += 1
        if kind == "keel":
            ckpt.wait()
        elif kind == "dcp_async":
            dcp_drain()
        return time.perf_counter() - t0

    for kind in ("plain", "keel", "dcp_async"):
        block(kind, args.warmup)
    keel_skip = ckpt.stats().snapshots
    dcp_skip = len(dcp_state["blocking"])
    kinds = ["plain", "keel", "dcp_async"]
    overhead: dict[str, list[float]] = {"keel": [], "dcp_async": []}
    plain_steps: list[float] = []
    for r in range(args.rounds):
        order = kinds[r % 3:] + kinds[: r % 3]
        walls = {kind: block(kind, args.block) for kind in order}
        plain = walls["plain"] / (args.block + 1)
        plain_steps.append(plain)
        for kind in ("keel", "dcp_async"):
            overhead[kind].append((walls[kind] - (args.block + 1) * plain) / args.block)
    keel_blocking = list(ckpt.stats().blocking_s[keel_skip:])
    dcp_blocking = dcp_state["blocking"][dcp_skip:]
    # One more step, saved by both: the restores load the same state, the one the model holds now.
    train_step()
    ckpt.snapshot(step)
    ckpt.wait()
    last_step = step
    ckpt.close()
    dcp_save(last_step)
    dcp_drain()

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    # Restores into a fresh sharded model and optimizer (one step taken, as a restarted job's would have
    # none: AdamW's state is created by the load either way), same layout.
    from keel.agent.checkpointing import complete_slots

    slot = next(path for path, header in complete_slots(args.shm_dir, rank) if header.step == last_step)

    def full_state(m: Any, opt: Any) -> list[Any]:
        """Every parameter and optimizer tensor (AdamW moments, step counts) as full tensors, in order."""
        out = [v.full_tensor() for v in m.state_dict().values()]
        for per_param in opt.state_dict()["state"].values():
            out += [v.full_tensor() if hasattr(v, "full_tensor") else v for _, v in sorted(per_param.items())]
        return out

    reference = full_state(model, optimizer)

    def same(m: Any, opt: Any) -> bool:
        got = full_state(m, opt)
        return len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))

    def restores(build_fresh: Any, keel_load: Any) -> tuple[list[float], list[float], bool, bool]:
        """``args.restore_repeats`` restores of the saved step into fresh models from ``build_fresh``: Keel's
        (``keel_load(checkpointer)``) and DCP's (``dcp.load`` + ``set_state_dict``), each timed and checked bitwise."""
        keel_s, dcp_s, keel_same, dcp_same = [], [], True, True
        for _ in range(args.restore_repeats):
            fresh, fresh_opt = build_fresh(7)
            restorer = Checkpointer(model=fresh, optimizer=fresh_opt, rank=rank, world_size=world,
                                    groups={"dp": list(range(world)), "pp": [rank], "tp": [rank]})
            dist.barrier()
            t0 = time.perf_counter()
            keel_load(restorer)
            keel_s.append(time.perf_counter() - t0)
            keel_same &= same(fresh, fresh_opt)
            fresh, fresh_opt = build_fresh(7)
            dist.barrier()
            t0 = time.perf_counter()
            model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(dcp_dir))
            set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
            dcp_s.append(time.perf_counter() - t0)
            dcp_same &= same(fresh, fresh_opt)
        return keel_s, dcp_s, keel_same, dcp_same

    keel_restores, dcp_restores, same_keel, same_dcp = restores(build, lambda ckpt: ckpt.load_file(slot))

    # Restores with resharding: the same step into a fresh model on another layout (HSDP, a (1, world) mesh: the
    # same ranks, a different mesh), which needs every rank's shard: Keel's load_resharded of every rank's slot,
    # against DCP's load of its own save (DCP reshards too). One world size here (the bench is one gloo group);
    # the 4 -> 2 case is the integration test's.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    every_slot = [next(path for path, header in complete_slots(args.shm_dir, r) if header.step == last_step)
                  for r in range(world)]
    hsdp_mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))

    def build_hsdp(seed: int) -> tuple[Any, Any]:
        m = build_model(cfg, seed)
        for unit in m.blocks:
            fully_shard(unit, mesh=hsdp_mesh)
        fully_shard(m, mesh=hsdp_mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1)

    keel_reshards, dcp_reshards, same_keel_reshard, same_dcp_reshard = restores(
        build_hsdp, lambda ckpt: ckpt.load_resharded(every_slot))

    def every_rank(values: list[float]) -> list[list[float]]:
        """Each rank's samples (the same count on every rank), rank by rank."""
        mine = torch.tensor(values, dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        return [t.tolist() for t in gathered]

    local_bytes = sum(t.local.nbytes for t in _sharded_leaves(ckpt.state_tree()))
    out = {
        "ok": True,
        "world_size": world,
        "state_bytes_per_rank": slowest(local_bytes),
        "plain_step_ms": 1e3 * slowest(statistics.median(plain_steps)),
        "blocking_ms_keel_fsdp": 1e3 * slowest(statistics.fmean(keel_blocking)),
        "blocking_ms_dcp_async_fsdp": 1e3 * slowest(statistics.fmean(dcp_blocking)),
        "overhead_ms_keel_fsdp": 1e3 * slowest(statistics.median(overhead["keel"])),
        "overhead_ms_dcp_async_fsdp": 1e3 * slowest(statistics.median(overhead["dcp_async"])),
        "restore_s_keel_fsdp": slowest(statistics.median(keel_restores)),
        "restore_s_dcp_fsdp": slowest(statistics.median(dcp_restores)),
        "blocking_ms_keel_fsdp_median": 1e3 * slowest(statistics.median(keel_blocking)),
        "blocking_ms_dcp_async_fsdp_median": 1e3 * slowest(statistics.median(dcp_blocking)),
        "restore_s_reshard": slowest(statistics.median(keel_reshards)),
        "restore_s_dcp_reshard": slowest(statistics.median(dcp_reshards)),
        "restore_reshard_bitwise_keel": bool(slowest(0.0 if same_keel_reshard else 1.0) == 0.0),
        "restore_reshard_bitwise_dcp": bool(slowest(0.0 if same_dcp_reshard else 1.0) == 0.0),
        "restore_fsdp_bitwise_keel": bool(slowest(0.0 if same_keel else 1.0) == 0.0),
        "restore_fsdp_bitwise_dcp": bool(slowest(0.0 if same_dcp else 1.0) == 0.0),
        "measured_by_rank": {"keel_blocking_s": every_rank(keel_blocking), "dcp_blocking_s": every_rank(dcp_blocking),
                             "keel_overhead_s": every_rank(overhead["keel"]),
                             "dcp_overhead_s": every_rank(overhead["dcp_async"]),
                             "keel_restore_s": every_rank(keel_restores), "dcp_restore_s": every_rank(dcp_restores),
                             "keel_reshard_s": every_rank(keel_reshards), "dcp_reshard_s": every_rank(dcp_reshards)},
    }
    out["restore_fsdp_bitwise"] = out["restore_fsdp_bitwise_keel"] and out["restore_fsdp_bitwise_dcp"]
    if rank == 0:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _sharded_leaves(tree: Any) -> list[Any]:
    from keel.sdk.shard import ShardedTensor

    found: list[Any] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, ShardedTensor):
            found.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(tree)
    return found


if __name__ == "__main__":
    sys.exit(main())
