"""The detection benchmark's workload: ``keel.workload.train`` plus checkpoint phases (and, for the
ft_launcher peer, NVIDIA resiliency-ext rank heartbeats).

    python -m bench._workload [--ckpt-every K] [--ckpt-seconds S] [--ft-heartbeats] -- <keel.workload.train args>

The example workload has eval phases (``--eval-every``/``--eval-steps``) but no checkpoint. This wrapper
runs its ``main`` unchanged and, every ``K`` steps (after ``step_done``), enters the SDK's
``checkpoint`` phase on every rank: each rank ``torch.save``s its pipeline stage and optimizer-free
state dict to a scratch file, waits until ``S`` seconds (rank 0) or ``S / 2`` (the others) have passed
since the phase began (slow shared storage, simulated: the point is a checkpoint longer than any hang
timeout, and ranks that finish first), then all ranks meet in a ``barrier`` *inside* the phase, as
``torch.distributed.checkpoint`` does, marked as a collective (``Session.waiting``): the ranks that finished
first wait there about ``S / 2``, in the checkpoint phase, not the step phase. ``--eval-seconds S`` pads
every eval the same way (rank 0 to ``S``, the others to ``S / 2``, then a barrier inside the eval phase).

The phases a hang detector must not mistake for a hang (each knob 0 = off):

- ``--first-step-seconds S``: the first step compiles (``torch.compile``, autotuning): rank 0 spends ``S``
  seconds before its first collective, every other rank ``S / 2``, so the others wait about ``S / 2``
  inside it, before any step time is known;
- ``--loader-stall-every K --loader-stall-seconds S``: every ``K`` steps one rank (in turn) waits ``S``
  seconds for its data loader after ``step_done``; its peers wait for it inside the next collective.

``--ft-heartbeats``: connect to ft_launcher's rank monitor (``RankMonitorClient``) and send a heartbeat
after every step (and one at start), which is how resiliency-ext detects a hung rank. Benchmark-only.
``--ft-calc-timeouts``: as resiliency-ext's heartbeat example does, have the client calculate the heartbeat
timeouts from the intervals it observed (``calculate_and_set_hb_timeouts``: the longest interval times its
safety factor) after every checkpoint, once the first eval has run: a careful user's setting, where the
defaults (60 min initial, 45 min between heartbeats) are for jobs nobody has measured.
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
    p.add_argument("--ft-calc-timeouts", action="store_true")
    p.add_argument("--eval-seconds", type=float, default=0.0)
    p.add_argument("--first-step-seconds", type=float, default=0.0)
    p.add_argument("--loader-stall-every", type=int, default=0)
    p.add_argument("--loader-stall-seconds", type=float, default=0.0)
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

    world = int(os.environ.get("WORLD_SIZE", "1"))
    evals_done: list[float] = []

    sessions: list[Any] = []

    def init(*a: Any, **kw: Any) -> Any:
        session = original_init(*a, **kw)
        sessions.append(session)
        step_done = session.step_done
        waiting = session.waiting
        compiled: list[bool] = []

        def first_collective_compiles(name: str = "collective") -> Any:
            # The first collective of the first step comes after this rank's "compilation".
            if args.first_step_seconds > 0 and not compiled and session.current_phase == "step":
                compiled.append(True)
                time.sleep(args.first_step_seconds if rank == 0 else args.first_step_seconds / 2)
            return waiting(name)

        def wrapped(step: int, **kwargs: Any) -> None:
            step_done(step, **kwargs)  # reports, then applies an injected fault (may raise or block)
            if ft_client is not None:
                ft_client.send_heartbeat()
            every = args.loader_stall_every
            if every and args.loader_stall_seconds > 0 and (step + 1) % every == 0 and rank == ((step + 1) // every) % world:
                time.sleep(args.loader_stall_seconds)  # this rank's data loader stalls; its peers wait for it
            if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
                t0 = time.monotonic()
                with session.phase("checkpoint"):
                    stage = stages[rank % pp] if len(stages) > rank % pp else None
                    if stage is not None:
                        torch.save(stage.state_dict(), os.path.join(ckpt_dir, "stage.pt"))
                    pad_then_meet(session, t0, args.ckpt_seconds, "checkpoint_barrier")
                if ft_client is not None:
                    ft_client.send_heartbeat()
                    if args.ft_calc_timeouts and evals_done:
                        ft_client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
                        if rank == 0:
                            print(f"ft timeouts calculated: {getattr(ft_client, 'hb_timeouts', '?')}", flush=True)
                if rank == 0:
                    print(f"checkpoint step {step} took_s {time.monotonic() - t0:.3f}", flush=True)

        session.step_done = wrapped  # type: ignore[method-assign]
        session.waiting = first_collective_compiles  # type: ignore[method-assign]
        return session

    keel.sdk.init = init  # type: ignore[assignment]
    original_eval = train._evaluate

    def pad_then_meet(session: Any, t0: float, seconds: float, barrier: str) -> None:
        """Rank 0 takes ``seconds`` since ``t0``, the others half that; then all meet in a barrier."""
        remaining = (seconds if rank == 0 else seconds / 2) - (time.monotonic() - t0)
        if remaining > 0:
            time.sleep(remaining)
        if dist.is_available() and dist.is_initialized():
            with session.waiting(barrier):
                dist.barrier()

    def timed_eval(*a: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        result = original_eval(*a, **kw)
        if args.eval_seconds > 0 and sessions:
            pad_then_meet(sessions[0], t0, args.eval_seconds, "eval_barrier")
        evals_done.append(time.monotonic() - t0)
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
