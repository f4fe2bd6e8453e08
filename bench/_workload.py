"""The detection benchmark's workload: ``keel.workload.train`` plus checkpoint phases (and, for the
ft_launcher peer, NVIDIA resiliency-ext rank heartbeats).

    python -m bench._workload [--ckpt-every K] [--ckpt-seconds S] [--ft-heartbeats] -- <keel.workload.train args>

The example workload has eval phases (``--eval-every``/``--eval-steps``) but no checkpoint. This wrapper
runs its ``main`` unchanged and, every ``K`` steps (after ``step_done``), enters the SDK's
``checkpoint`` phase on every rank: each rank ``torch.save``s its pipeline stage and optimizer-free
state dict to a scratch file, waits until ``S`` seconds have passed since the phase began (slow shared
storage, simulated: the point is a checkpoint longer than the step timeout), then all ranks meet in a
``barrier`` *inside* the phase, as ``torch.distributed.checkpoint`` does, so that no rank waits for a
slower one in the ``step`` phase.

``--ft-heartbeats``: connect to ft_launcher's rank monitor (``RankMonitorClient``) and send a heartbeat
after every step (and one at start), which is how resiliency-ext detects a hung rank. Benchmark-only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m bench._workload")
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--ckpt-seconds", type=float, default=0.0)
    p.add_argument("--ft-heartbeats", action="store_true")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, rest = _parse(sys.argv[1:] if argv is None else argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]

    import torch
    import torch.distributed as dist

    import keel.sdk
    import keel.workload.train as train

    stages: list[Any] = []
    original_split = train.split_stages

    def capture_split(*a: Any, **kw: Any) -> Any:
        result = original_split(*a, **kw)
        stages.extend(result)
        return result

    train.split_stages = capture_split  # type: ignore[assignment]

    ft_client = None
    if args.ft_heartbeats:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        ft_client = RankMonitorClient()
        ft_client.init_workload_monitoring()
        ft_client.send_heartbeat()

    original_init = keel.sdk.init
    rank = int(os.environ.get("RANK", "0"))
    pp = _pp_of(rest)
    ckpt_dir = tempfile.mkdtemp(prefix=f"keel-bench-ckpt-r{rank}-")

    def init(*a: Any, **kw: Any) -> Any:
        session = original_init(*a, **kw)
        step_done = session.step_done

        def wrapped(step: int, **kwargs: Any) -> None:
            step_done(step, **kwargs)  # reports, then applies an injected fault (may raise or block)
            if ft_client is not None:
                ft_client.send_heartbeat()
            if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
                t0 = time.monotonic()
                with session.phase("checkpoint"):
                    stage = stages[rank % pp] if len(stages) > rank % pp else None
                    if stage is not None:
                        torch.save(stage.state_dict(), os.path.join(ckpt_dir, "stage.pt"))
                    remaining = args.ckpt_seconds - (time.monotonic() - t0)
                    if remaining > 0:
                        time.sleep(remaining)
                    if dist.is_available() and dist.is_initialized():
                        dist.barrier()
                if ft_client is not None:
                    ft_client.send_heartbeat()
                if rank == 0:
                    print(f"checkpoint step {step} took_s {time.monotonic() - t0:.3f}", flush=True)

        session.step_done = wrapped  # type: ignore[method-assign]
        return session

    keel.sdk.init = init  # type: ignore[assignment]
    original_eval = train._evaluate

    def timed_eval(*a: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        result = original_eval(*a, **kw)
        if rank == 0:
            print(f"eval took_s {time.monotonic() - t0:.3f}", flush=True)
        return result

    train._evaluate = timed_eval  # type: ignore[assignment]
    try:
        return train.main(rest)
    finally:
        if ft_client is not None:
            try:
                ft_client.shutdown_workload_monitoring()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


def _pp_of(argv: list[str]) -> int:
    for i, arg in enumerate(argv):
        if arg == "--pp" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--pp="):
            return int(arg.split("=", 1)[1])
    return 1


if __name__ == "__main__":
    sys.exit(main())
