"""py-spy-like dumps of a large training job's processes, varied per rank, for the analyzer benchmark.

Copying one real dump to every rank (what the benchmark did before) flatters the analyzer: every frame
is the same object, every signature a cache hit. A real job's ranks differ, so these do, as py-spy
would show them with ``--nonblocking`` on a Megatron-style job (TP x PP x DP):

- **Main thread by pipeline stage.** Healthy ranks wait in the schedule's communication, and each stage
  waits somewhere else (the first stage sends, middle stages receive, the last computes the loss and
  all-reduces), with its own line numbers: PP clusters of about equal size, all healthy.
- **Per-rank volatile text** the analyzer must normalise away: each rank's compiled-graph file lives in
  its own ``/tmp/tmpXXXXXXXX/`` folder (inductor's per-process scratch), so no two ranks' frames are the
  same string.
- **Thread sets differ.** Besides the main thread, the pin-memory thread (its line torn anywhere in its
  loop), on some ranks a metrics writer, on some an asynchronous checkpoint writer, on some the
  resource sharer: other threads, other lines, other counts per rank.
- **Dataloader workers** (two per rank) in one of three states (waiting for an index, reading a sample,
  collating), in shares that keep every state healthy.
- **Culprits** (``culprit=True``): the main thread stuck inside the forward pass (a kernel that never
  returns) instead of in the schedule's communication.

The dumps are made as py-spy's JSON (threads innermost frame first) and turned into events by the
agent's own code (``keel.rules.stacks.parse_threads``, ``classify_role``, ``keel.agent.stack_capture.
captured_threads``). Deterministic for a seed.
"""

from __future__ import annotations

import random
from typing import Any

from keel.agent.stack_capture import captured_threads
from keel.events.types import CapturedProcess, CapturedThread
from keel.rules.stacks import classify_role, parse_threads

Frame = tuple[str, str, int]  # (function, file, line), outermost first as written here

_LAUNCH: list[Frame] = [
    ("<module>", "pretrain_gpt.py", 284),
    ("pretrain", "megatron/training/training.py", 387),
    ("train", "megatron/training/training.py", 1447),
    ("train_step", "megatron/training/training.py", 763),
    ("forward_backward_pipelining_without_interleaving", "megatron/core/pipeline_parallel/schedules.py", 1396),
]
_C10D = "torch/distributed/distributed_c10d.py"
_P2P = "megatron/core/pipeline_parallel/p2p_communication.py"


def _stage_frames(stage: int, stages: int) -> list[Frame]:
    """Where a healthy rank of ``stage`` waits (its own lines: each stage is its own cluster)."""
    if stage == stages - 1:
        return [("forward_step", "megatron/core/pipeline_parallel/schedules.py", 275),
                ("loss_func", "pretrain_gpt.py", 158),
                ("average_losses_across_data_parallel_group", "megatron/training/utils.py", 222),
                ("wrapper", "torch/distributed/c10d_logger.py", 81),
                ("all_reduce", _C10D, 2806)]
    call = "send_forward_recv_backward" if stage == 0 else "recv_forward"
    return [(call, _P2P, 417 + 31 * stage),
            ("_communicate", _P2P, 370),
            ("_p2p_ops", _P2P, 211),
            ("wait", _C10D, 4000 + stage)]


def _forward_frames(scratch: str) -> list[Frame]:
    return [("forward_step", "megatron/core/pipeline_parallel/schedules.py", 275),
            ("forward_step", "pretrain_gpt.py", 202),
            ("_wrapped_call_impl", "torch/nn/modules/module.py", 1751),
            ("_call_impl", "torch/nn/modules/module.py", 1762),
            ("forward", "megatron/core/models/gpt/gpt_model.py", 264),
            ("forward", "megatron/core/transformer/transformer_block.py", 549),
            ("forward", "megatron/core/transformer/transformer_layer.py", 396),
            ("forward", "megatron/core/transformer/attention.py", 508),
            ("compiled_fn", f"/tmp/{scratch}/inductor_graph_7.py", 41),
            ("call", f"/tmp/{scratch}/inductor_graph_7.py", 118)]


_THREAD_LOOP: list[Frame] = [("_bootstrap", "threading.py", 1002), ("_bootstrap_inner", "threading.py", 1045),
                             ("run", "threading.py", 982)]


def _aux_threads(rng: random.Random) -> list[tuple[str, list[Frame]]]:
    """The rank's other threads: which ones and at which line differ per rank."""
    out = [("pin_memory", [*_THREAD_LOOP, ("_pin_memory_loop", "torch/utils/data/_utils/pin_memory.py",
                                           rng.choice((49, 52, 55, 59))),
                           ("get", "queue.py", rng.choice((180, 171))), ("wait", "threading.py", 331)])]
    if rng.random() < 0.5:
        out.append(("metrics-writer", [*_THREAD_LOOP, ("_run", "torch/utils/tensorboard/writer.py",
                                                       rng.randrange(110, 140)), ("get", "queue.py", 180)]))
    if rng.random() < 0.3:
        out.append(("async-ckpt", [*_THREAD_LOOP, ("_worker", "megatron/core/dist_checkpointing/strategies/async_utils.py",
                                                   rng.choice((301, 315, 322))),
                                   ("write_data", "torch/distributed/checkpoint/filesystem.py", rng.randrange(300, 330))]))
    if rng.random() < 0.2:
        out.append(("Thread-1 (_serve)", [*_THREAD_LOOP, ("_serve", "multiprocessing/resource_sharer.py", 138),
                                          ("accept", "multiprocessing/connection.py", 479)]))
    return out


_WORKER_BASE: list[Frame] = [("<module>", "<string>", 1), ("spawn_main", "multiprocessing/spawn.py", 122),
                             ("_main", "multiprocessing/spawn.py", 135), ("_bootstrap", "multiprocessing/process.py", 314),
                             ("run", "multiprocessing/process.py", 108),
                             ("_worker_loop", "torch/utils/data/_utils/worker.py", 0)]
_WORKER_STATES: list[list[Frame]] = [
    [("get", "multiprocessing/queues.py", 113), ("poll", "multiprocessing/connection.py", 257)],
    [("fetch", "torch/utils/data/_utils/fetch.py", 52), ("__getitem__", "megatron/core/datasets/gpt_dataset.py", 173),
     ("get", "megatron/core/datasets/indexed_dataset.py", 740)],
    [("fetch", "torch/utils/data/_utils/fetch.py", 55), ("default_collate", "torch/utils/data/_utils/collate.py", 398)],
]
_WORKER_LOOP_LINES = (309, 349, 351)  # where _worker_loop is in each state


class Dumps:
    """Makes every rank's processes (the rank and two dataloader workers) as the agent ships them."""

    def __init__(self, seed: int, stages: int = 8) -> None:
        self.seed = seed
        self.stages = stages
        self._cache: dict[tuple[Any, ...], list[CapturedThread]] = {}

    def _threads(self, pid: int, threads: list[tuple[str, list[Frame]]], main: int) -> tuple[list[dict[str, Any]], str]:
        """py-spy's JSON for a process (thread ``main`` is the main thread: its OS id is the pid)."""
        dumped = []
        for index, (name, frames) in enumerate(threads):
            dumped.append({"pid": pid, "thread_id": 140000000000000 + pid * 16 + index,
                           "thread_name": name, "os_thread_id": pid if index == main else pid + 100 + index,
                           "active": index == main, "owns_gil": False,
                           "frames": [{"name": f, "filename": "/opt/venv/lib/python3.11/" + path if "/" in path else path,
                                       "short_filename": path, "line": line, "module": None, "is_entry": i == 0}
                                      for i, (f, path, line) in enumerate(reversed(frames))]})
        threads_parsed = parse_threads(dumped)
        return dumped, classify_role(threads_parsed)

    def rank_processes(self, rank: int, stage: int, culprit: bool = False) -> list[CapturedProcess]:
        rng = random.Random(self.seed * 1_000_003 + rank)
        pid = 200_000 + 3 * rank
        scratch = "tmp" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789_") for _ in range(8))
        # Each rank's step runs compiled code from its own scratch folder: per-rank text, one signature.
        compiled = [("_fn", "torch/_dynamo/eval_frame.py", 655), ("compiled_schedule", f"/tmp/{scratch}/graph_step.py", 17)]
        main_frames = _LAUNCH[:4] + compiled + _LAUNCH[4:] + (_forward_frames(scratch) if culprit else _stage_frames(stage, self.stages))
        threads = [("MainThread", main_frames), *_aux_threads(rng)]
        dumped, _ = self._threads(pid, threads, 0)
        out = [CapturedProcess(pid=pid, rank=rank, role="rank", threads=captured_threads(parse_threads(dumped)))]
        for worker in (1, 2):
            state = (rank * 7 + worker * 3) % 20
            state = 0 if state < 8 else 1 if state < 15 else 2  # shares 8 : 7 : 5, each over half the largest
            frames = [*_WORKER_BASE[:-1], (_WORKER_BASE[-1][0], _WORKER_BASE[-1][1], _WORKER_LOOP_LINES[state]),
                      *_WORKER_STATES[state]]
            feeder = ("QueueFeederThread", [*_THREAD_LOOP, ("_feed", "multiprocessing/queues.py", rng.choice((231, 239))),
                                            ("wait", "threading.py", 327)])
            dumped, role = self._threads(pid + worker, [feeder, ("MainThread", frames)], 1)
            out.append(CapturedProcess(pid=pid + worker, parent_pid=pid, rank=rank, role=role,  # type: ignore[arg-type]
                                       threads=captured_threads(parse_threads(dumped))))
        return out
