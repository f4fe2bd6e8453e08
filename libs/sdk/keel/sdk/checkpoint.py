"""Every-step, in-memory checkpoints of a rank's whole training state, off the critical path.

    ckpt = keel.sdk.Checkpointer(session, model=model, optimizer=optimizer, scheduler=scheduler,
                                 sampler=sampler, groups={"dp": [...], "pp": [...], "tp": [...]})
    start = ckpt.restore() + 1                 # in the setup phase; -1 + 1 = 0 for a fresh start
    for step in range(start, steps):
        ...                                    # forward, backward
        optimizer.step()                       # pre-hook: waits for the copy of step - 1
        scheduler.step()
        ckpt.snapshot(step)                    # or let session.step_done(step) call it
    ckpt.close()

``snapshot(step)`` captures the small state (scheduler, sampler, RNGs, scalars) into JSON at once and
keeps *references* to the model's parameters and the optimizer's state tensors, which nothing changes
until the next ``optimizer.step`` (other tensors, e.g. BatchNorm statistics that the forward pass
updates, are cloned). A daemon thread then copies the tensors into ring slot ``step % slots`` of
``$KEEL_CKPT_DIR`` (``keel.checkpoint.slots``: WRITING, payload, SHA-256 and XXH3-128, COMPLETE) and reports the step
to the node agent. A pre-hook on ``optimizer.step`` waits for that copy, so the copy overlaps the next
forward and backward (``Tensor.copy_`` and ``hashlib`` release the GIL) and the state it reads is never
modified under it. CUDA tensors are first copied on a side stream into a pinned host buffer.

Contract: between ``snapshot(s)`` and the next ``optimizer.step``, parameters and optimizer state are
changed only by ``optimizer.step`` (call ``wait()`` before changing them any other way).

``restore()`` loads, in this order: the agent's restore plan (``$KEEL_RESTORE_PLAN``), an explicit file,
the newest verified slot of ``ckpt_dir`` (the newest step every rank holds, when torch.distributed is
initialised), or nothing. A checkpoint of another rank, topology or model is refused with
``CheckpointMismatchError`` before anything is loaded.

Sharded models (FSDP2's ``fully_shard``, tensor parallelism: parameters that are ``DTensor``s) are read and
loaded through ``torch.distributed.checkpoint.state_dict``'s ``get_state_dict`` / ``set_state_dict``: each
rank's slot holds its local shards with their global layout (``keel.sdk.shard.ShardedTensor``) and the
optimizer state keyed by parameter name. ``restore()`` needs the same layout (device mesh shape and
placements); another one is refused, naming the difference. ``load_resharded`` loads every saved rank's shard
of another world size or layout and cuts this rank's part out of them (``keel.sdk.reshard``).

ZeRO-1 (``torch.distributed.optim.ZeroRedundancyOptimizer``): each rank's slot holds the state of its own
partition only (the wrapped local optimizer's ``state_dict``, by reference like any optimizer state), never the
consolidated whole, which would gather every rank's state to one every step. A restore needs the same world
size (the partition follows it); the wrapper's parameter groups get the restored hyperparameters too.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import logging
import math
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from keel.checkpoint import slots as ckpt_slots
from keel.checkpoint.owned import open_owned, read_owned_text
from keel.events.units import parse_duration
from keel.sdk import shard

if TYPE_CHECKING:
    from keel.sdk.session import Session

__all__ = [
    "Stateful",
    "CheckpointError",
    "CheckpointMismatchError",
    "read_checkpoint_ranks",
    "CheckpointCorruptError",
    "CheckpointStats",
    "Checkpointer",
    "DEFAULT_RESTORE_TIMEOUT",
]

_log = logging.getLogger("keel.sdk")

DEFAULT_RESTORE_TIMEOUT = timedelta(seconds=120)
_PLAN_POLL_S = 0.05
_SLOT_HEADROOM_BYTES = 64 * 1024  # plus 10 %: small layout changes reuse the slot files
_STATS_WINDOW = 100_000  # snapshots kept for stats()
_COMMON_CANDIDATES = 16  # own steps offered per rank when agreeing on a common one (same on every rank)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (failed copy, missing plan, bad digest, bad file)."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint of another rank, topology, model or optimizer: refused, nothing was loaded."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint whose bytes do not match their digest. Its tensors may already be in the model: the
    state is undefined until another restore succeeds (``snapshot`` refuses to write it meanwhile)."""


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@dataclass(frozen=True)
class CheckpointStats:
    """Per-snapshot measurements, oldest first (the last ``_STATS_WINDOW`` snapshots).

    ``capture_s``: the synchronous part of ``snapshot``; ``wait_s``: time the training thread waited for
    the copy (in the ``optimizer.step`` pre-hook, or in the next ``snapshot`` / ``close``);
    ``blocking_s = capture_s + wait_s``; ``copy_s``: the background copy into the slot (staging wait
    included); ``hash_s``: its digests (SHA-256 and XXH3-128); ``nbytes``: payload size.
    """

    snapshots: int
    capture_s: tuple[float, ...]
    wait_s: tuple[float, ...]
    blocking_s: tuple[float, ...]
    copy_s: tuple[float, ...]
    hash_s: tuple[float, ...]
    nbytes: tuple[int, ...]

    def mean(self, name: str) -> float:
        values = getattr(self, name)
        return sum(values) / len(values) if values else 0.0

    def p99(self, name: str) -> float:
        values = sorted(getattr(self, name))
        return values[max(0, math.ceil(0.99 * len(values)) - 1)] if values else 0.0

    def summary(self) -> dict[str, float]:
        """``{"snapshots", "bytes", "<name>_mean", "<name>_p99"}`` for every duration, in seconds."""
        out: dict[str, float] = {"snapshots": self.snapshots, "bytes": self.nbytes[-1] if self.nbytes else 0}
        for name in ("capture_s", "wait_s", "blocking_s", "copy_s", "hash_s"):
            out[name.removesuffix("_s") + "_mean_s"] = self.mean(name)
            out[name.removesuffix("_s") + "_p99_s"] = self.p99(name)
        return out


@dataclass
class _Job:
    step: int
    slot: int
    layout: shard.ShardLayout
    head: bytes
    sources: list[Any]  # tensors / arrays to copy (held alive until done)
    events: list[Any]  # torch.cuda.Event to wait for before copying (staged CUDA tensors)
    capture_s: float
    # The captured leaves themselves: a CUDA clone read by the side stream must not go back to the caching
    # allocator (and be reused by the next step's kernels) before the copy is done.
    keepalive: list[Any] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    copy_s: float = 0.0
    hash_s: float = 0.0


class _Slot:
    """One ring slot file, mapped; its typed destination views are made once per layout."""

    def __init__(self, path: Path, capacity: int) -> None:
        self.writer = ckpt_slots.SlotWriter(path, capacity)
        self._reserve(path, capacity)
        self.payload = self.writer.payload_view()
        self.layout: shard.ShardLayout | None = None
        self.views: list[Any] | None = None

    @staticmethod
    def _reserve(path: Path, capacity: int) -> None:
        # Allocate the tmpfs pages now: a full /dev/shm then fails here with ENOSPC instead of killing
        # the process with SIGBUS in the middle of a copy into the mapping.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)  # the file SlotWriter just checked
        try:
            os.posix_fallocate(fd, 0, ckpt_slots.HEADER_BYTES + capacity)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):  # no fallocate here: nothing to reserve
                raise
        finally:
            os.close(fd)

    def views_for(self, layout: shard.ShardLayout) -> list[Any]:
        if self.layout is not layout:
            self.views = None
            # Zero the payload once per layout, so that the padding between tensors is deterministic.
            self.payload[: layout.nbytes] = bytes(layout.nbytes)
            self.views = layout.destinations(self.payload)
            self.layout = layout
        assert self.views is not None
        return self.views

    def close(self) -> None:
        self.views = None
        self.layout = None
        try:
            self.payload.release()
            self.writer.close()
        except BufferError:  # a view still referenced somewhere: the mapping goes with the process
            _log.debug("slot %s still has exported views; leaving it mapped", self.writer.path)


class _CudaStager:
    """Copies the CUDA tensors of a snapshot into one pinned host buffer on a side stream per device.

    The copies start after the work already queued on each device's current stream (the optimizer step)
    and run while the next step is queued; the copy thread waits for the returned events.
    """

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._buffer: torch.Tensor | None = None

    def stage(self, leaves: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        cuda = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_cuda]
        if not cuda:
            return list(leaves), []
        offsets, total = {}, 0
        for i in cuda:
            offsets[i] = total
            total = (total + leaves[i].numel() * leaves[i].element_size() + 63) // 64 * 64
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
        sources, events = list(leaves), []
        for device in sorted({leaves[i].device.index for i in cuda}):
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for i in cuda:
                    t = leaves[i]
                    if t.device.index != device:
                        continue
                    n = t.numel() * t.element_size()
                    dst = self._buffer[offsets[i] : offsets[i] + n].view(t.dtype).reshape(t.shape)
                    dst.copy_(t, non_blocking=True)
                    sources[i] = dst
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        return sources, events


def _map_tree(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` with its dicts, lists and tuples rebuilt and every other value replaced by ``leaf(value)``."""
    if isinstance(obj, dict):
        return {k: _map_tree(v, leaf) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tree(v, leaf) for v in obj]
    if type(obj) is tuple:
        return tuple(_map_tree(v, leaf) for v in obj)
    return leaf(obj)


def _own_leaf(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, shard.ShardedTensor):
        return dataclasses.replace(obj, local=obj.local.detach().clone())
    if isinstance(obj, np.ndarray):
        return obj.copy()
    return obj


def _own_copy(obj: Any) -> Any:
    """``obj`` with every tensor and array copied: for state that may change before the copy thread reads it."""
    return _map_tree(obj, _own_leaf)


class _BackgroundCopy:
    """``_own_copy`` of a tree, its bytes copied on a thread while the caller goes on (with the model's load).

    ``tree`` is the copy's tree at once: every plain CPU tensor a new tensor of its own (filled by the
    thread: ``Tensor.copy_`` releases the GIL), every other leaf an ordinary ``_own_copy``. ``result()``
    waits for the copy and returns the tree, raising what the copy raised; nobody may read ``tree``'s
    tensors before it returns.
    """

    def __init__(self, obj: Any) -> None:
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def target(o: Any) -> Any:
            if type(o) is torch.Tensor and o.device.type == "cpu" and not o.requires_grad:
                # Allocated here, each on its own: the allocator's free lists serve tensors of these sizes
                # again (one buffer for all, or a huge-page mapping, measured slower on the benchmark's VM,
                # where every fresh page costs a fault, every restore).
                pairs.append((o, torch.empty_like(o)))
                return pairs[-1][1]
            return _own_leaf(o)

        self.tree = _map_tree(obj, target)
        self._error: BaseException | None = None

        def copy_all() -> None:
            try:
                with torch.no_grad():
                    for src, dst in pairs:
                        dst.copy_(src)
            except BaseException as exc:  # noqa: BLE001 - re-raised by result()
                self._error = exc

        self._thread = threading.Thread(target=copy_all, name="keel-restore-copy", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the copy has ended (its outcome left to ``result``)."""
        self._thread.join()

    def result(self) -> Any:
        """The copied tree, once every byte is in place."""
        self._thread.join()
        if self._error is not None:
            raise CheckpointError(f"copying the restored state failed: {self._error!r}") from self._error
        return self.tree


_RESHARD_HINT = "load every saved rank's shard with Checkpointer.load_resharded to reshard"


def _diff_sharded(key: str, old: Any, now: Any) -> list[str]:
    """How a saved ``ShardedTensor`` and a live DTensor differ (shape, dtype, layout), or one is not sharded."""
    if old is None:
        return []  # a missing key is reported by the caller
    if not isinstance(old, shard.ShardedTensor):
        return [f"{key}: a plain tensor in the checkpoint, sharded (DTensor) now (another layout)"]
    if not shard.is_dtensor(now):
        return [f"{key}: sharded ({old.layout_text()}) in the checkpoint, a plain tensor now (another layout)"]
    live = shard.ShardedTensor.of(now)
    problems = []
    if old.shape != live.shape or old.local.dtype != live.local.dtype:
        problems.append(f"{key}: {str(old.local.dtype).removeprefix('torch.')}{list(old.shape)} in checkpoint, "
                        f"{str(live.local.dtype).removeprefix('torch.')}{list(live.shape)} now")
    elif (old.placements, old.mesh_shape) != (live.placements, live.mesh_shape) or old.local.shape != live.local.shape:
        problems.append(f"{key}: laid out {old.layout_text()} (local {list(old.local.shape)}) in the checkpoint, "
                        f"{live.layout_text()} (local {list(live.local.shape)}) now (another layout)")
    return problems


def _env_duration(name: str, default: timedelta) -> timedelta:
    text = os.environ.get(name)
    return parse_duration(text) if text else default


def _not_stateful(name: str, obj: object) -> str:
    """Why ``obj`` cannot be checkpointed, and what to pass instead."""
    from torch.utils.data import DataLoader, Sampler

    if isinstance(obj, DataLoader):
        return (f"{name}: a plain DataLoader has no position to save; pass loader=keel.sdk.ResumableLoader(it) and "
                "iterate that wrapper (it resumes mid-epoch, with the same order and RNG), or use torchdata's "
                "StatefulDataLoader")
    if isinstance(obj, Sampler):
        return (f"{name}: {type(obj).__name__} has no state_dict(), and where the loop is in an epoch is known only "
                "to the loader that draws from it: wrap the DataLoader that uses it, "
                "loader=keel.sdk.ResumableLoader(DataLoader(..., sampler=sampler)), and iterate that wrapper")
    return f"{name} has no state_dict()/load_state_dict(): {type(obj).__name__}"


class Checkpointer:
    """Snapshots a rank's training state every step into shared-memory ring slots; restores it.

    ``model`` / ``optimizer`` / ``scheduler`` / ``scaler`` / ``sampler`` / ``loader`` and the ``extra``
    objects are anything with ``state_dict()`` / ``load_state_dict()``; every RNG (Python, NumPy, torch CPU,
    CUDA) is captured too. An ``extra`` object with ``keel_snapshot_by_reference = True`` has its state kept by
    reference at a snapshot, like parameters and optimizer state: its tensors must not change until the copy is
    done (``wait()``; the optimizer's step waits for it). ``loader``: a ``keel.sdk.ResumableLoader`` around a DataLoader, or torchdata's
    ``StatefulDataLoader`` (a plain DataLoader or a ``DistributedSampler`` is refused with what to pass). ``groups``: this rank's parallel groups ``{"dp", "pp", "tp", "shard"}`` (default: one group
    of every rank for ``dp``, just this rank for ``pp`` and ``tp``; for ``shard``, the ranks its state is sharded
    across, found from the model's DTensor meshes or a ZeroRedundancyOptimizer's process group by ``shard_group``,
    empty when nothing is sharded). The broker places backups by them. ``rank`` / ``world_size`` default to
    the session's, then torch.distributed's, then ``RANK`` / ``WORLD_SIZE``. ``ckpt_dir`` defaults to
    ``$KEEL_CKPT_DIR``; with neither, snapshots are off (``enabled`` is false) but ``restore`` from a plan
    or a file, ``save_file`` and ``load_file`` still work.

    With a ``session``, the Checkpointer attaches itself: ``session.step_done(step)`` then snapshots
    ``step`` (unless ``snapshot(step)`` was already called) and reports carry the newest complete step.
    Methods are for the training thread only.
    """

    def __init__(
        self,
        session: Session | None = None,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        sampler: Stateful | None = None,
        loader: Stateful | None = None,
        extra: Mapping[str, Stateful] | None = None,
        groups: Mapping[str, Sequence[int]] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        ckpt_dir: str | os.PathLike[str] | None = None,
        slots: int = 2,
        generation: int | None = None,
    ) -> None:
        if model is None and optimizer is None and not extra:
            raise ValueError("Checkpointer needs at least a model, an optimizer or an extra stateful object")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.session = session
        self.model, self.optimizer = model, optimizer
        self.zero = _is_zero_redundancy(optimizer)
        """Whether ``optimizer`` is a ``ZeroRedundancyOptimizer``: the state of this rank's partition is then its
        local optimizer's (``optimizer.optim``)."""
        if self.zero and getattr(optimizer, "_overlap_with_ddp", False):
            raise TypeError("ZeroRedundancyOptimizer(overlap_with_ddp=True) builds its local optimizer inside DDP's "
                            "communication hook, out of the Checkpointer's reach: use overlap_with_ddp=False")
        self.scheduler, self.scaler, self.sampler, self.loader = scheduler, scaler, sampler, loader
        self.extra: dict[str, Stateful] = dict(extra or {})
        for name, obj in [("scheduler", scheduler), ("scaler", scaler), ("sampler", sampler), ("loader", loader),
                          *self.extra.items()]:
            if obj is not None and not isinstance(obj, Stateful):
                raise TypeError(_not_stateful(name, obj))
        self.rank, self.world_size = self._identity(session, rank, world_size)
        groups = dict(groups or {})
        self.groups: dict[str, list[int]] = {
            "dp": [int(r) for r in groups.get("dp", range(self.world_size))],
            "pp": [int(r) for r in groups.get("pp", [self.rank])],
            "tp": [int(r) for r in groups.get("tp", [self.rank])],
            "shard": sorted({int(r) for r in groups["shard"]}) if "shard" in groups else shard_group(model, optimizer),
        }
        """This rank's parallel groups (global ranks), sent to the agent for backup placement. ``shard``: the ranks
        across which its state is sharded (empty when nothing is): its peers there hold other parts, not copies."""
        for name, members in self.groups.items():
            if self.rank not in members and (members or name != "shard"):
                raise ValueError(f"rank {self.rank} is not in its own {name} group {members}")
        # What a checkpoint records and a restore compares: the DP/PP/TP groups (the shard group follows from
        # the model's layout, which is compared tensor by tensor).
        self.topology = {**{k: len(self.groups[k]) for k in _TOPOLOGY_GROUPS},
                         "groups": {k: self.groups[k] for k in _TOPOLOGY_GROUPS}}
        env_dir = os.environ.get("KEEL_CKPT_DIR") or None
        self.ckpt_dir: Path | None = Path(ckpt_dir) if ckpt_dir else (Path(env_dir) if env_dir else None)
        self.slots = slots
        if generation is None:
            generation = session.config.generation if session is not None else int(os.environ.get("KEEL_GENERATION", "0"))
        self.generation = generation
        self.copy_hook: Callable[[int], None] | None = None
        """Test hook: called in the copy thread with the step, after WRITING and before the copy."""
        self.restored_from: str | None = None
        self.inexact: list[str] = []
        """After a restore: what is known to make this resumed run differ from an uninterrupted one (each also
        logged as a warning); empty when nothing is (``inexact_resume_reasons``)."""
        self._restore_called = False
        self._refused: str | None = None
        """Why the last restore failed verification (``snapshot`` refuses until a restore succeeds)."""
        self.last_complete_step = -1

        self._slots: dict[int, _Slot] = {}
        self._layout: shard.ShardLayout | None = None
        self._optim_structure: tuple[tuple[int, ...], dict[str, Any]] | None = None
        self.sharded = model is not None and any(shard.is_dtensor(p) for p in model.parameters())
        """Whether the model has DTensor parameters: its state is then read and loaded through
        ``torch.distributed.checkpoint.state_dict`` (local shards, optimizer state keyed by parameter name)."""
        self._inflight: _Job | None = None
        self._last_snapshot_step: int | None = None
        self._stager = _CudaStager() if torch.cuda.is_available() else None
        self._stats: dict[str, deque[float]] = {
            k: deque(maxlen=_STATS_WINDOW) for k in ("capture_s", "wait_s", "blocking_s", "copy_s", "hash_s", "nbytes")
        }
        self._snapshots = 0
        self.blocking_total_s = 0.0
        """Seconds the training thread has spent blocked in checkpointing so far (every snapshot's capture
        plus its wait for the copy; not only the last ``_STATS_WINDOW``): reported to the agent, for ETTR."""
        self._closed = False
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._hook: Any = None
        if self.enabled:
            self._worker = threading.Thread(target=self._copy_loop, name="keel-ckpt-copy", daemon=True)
            self._worker.start()
            if optimizer is not None:
                # ZeRO: the local optimizer's step is what changes the state kept by reference (the wrapper then
                # broadcasts the updated parameters), so the copy must be done before it starts.
                self._hook = self._local_optimizer.register_step_pre_hook(self._before_optimizer_step)
            if session is not None:
                session.attach_checkpointer(self)

    @staticmethod
    def _identity(session: Session | None, rank: int | None, world_size: int | None) -> tuple[int, int]:
        dist_up = torch.distributed.is_available() and torch.distributed.is_initialized()
        if rank is None:
            rank = (session.config.rank if session is not None
                    else torch.distributed.get_rank() if dist_up else int(os.environ.get("RANK", "0")))
        if world_size is None:
            world_size = (session.config.world_size if session is not None
                          else torch.distributed.get_world_size() if dist_up else int(os.environ.get("WORLD_SIZE", "1")))
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        return rank, world_size

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called: no snapshot is taken any more."""
        return self._closed

    @property
    def enabled(self) -> bool:
        """Whether ``snapshot`` writes slots (a ``ckpt_dir`` is set)."""
        return self.ckpt_dir is not None

    # -- the state tree ----------------------------------------------------------------------------------------

    def state_tree(self, *, for_snapshot: bool = False) -> dict[str, Any]:
        """The whole state as one tree. ``for_snapshot``: copy every tensor that may change before the
        next ``optimizer.step`` (all but parameters and optimizer state, which are kept by reference)."""
        copy = _own_copy if for_snapshot else (lambda x: x)
        tree: dict[str, Any] = {}
        if self.sharded:
            tree.update(self._sharded_state(copy))
        elif self.model is not None:
            params: dict[str, Any] = {}
            for key, value in self.model.state_dict(keep_vars=True).items():
                if isinstance(value, nn.Parameter):
                    params[key] = value.detach()
                else:  # buffers (updated by the forward pass) and extra state
                    params[key] = copy(value.detach() if isinstance(value, torch.Tensor) else value)
            tree["model"] = params
        if self.optimizer is not None and not self.sharded:
            tree["optimizer"] = self._local_optimizer.state_dict()
            if self.zero:
                # Between steps the wrapper's groups are the current ones (a scheduler has just set the next
                # step's lr there); the local optimizer's get them only at the wrapper's next step.
                for packed, outer in zip(tree["optimizer"]["param_groups"], self.optimizer.param_groups, strict=True):
                    packed.update({k: v for k, v in outer.items() if k != "params"})
        for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler), ("sampler", self.sampler),
                          ("loader", self.loader)):
            if obj is not None:
                tree[name] = copy(obj.state_dict())
        if self.extra:
            tree["extra"] = {name: obj.state_dict() if getattr(obj, "keel_snapshot_by_reference", False)
                             else copy(obj.state_dict()) for name, obj in self.extra.items()}
        rng: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        tree["rng"] = rng
        return tree

    def _sharded_state(self, copy: Callable[[Any], Any]) -> dict[str, Any]:
        """Model and optimizer state of a sharded model, read with DCP's ``get_state_dict``: parameters and
        optimizer state by reference (their local shards, as ``ShardedTensor``), buffers through ``copy``."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        assert self.model is not None
        optim_sd: dict[str, Any] | None = None
        if self.optimizer is not None and self.optimizer.state:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        else:
            # No optimizer state yet (before the first step, or a stateless optimizer): DCP's get_state_dict
            # would create it by running optimizer.step() with zero gradients, which changes training (AdamW's
            # step count) and fires the user's hooks. There is nothing to save but the hyperparameters.
            model_sd = get_model_state_dict(self.model)
            if self.optimizer is not None:
                optim_sd = {"state": {}, "param_groups": [{k: copy(v) for k, v in group.items() if k != "params"}
                                                          for group in self.optimizer.param_groups]}
        params = self._param_names()
        model: dict[str, Any] = {}
        for key, value in model_sd.items():
            leaf: Any = value
            if shard.is_dtensor(value):
                leaf = shard.ShardedTensor.of(value, ("model", key))
            elif isinstance(value, torch.Tensor):
                leaf = value.detach()
            # Parameters by reference (only optimizer.step changes them before the copy); buffers copied.
            model[key] = leaf if key in params else copy(leaf)
        out: dict[str, Any] = {"model": model}
        if optim_sd is not None:
            out["optimizer"] = _sharded_leaves(optim_sd, ("optimizer",))
        return out

    def _param_names(self) -> set[str]:
        """Every name of every parameter (a shared one under each of its names, as DCP's state dict lists it)."""
        names = getattr(self, "_param_names_cache", None)
        if names is None:
            assert self.model is not None
            names = self._param_names_cache = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        return names

    def _live_meshes(self) -> dict[str, Any]:
        """The device mesh of each sharded entry of the live model's state dict, by its name (a shared
        parameter under each of its names; every ``fully_shard`` unit may have a mesh object of its own)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return {key: getattr(value, "device_mesh") for key, value in get_model_state_dict(self.model).items()  # noqa: B009
                if shard.is_dtensor(value)}

    def _structure(self) -> dict[str, Any]:
        """What ``restore`` checks besides the tensors: the registered parts and the optimizer's params."""
        out: dict[str, Any] = {"components": sorted(self._components())}
        if self.optimizer is not None:
            groups = self._local_optimizer.param_groups
            key = tuple(len(g["params"]) for g in groups)
            if self._optim_structure is None or self._optim_structure[0] != key:
                rows = [[list(p.shape), str(p.dtype)] for g in groups for p in g["params"]]
                fp = hashlib.sha256(json.dumps(rows).encode()).hexdigest()
                structure: dict[str, Any] = {"group_sizes": list(key), "params_fingerprint": fp}
                if self.zero:
                    structure["sharding"] = f"zero1 over {self.world_size} ranks"
                self._optim_structure = (key, structure)
            out["optimizer"] = self._optim_structure[1]
        return out

    @property
    def _local_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose state this rank holds: ZeRO's local one (its partition), or the optimizer."""
        assert self.optimizer is not None
        return self.optimizer.optim if self.zero else self.optimizer  # type: ignore[attr-defined]

    def _components(self) -> list[str]:
        names = [n for n, o in (("model", self.model), ("optimizer", self.optimizer), ("scheduler", self.scheduler),
                                ("scaler", self.scaler), ("sampler", self.sampler), ("loader", self.loader))
                 if o is not None]
        return names + (["extra"] if self.extra else [])

    # -- snapshots ---------------------------------------------------------------------------------------------

    def snapshot(self, step: int, *, again: bool = False) -> None:
        """Snapshot the state after ``step`` (call after ``optimizer.step`` and ``scheduler.step``).

        Returns once the small state is captured; the copy into slot ``step % slots`` runs in the
        background. A second call for the same step does nothing, unless ``again``: the state after ``step``
        changed without a new step (an evaluation ran after it and drew from the RNGs), and the slot of ``step``
        is written anew (while it is, the previous step's slot is the newest complete one). No-op when not
        ``enabled``.
        """
        if not self.enabled or self._closed or (step == self._last_snapshot_step and not again):
            return
        if again and self._last_snapshot_step is not None and step < self._last_snapshot_step:
            raise CheckpointError(f"rank {self.rank}: snapshot({step}, again=True) after step "
                                  f"{self._last_snapshot_step} was taken: only the newest step can be taken again")
        if self._refused is not None:
            raise CheckpointError(f"rank {self.rank}: snapshot({step}) refused: the last restore failed "
                                  f"verification, the state is not a checkpoint's ({self._refused})")
        if not self._restore_called and os.environ.get("KEEL_RESTORE_PLAN"):
            # Under an agent the slots may still hold what the restore plan points at: writing one
            # before restoring could overwrite the very snapshot this rank is to resume from.
            raise CheckpointError(f"rank {self.rank}: snapshot({step}) before restore(): under a Keel agent, "
                                  "call restore() first (it may resume from these slots)")
        self._wait_inflight()
        t0 = time.perf_counter()
        captured = shard.capture_state(self.state_tree(for_snapshot=True))
        layout = self._layout
        if layout is None or not layout.fits(captured):
            layout = self._plan(captured, None)
        extra_meta = {"structure": self._structure()}
        head = layout.encode_head(captured, step=step, rank=self.rank, world_size=self.world_size,
                                  topology=self.topology, extra_meta=extra_meta)
        if len(head) > layout.data_offset:  # the meta outgrew its reserve: re-plan with more room
            layout = self._plan(captured, len(head))
            head = layout.encode_head(captured, step=step, rank=self.rank, world_size=self.world_size,
                                      topology=self.topology, extra_meta=extra_meta)
        self._layout = layout
        sources, events = (self._stager.stage(captured.leaves) if self._stager is not None
                           else (captured.leaves, []))
        job = _Job(step, step % self.slots, layout, head, sources, events, capture_s=time.perf_counter() - t0,
                   keepalive=captured.leaves if events else [])
        self._last_snapshot_step = step
        self._inflight = job
        self._queue.put(job)

    def _plan(self, captured: shard.CapturedState, meta_len: int | None) -> shard.ShardLayout:
        if meta_len is None:  # size the meta reserve from this step's meta, with room to grow
            probe = shard.ShardLayout.plan(captured, 0)
            meta_len = len(probe.encode_head(captured, step=0, rank=self.rank, world_size=self.world_size,
                                             topology=self.topology, extra_meta={"structure": self._structure()}))
        return shard.ShardLayout.plan(captured, meta_len + meta_len // 4 + 4096)

    def wait(self) -> None:
        """Block until the in-flight copy (if any) is complete. Raises ``CheckpointError`` if it failed."""
        self._wait_inflight()

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._wait_inflight()

    def _wait_inflight(self) -> None:
        job = self._inflight
        if job is None:
            return
        t0 = time.perf_counter()
        job.done.wait()
        waited_s = time.perf_counter() - t0
        self._inflight = None
        for name, value in (("capture_s", job.capture_s), ("wait_s", waited_s), ("blocking_s", job.capture_s + waited_s),
                            ("copy_s", job.copy_s), ("hash_s", job.hash_s), ("nbytes", job.layout.nbytes)):
            self._stats[name].append(value)
        self._snapshots += 1
        self.blocking_total_s += job.capture_s + waited_s
        if job.error is not None:
            raise CheckpointError(f"rank {self.rank}: checkpoint of step {job.step} failed: {job.error!r}") from job.error

    def _copy_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._copy(job)
            except BaseException as exc:  # reported to the training thread by _wait_inflight
                _log.error("keel checkpoint of step %d failed: %r", job.step, exc)
                job.error = exc
            finally:
                job.sources = job.keepalive = []  # drop the references before signalling
                job.done.set()

    def _copy(self, job: _Job) -> None:
        t0 = time.perf_counter()
        for event in job.events:
            event.synchronize()
        slot = self._slot(job.slot, job.layout.nbytes)
        slot.writer.begin(job.step, self.generation)
        if self.copy_hook is not None:
            self.copy_hook(job.step)
        n = shard.write_payload(slot.payload, job.layout, job.head, job.sources, slot.views_for(job.layout))
        t1 = time.perf_counter()
        payload = slot.payload[:n]
        # Both digests of the same bytes: the SHA-256 travels (inventory, peer backup, persistent tier),
        # the XXH3-128 is what a local restore checks (a few ms, against tens for the SHA-256).
        digest, fast_digest = ckpt_slots.sha256_hex(payload), ckpt_slots.xxh3_128_hex(payload)
        slot.writer.complete(job.step, n, digest, self.generation, fast_digest)
        job.copy_s, job.hash_s = t1 - t0, time.perf_counter() - t1
        self.last_complete_step = job.step
        if self.session is not None:
            self.session.checkpoint_completed(job.step)

    def _slot(self, index: int, nbytes: int) -> _Slot:
        slot = self._slots.get(index)
        if slot is None or slot.writer.capacity < nbytes:
            if slot is not None:
                slot.close()
            assert self.ckpt_dir is not None
            capacity = nbytes + nbytes // 10 + _SLOT_HEADROOM_BYTES
            slot = self._slots[index] = _Slot(ckpt_slots.slot_path(self.ckpt_dir, self.rank, index), capacity)
        return slot

    def stats(self) -> CheckpointStats:
        """Measurements of the snapshots whose copy the training thread has waited for."""
        s = self._stats
        return CheckpointStats(self._snapshots, tuple(s["capture_s"]), tuple(s["wait_s"]), tuple(s["blocking_s"]),
                               tuple(s["copy_s"]), tuple(s["hash_s"]), tuple(int(x) for x in s["nbytes"]))

    def close(self) -> None:
        """Wait for the in-flight copy, stop the copy thread, unmap the slots. Idempotent."""
        if self._closed:
            return
        try:
            self._wait_inflight()
        finally:
            self._closed = True
            if self._hook is not None:
                self._hook.remove()
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join(timeout=10.0)
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- files -------------------------------------------------------------------------------------------------

    def save_file(self, path: str | os.PathLike[str], *, step: int) -> int:
        """Write the current full state as a shard file (atomically). Returns its size in bytes.

        The same state always gives the same bytes, so two files can be compared bitwise.
        """
        payload = shard.encode_state(self.state_tree(), step=step, rank=self.rank, world_size=self.world_size,
                                     topology=self.topology, extra_meta={"structure": self._structure()})
        ckpt_slots.write_file_atomic(Path(path), payload)
        return len(payload)

    def load_file(self, path: str | os.PathLike[str], *, digest: str | None = None) -> int:
        """Load a slot file or a shard file (verified against ``digest`` if given); returns its step."""
        return self._load_verified(Path(path), digest, trusted=False)

    def load_resharded(self, sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> int:
        """Load a checkpoint that another layout saved (another world size, another device mesh): every saved
        rank's shard is read, verified and cut into the part this rank holds now. Returns the step.

        ``sources``: a persistent-tier step directory (``manifest.json`` and its ``rank-*.shard`` files, each
        checked against the manifest's SHA-256), or every saved rank's slot or shard file (a slot is checked
        against its own digest; a plain shard file is not checked). What is resharded, and how:

        - sharded parameters and optimizer state (FSDP2 / DTensor): the new local chunk is copied from the
          saved chunks that overlap it (``keel.sdk.reshard``), bitwise;
        - replicated model and optimizer state (DDP: every rank holds all of it): saved rank 0's;
        - the scheduler, scaler, sampler, loader and extra objects: the object's ``reshard_state_dict(states)``
          (one state per saved rank, in rank order) when it has one, else their state if every saved rank's is
          equal, else refused;
        - RNG states: saved rank ``r``'s for rank ``r`` where the old layout had one; a rank beyond it keeps its own.

        Refused with ``CheckpointMismatchError`` before anything is loaded: a checkpoint that misses a rank's
        shard or mixes steps, another model or set of components, ZeRO-1 state (its partition follows the world
        size), pipeline or tensor-parallel groups that change which parameters a rank holds, a placement that
        cannot be cut (``Partial``).
        """
        from keel.sdk import reshard

        self._restore_called = True
        saved, where = read_checkpoint_ranks(sources)
        source = f"{len(saved)} shards of step {saved[0][0]['step']} ({where})"
        try:
            tree = self._resharded_tree(saved, source)
        except reshard.ReshardError as exc:
            raise CheckpointMismatchError(f"{source} cannot be resharded for rank {self.rank} of "
                                          f"{self.world_size}: {exc}") from None
        try:
            self._apply(tree, source)
        except BaseException as exc:
            # Everything was checked first; a part that still fails (a user object's load_state_dict) leaves the
            # others loaded: this state is no checkpoint's, so it must not be snapshotted as one.
            self._refused = f"{source}: loading failed part-way: {exc}"
            self.restored_from = None
            raise
        step = int(saved[0][0]["step"])
        old_world = int(saved[0][0]["world_size"])
        self.restored_from = f"{source}, resharded from {old_world} ranks to {self.world_size}"
        self._refused = None
        _log.info("keel restore: rank %d loaded step %d from %s", self.rank, step, self.restored_from)
        self.inexact = inexact_resume_reasons(self.model, self.world_size)
        for reason in self.inexact:
            _log.warning("keel restore: rank %d: the resumed run may differ from an uninterrupted one: %s",
                         self.rank, reason)
        return self._restored(step)

    def _resharded_tree(self, saved: list[tuple[dict[str, Any], Any]], source: str) -> dict[str, Any]:
        """This rank's state tree on the live layout, cut from every saved rank's (see ``load_resharded``)."""
        from keel.sdk import reshard

        def refuse(what: str) -> None:
            raise CheckpointMismatchError(f"{source} does not fit this run: {what}")

        metas = [m for m, _ in saved]
        trees = [t for _, t in saved]
        old_world = len(saved)
        if self.zero or any(((m.get("structure") or {}).get("optimizer") or {}).get("sharding") for m in metas):
            refuse("ZeroRedundancyOptimizer state is partitioned by the world size it was saved with; resharding it "
                   "is not supported (save with FSDP2, or restore on the same world size)")
        for meta in metas:
            saved_groups = (meta.get("topology") or {}).get("groups") or {}
            for kind in ("pp", "tp"):
                if len(saved_groups.get(kind) or [meta["rank"]]) != len(self.groups.get(kind) or [self.rank]):
                    refuse(f"{kind} groups of {len(saved_groups.get(kind) or [])} ranks in the checkpoint, "
                           f"{len(self.groups.get(kind) or [])} now: which parameters a rank holds changes; only a "
                           "change of the data-parallel (sharding) width is resharded")
        components = sorted(self._components())
        for rank, tree in enumerate(trees):
            if not isinstance(tree, dict) or sorted(k for k in tree if k != "rng") != components:
                refuse(f"rank {rank}'s shard has components {sorted(k for k in tree if k != 'rng') if isinstance(tree, dict) else tree!r}, "
                       f"this run registers {components}")
            if "model" in tree and set(tree["model"]) != set(trees[0]["model"]):
                refuse(f"rank {rank}'s shard holds other model entries than rank 0's")
            missing_extra = sorted(set(self.extra) - set(tree.get("extra") or {}))
            if missing_extra:
                refuse(f"rank {rank}'s shard has no state for extra objects {missing_extra}")
        if self.optimizer is not None:
            saved_opt = ((metas[0].get("structure") or {}).get("optimizer")) or {}
            now_opt = self._structure()["optimizer"]
            if saved_opt and (saved_opt.get("group_sizes"), saved_opt.get("params_fingerprint")) != (
                    now_opt["group_sizes"], now_opt["params_fingerprint"]):
                refuse(f"optimizer parameters differ: checkpoint groups {saved_opt.get('group_sizes')} (shapes "
                       f"{str(saved_opt.get('params_fingerprint'))[:12]}), now {now_opt['group_sizes']} "
                       f"(shapes {now_opt['params_fingerprint'][:12]})")
        out: dict[str, Any] = {}
        live_sd: dict[str, Any] = {}
        if self.model is not None:
            if self.sharded:
                from torch.distributed.checkpoint.state_dict import get_model_state_dict

                live_sd = get_model_state_dict(self.model)
            else:
                live_sd = self.model.state_dict()
            missing = sorted(set(live_sd) - set(trees[0]["model"]))
            unexpected = sorted(set(trees[0]["model"]) - set(live_sd))
            if missing or unexpected:
                refuse(f"model differs: missing in checkpoint {missing[:5]}, not in this model {unexpected[:5]}")
            out["model"] = {key: self._cut(key, live, [t["model"][key] for t in trees], old_world)
                            for key, live in live_sd.items()}
        if self.optimizer is not None:
            optims = [t["optimizer"] for t in trees]
            plain_now = not self.sharded
            plain_then = not any(isinstance(v, shard.ShardedTensor) for st in (optims[0].get("state") or {}).values()
                                 for v in st.values()) and all(
                isinstance(i, int) for g in optims[0].get("param_groups") or [] for i in g.get("params", []))
            if plain_now and plain_then:
                out["optimizer"] = optims[0]  # replicated then and now: every rank saved the same
            else:
                names = self._optimizer_param_names()
                optims = [_optimizer_by_name(o, names) for o in optims]
                state: dict[str, Any] = {}
                for fqn, entry in (optims[0].get("state") or {}).items():
                    live_param = live_sd.get(fqn)
                    if live_param is None:
                        refuse(f"optimizer state for {fqn!r}, which this model does not have")
                    state[fqn] = {k: (self._cut(f"{fqn}.{k}", live_param, [o["state"][fqn][k] for o in optims], old_world)
                                      if _is_parameter_shaped(v, live_param) else v)
                                  for k, v in entry.items()}
                groups = reshard.merge_rank_states("optimizer's parameter groups",
                                                   [o.get("param_groups") for o in optims], None)
                by_name = {**optims[0], "state": state, "param_groups": groups}
                out["optimizer"] = _optimizer_by_index(by_name, names) if plain_now else by_name
        for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler), ("sampler", self.sampler),
                          ("loader", self.loader)):
            if obj is not None:
                out[name] = reshard.merge_rank_states(name, [t[name] for t in trees],
                                                      getattr(obj, "reshard_state_dict", None))
        if self.extra:
            out["extra"] = {name: reshard.merge_rank_states(f"extra object {name!r}", [t["extra"][name] for t in trees],
                                                            getattr(obj, "reshard_state_dict", None))
                            for name, obj in self.extra.items()}
        if self.rank < old_world:
            out["rng"] = trees[self.rank].get("rng") or {}
        return out

    def _optimizer_param_names(self) -> list[str]:
        """The model's name of each parameter the optimizer holds, in the optimizer's order (what a plain
        ``state_dict``'s integer keys index): the bridge between a plain and a sharded optimizer state."""
        assert self.model is not None and self.optimizer is not None
        # DCP's names leave out the wrappers activation checkpointing and torch.compile insert.
        by_id = {id(p): name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
                 for name, p in self.model.named_parameters()}
        names = []
        for group in self._local_optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in by_id:
                    raise CheckpointMismatchError("an optimizer parameter is not one of the model's: its state cannot "
                                                  "be matched by name for resharding")
                names.append(by_id[id(param)])
        return names

    @staticmethod
    def _cut(key: str, live: Any, chunks: Sequence[Any], old_world: int) -> Any:
        """``live``'s part (its local chunk if a DTensor, else the whole tensor) of the saved ``chunks`` (one per
        saved rank), as the tree ``_apply`` loads: a ``ShardedTensor`` on the live layout, or a tensor."""
        from keel.sdk import reshard

        if not any(isinstance(c, shard.ShardedTensor) for c in chunks):
            if not shard.is_dtensor(live):
                saved = chunks[0]  # replicated then and now: every rank saved all of it
                if isinstance(live, torch.Tensor) and not (
                        isinstance(saved, torch.Tensor) and saved.shape == live.shape and saved.dtype == live.dtype):
                    raise reshard.ReshardError(f"{key}: {_describe(saved)} in the checkpoint, {_describe(live)} now")
                return saved
            whole = chunks[0]  # replicated then, sharded now: the live chunk is cut from rank 0's copy
            if not isinstance(whole, torch.Tensor):
                raise reshard.ReshardError(f"{key}: saved as {type(whole).__name__}, a sharded tensor now")
            global_shape, dtype = tuple(whole.shape), whole.dtype
            pieces = [(reshard.Box((0,) * whole.dim(), global_shape), whole)]
        elif not all(isinstance(c, shard.ShardedTensor) for c in chunks):
            raise reshard.ReshardError(f"{key}: sharded on some saved ranks, not on others")
        else:
            global_shape, dtype = chunks[0].shape, chunks[0].local.dtype
            if any(c.shape != global_shape for c in chunks):
                raise reshard.ReshardError(f"{key}: the saved ranks disagree on its global shape")
            pieces = [(reshard.saved_box(c, r, old_world), c.local) for r, c in enumerate(chunks)]
        if not shard.is_dtensor(live):
            if not isinstance(live, torch.Tensor) or tuple(live.shape) != tuple(global_shape) or live.dtype != dtype:
                raise reshard.ReshardError(f"{key}: {str(dtype).removeprefix('torch.')}{list(global_shape)} in the "
                                           f"checkpoint, {_describe(live)} now")
            whole = reshard.Box((0,) * len(global_shape), tuple(global_shape))
            return reshard.assemble(whole, pieces, dtype=dtype, what=key)
        if tuple(live.shape) != tuple(global_shape) or live.dtype != dtype:
            raise reshard.ReshardError(f"{key}: {str(dtype).removeprefix('torch.')}{list(global_shape)} in the "
                                       f"checkpoint, {str(live.dtype).removeprefix('torch.')}{list(live.shape)} now")
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        layout = shard.ShardedTensor.of(live, ("model", key))
        sizes, offsets = compute_local_shape_and_global_offset(live.shape, live.device_mesh, live.placements)
        local = reshard.assemble(reshard.Box(tuple(offsets), tuple(sizes)), pieces, dtype=dtype, what=key)
        return dataclasses.replace(layout, local=local)

    def _load_verified(self, path: Path, digest: str | None, *, trusted: bool, owned: bool = False) -> int:
        """Load ``path`` (a slot or a shard file), memory-mapped, checking its digest while it loads.

        A slot's payload is checked against its header's XXH3-128 (``SlotHeader.fast_digest``; its SHA-256
        when the slot has none), and the header's SHA-256 against ``digest`` if given: the two digests
        were taken of the same bytes by the writer, so the payload is the one ``digest`` names. A shard
        file (peer or disk copy) is checked against ``digest`` (SHA-256) when given. ``trusted``: a slot the
        node agent verified at its inventory and that nobody has written since (the plan's ``verified_by: agent``): only the header is compared.
        ``owned``: opened only if it is this user's own file, not through a symbolic link
        (``keel.checkpoint.owned``): a trusted slot is loaded on the plan's word, unhashed.

        The fast path (one pass over the bytes, verification included): the file is mapped private
        (copy-on-write, so nothing here can write to it), decoded into views of the mapping, and each
        model parameter is copied once, straight from the mapping into the live parameter; optimizer
        state and the small parts are copied once into tensors of their own (the optimizer keeps them).
        The hash runs on a second thread over the same mapped bytes meanwhile (``hashlib`` and ``xxhash``
        release the GIL). Its result gates success: on a mismatch ``CheckpointCorruptError`` is raised and this
        Checkpointer refuses to ``snapshot`` until a later restore succeeds, so state loaded from bad
        bytes can never be mistaken for a restore nor written as a checkpoint.
        """
        import mmap

        try:
            with (os.fdopen(open_owned(path), "rb") if owned else open(path, "rb")) as f:
                size = os.fstat(f.fileno()).st_size
                # MAP_PRIVATE + PROT_WRITE: writable views (torch refuses read-only buffers without a
                # warning) whose writes, if any, stay in this process; the file is never modified.
                mapped = (mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                          if size else None)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
        if mapped is None:
            raise CheckpointError(f"checkpoint {path} is empty")
        view = memoryview(mapped)
        payload: memoryview | None = None
        expected: str | None
        try:
            if view[:8] == ckpt_slots.MAGIC:
                try:
                    header = ckpt_slots.parse_header(view, str(path))
                except ckpt_slots.SlotError as exc:
                    raise CheckpointError(str(exc)) from None
                if not header.complete:
                    raise CheckpointError(f"slot {path} is not complete (state {header.state}, step {header.step})")
                end = ckpt_slots.HEADER_BYTES + header.payload_len
                if end > size:
                    raise CheckpointCorruptError(f"slot {path}: truncated payload ({size - ckpt_slots.HEADER_BYTES} of "
                                          f"{header.payload_len} bytes)")
                if digest is not None and header.digest != digest:
                    raise CheckpointCorruptError(f"{path}: slot digest {header.digest[:12]} is not the expected "
                                                 f"{digest[:12]}")
                payload, source = view[ckpt_slots.HEADER_BYTES:end], f"slot {path} (step {header.step})"
                if header.fast_digest:
                    expected, algorithm, hash_fn = header.fast_digest, "XXH3-128", ckpt_slots.xxh3_128_hex
                else:
                    expected, algorithm, hash_fn = header.digest, "SHA-256", ckpt_slots.sha256_hex
                corrupt_what = f"slot {path}: digest mismatch for step {header.step}"
            else:
                payload, expected, source = view, digest, f"shard {path}"
                algorithm, hash_fn = "SHA-256", ckpt_slots.sha256_hex
                corrupt_what = f"shard {path}: digest mismatch"
                trusted = False
            hashed: dict[str, str] = {}
            hasher = None
            if expected is not None and not trusted:
                def hash_payload(data: memoryview = payload) -> None:
                    hashed["digest"] = hash_fn(data)

                hasher = threading.Thread(target=hash_payload, name="keel-restore-hash")
                hasher.start()

            def mismatch() -> CheckpointError | None:
                if hasher is None:
                    return None
                hasher.join()
                if hashed.get("digest") == expected:
                    return None
                return CheckpointCorruptError(
                    f"{corrupt_what} (expected {algorithm} {str(expected)[:12]}, the bytes give "
                    f"{hashed.get('digest', '?')[:12]}): the checkpoint is corrupt; the state loaded from it "
                    "must not be used (restore from another copy)")

            try:
                step = self._load_payload(payload, source)
            except CheckpointError as exc:
                corrupt = mismatch()  # a corrupt payload fails to decode first: name the root cause
                if corrupt is not None:
                    self._refused = str(corrupt)
                    raise corrupt from exc
                raise
            except BaseException:
                mismatch()  # no hash thread left reading a mapping that is about to go
                raise
            corrupt = mismatch()
            if corrupt is not None:
                self._refused = str(corrupt)
                self.restored_from = None
                raise corrupt
            self._refused = None  # a verified load replaced every part: the state is a checkpoint's again
            return step
        finally:
            # The views the model was loaded from are gone by now; a transient numpy view may still be
            # alive: then the map is unmapped when the last reference goes, not here.
            try:
                if payload is not None:
                    payload.release()
                view.release()
                mapped.close()
            except BufferError:
                pass

    # -- restore -----------------------------------------------------------------------------------------------

    def restore(self, path: str | os.PathLike[str] | None = None, *, timeout: timedelta | None = None) -> int:
        """Load the newest usable checkpoint; returns its step (resume at step + 1), or -1 to start fresh.

        Sources in order: the plan file ``$KEEL_RESTORE_PLAN`` (waited for up to ``timeout``, default
        ``$KEEL_RESTORE_TIMEOUT`` or 120 s; its ``step = -1`` means fresh), then ``path`` (a slot or shard
        file, or a persistent-tier step directory: ``load_resharded``), then the newest COMPLETE slot of ``ckpt_dir`` whose digest verifies (with torch.distributed
        initialised, the newest step that every rank holds: then a collective call), else fresh. A torn or
        corrupt slot is skipped with a warning. Raises ``CheckpointMismatchError`` for a checkpoint of
        another rank, topology or model, ``CheckpointError`` for a plan or file that cannot be used.
        """
        self._restore_called = True
        plan_path = os.environ.get("KEEL_RESTORE_PLAN")
        if plan_path:
            return self._restore_from_plan(Path(plan_path), timeout or _env_duration("KEEL_RESTORE_TIMEOUT",
                                                                                  DEFAULT_RESTORE_TIMEOUT))
        if path is not None:
            # A persistent-tier step directory holds every rank's shard: loaded through load_resharded, which
            # verifies each against the manifest and fits the step to this run's world size and layout.
            return self.load_resharded(path) if Path(path).is_dir() else self.load_file(path)
        if self.ckpt_dir is not None:
            return self._restore_from_slots()
        return -1

    def _restore_from_plan(self, plan_path: Path, timeout: timedelta) -> int:
        deadline = time.monotonic() + timeout.total_seconds()
        while not plan_path.exists():
            if time.monotonic() > deadline:
                raise CheckpointError(f"rank {self.rank}: restore plan {plan_path} did not appear within "
                                      f"{timeout.total_seconds():.0f} s")
            time.sleep(_PLAN_POLL_S)
        try:
            # The agent's folder is this user's (the agent checks it); a plan that is a link or someone
            # else's file is refused, not trusted: it names the file to load and whether to verify it.
            plan = json.loads(read_owned_text(plan_path))
            step = int(plan["step"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"restore plan {plan_path} is not valid: {exc!r}") from None
        if step < 0:
            _log.info("keel restore: plan %s says start fresh", plan_path)
            return -1
        if plan.get("reshard") is not None:
            return self._restore_resharded_from_plan(plan_path, step, plan["reshard"])
        entry = (plan.get("shards") or {}).get(str(self.rank))
        if not isinstance(entry, dict) or "path" not in entry:
            raise CheckpointError(f"restore plan {plan_path} (step {step}) has no shard for rank {self.rank}")
        if entry.get("error"):
            raise CheckpointError(f"restore plan {plan_path} (step {step}): rank {self.rank}'s shard could not be "
                                  f"staged: {entry['error']}")
        # A slot the agent verified is loaded without hashing it: then it must be this user's own file.
        trusted = entry.get("verified_by") == "agent"
        loaded = self._load_verified(Path(entry["path"]), entry.get("digest") or None, trusted=trusted,
                                     owned=trusted)
        self.restored_from = f"{self.restored_from} via plan {plan_path.name} (tier {entry.get('tier', '?')})"
        if loaded != step:
            raise CheckpointError(f"{self.restored_from} holds step {loaded}, the plan says {step}")
        return loaded

    def _restore_resharded_from_plan(self, plan_path: Path, step: int, reshard: Any) -> int:
        """A plan for a job that restarted on another world size (the controller's shrink): the agent staged
        every saved rank's shard (``reshard.shards``, by saved rank, ``reshard.world_size`` of them); this rank
        loads its part of them resharded (``load_resharded``)."""
        try:
            saved_world = int(reshard["world_size"])
            entries = reshard["shards"]
            if saved_world < 1 or not isinstance(entries, dict):
                raise ValueError(f"world_size {saved_world}, shards {type(entries).__name__}")
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"restore plan {plan_path} (step {step}): its reshard part is not valid: {exc!r}") from None
        problems = []
        for rank in range(saved_world):
            entry = entries.get(str(rank))
            if not isinstance(entry, dict) or "path" not in entry:
                problems.append(f"saved rank {rank}: " + (str(entry["error"]) if isinstance(entry, dict) and
                                                          entry.get("error") else "no shard staged"))
            elif entry.get("error"):
                problems.append(f"saved rank {rank}: {entry['error']}")
        if problems:
            raise CheckpointError(f"restore plan {plan_path} (step {step}): the shards to reshard from could not all "
                                  f"be staged: {'; '.join(problems)}")
        loaded = self.load_resharded([entries[str(rank)]["path"] for rank in range(saved_world)])
        self.restored_from = f"{self.restored_from} via plan {plan_path.name}"
        if loaded != step:
            raise CheckpointError(f"{self.restored_from} holds step {loaded}, the plan says {step}")
        return loaded

    def _restore_from_slots(self) -> int:
        assert self.ckpt_dir is not None
        complete: dict[int, Path] = {}
        for slot_file in ckpt_slots.list_slots(self.ckpt_dir).get(self.rank, []):
            try:
                header = ckpt_slots.read_header(slot_file)
            except ckpt_slots.SlotError as exc:
                _log.warning("keel restore: rank %d: slot skipped: %s", self.rank, exc)
                continue
            if not header.complete:
                _log.warning("keel restore: rank %d: %s skipped: not complete (state %d, step %d)",
                             self.rank, slot_file, header.state, header.step)
                continue
            complete[header.step] = slot_file
        together = torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1
        if not together:
            # Alone, the newest slot that loads and verifies is the answer: verify it while loading (one
            # pass over its bytes); a corrupt one is skipped, and the next older one loaded over it.
            if self.world_size > 1:
                _log.warning("keel restore: rank %d restores its own newest slot without agreeing with the other "
                             "ranks (torch.distributed is not initialised)", self.rank)
            for step_ in sorted(complete, reverse=True):
                try:
                    loaded = self._load_verified(complete[step_], None, trusted=False)
                except CheckpointCorruptError as exc:
                    _log.warning("keel restore: rank %d: slot skipped: %s", self.rank, exc)
                    continue
                return self._restored(loaded)
            if self._refused is not None:  # a corrupt slot's bytes reached the model: it cannot start fresh either
                raise CheckpointCorruptError(f"rank {self.rank}: no slot in {self.ckpt_dir} verified (steps "
                                             f"{sorted(complete)}) and the state is partly loaded: {self._refused}")
            return -1
        # With other ranks: verify what could be loaded, newest first, then agree on a step every rank holds.
        verified: dict[int, Path] = {}
        for step_ in sorted(complete, reverse=True):
            try:
                ckpt_slots.read_payload(complete[step_], verify=True)
            except ckpt_slots.SlotError as exc:
                _log.warning("keel restore: rank %d: slot skipped: %s", self.rank, exc)
                continue
            verified[step_] = complete[step_]
        steps = self._common_steps(set(verified))
        if not steps:
            if verified:
                _log.warning("keel restore: rank %d: no step held by every rank (own: %s); starting fresh",
                             self.rank, sorted(verified))
            return -1
        step = max(steps)
        if step != max(verified):
            _log.warning("keel restore: rank %d: newest own step %d is not held by every rank; using %d",
                         self.rank, max(verified), step)
        return self._restored(self._load_verified(verified[step], None, trusted=True))  # verified just above

    def _restored(self, loaded: int) -> int:
        self.last_complete_step = loaded
        if self.session is not None:
            self.session.checkpoint_completed(loaded)
        return loaded

    def _common_steps(self, steps: set[int]) -> set[int]:
        """The steps every rank holds (a collective over the default group)."""
        dist = torch.distributed
        width = _COMMON_CANDIDATES
        own = sorted(steps)[-width:]
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.full((width,), -1, dtype=torch.int64, device=device)
        if own:
            mine[: len(own)] = torch.tensor(own, dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        common = set(own)
        for t in gathered:
            common &= {int(s) for s in t.tolist() if s >= 0}
        return common

    def _load_payload(self, payload: bytes | memoryview, source: str) -> int:
        try:
            # Views of the payload, not copies: _apply copies each tensor once, to where it stays.
            meta, tree = shard.decode_shard(payload, copy=False)
        except shard.ShardFormatError as exc:
            raise CheckpointError(f"{source}: {exc}") from None
        self._check_compatible(meta, tree, source)
        self._apply(tree, source)
        self.restored_from = source
        _log.info("keel restore: rank %d loaded step %d from %s", self.rank, meta["step"], source)
        self.inexact = inexact_resume_reasons(self.model, self.world_size)
        for reason in self.inexact:
            _log.warning("keel restore: rank %d: the resumed run may differ from an uninterrupted one: %s",
                         self.rank, reason)
        return int(meta["step"])

    def _check_compatible(self, meta: dict[str, Any], tree: Any, source: str) -> None:
        def refuse(what: str) -> None:
            raise CheckpointMismatchError(f"{source} does not fit this run: {what}")

        if meta["rank"] != self.rank:
            refuse(f"it is rank {meta['rank']}'s shard, this is rank {self.rank}")
        if meta["world_size"] != self.world_size:
            refuse(f"world size {meta['world_size']} in the checkpoint, {self.world_size} now: {_RESHARD_HINT}")
        saved_groups = (meta.get("topology") or {}).get("groups") or {}
        diffs = [f"{k} {saved_groups.get(k)} -> {self.groups[k]}" for k in _TOPOLOGY_GROUPS
                 if saved_groups.get(k) != self.groups[k]]
        if diffs:
            refuse("parallel groups differ (checkpoint -> now): " + ", ".join(diffs))
        if not isinstance(tree, dict):
            refuse("the state is not a dict")
        saved = sorted(k for k in tree if k != "rng")
        if saved != sorted(self._components()):
            refuse(f"components differ: checkpoint has {saved}, this run registers {sorted(self._components())}")
        if self.model is not None:
            if self.sharded:
                from torch.distributed.checkpoint.state_dict import get_model_state_dict

                live_sd = get_model_state_dict(self.model)
            else:
                live_sd = self.model.state_dict()
            problems = _diff_tensors(tree["model"], live_sd)
            if problems:
                relaid = any(" now (another layout)" in p for p in problems)
                refuse("model differs: " + "; ".join(problems) + (f": {_RESHARD_HINT}" if relaid else ""))
        if self.optimizer is not None:
            saved_opt = ((meta.get("structure") or {}).get("optimizer")) or {}
            now_opt = self._structure()["optimizer"]
            if saved_opt and saved_opt.get("sharding") != now_opt.get("sharding"):
                refuse(f"optimizer state sharded as {saved_opt.get('sharding') or 'nothing (every rank holds all)'} "
                       f"in the checkpoint, as {now_opt.get('sharding') or 'nothing (every rank holds all)'} now: "
                       f"resharding optimizer state is not supported yet")
            if saved_opt and saved_opt != now_opt:
                refuse(f"optimizer parameters differ: checkpoint groups {saved_opt.get('group_sizes')} (shapes "
                       f"{str(saved_opt.get('params_fingerprint'))[:12]}), now {now_opt['group_sizes']} "
                       f"(shapes {now_opt['params_fingerprint'][:12]})")

    def _apply(self, tree: dict[str, Any], source: str) -> None:
        """Load ``tree`` (its tensors may be views of the mapped checkpoint) into the registered objects.

        ``Module.load_state_dict`` copies into the live parameters and buffers, so the model gets the
        views themselves (one copy, no intermediate). Everything else may keep what it is given (the
        optimizer adopts its state tensors), so it gets its own copy (``_own_copy``), made here once.
        """
        parts: list[tuple[str, Any, Any]] = []
        optimizer_copy: _BackgroundCopy | None = None
        if self.sharded:
            self._apply_sharded(tree, source)
        else:
            # The optimizer's copy runs on a thread while the model loads here: two copies at once, on two
            # cores where there are (the restore is the only work the rank has).
            if self.optimizer is not None:
                optimizer_copy = _BackgroundCopy(tree["optimizer"])
            if self.model is not None:
                parts.append(("model", self.model, tree["model"]))
            if optimizer_copy is not None:  # before the scheduler, which reads and sets the groups' lr
                parts.append(("optimizer", self._local_optimizer, optimizer_copy))
        for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler), ("sampler", self.sampler),
                          ("loader", self.loader)):
            if obj is not None:
                if name not in tree:
                    raise CheckpointMismatchError(f"{source} has no state for the {name}")
                parts.append((name, obj, _own_copy(tree[name])))
        for name, obj in self.extra.items():
            if name not in tree["extra"]:
                raise CheckpointMismatchError(f"{source} has no state for extra object {name!r}")
            parts.append((f"extra[{name!r}]", obj, _own_copy(tree["extra"][name])))
        for name, obj, state in parts:
            try:
                obj.load_state_dict(state.result() if isinstance(state, _BackgroundCopy) else state)
            except (ValueError, RuntimeError, KeyError, TypeError) as exc:
                raise CheckpointMismatchError(f"{source}: loading {name} failed: {exc}") from exc
            finally:
                if optimizer_copy is not None:  # a failed load leaves no copy running on behind the error
                    optimizer_copy.wait()
            if name == "optimizer" and self.zero:
                # The wrapper's groups are what a scheduler reads and sets, and what its step copies into the
                # local optimizer's: they get the restored hyperparameters (groups correspond one to one).
                assert self.optimizer is not None
                for outer, local in zip(self.optimizer.param_groups, self._local_optimizer.param_groups, strict=True):
                    outer.update({k: v for k, v in local.items() if k != "params"})
        rng = _own_copy(tree.get("rng") or {})
        if "python" in rng:
            random.setstate(rng["python"])
        if "numpy" in rng:
            np.random.set_state(rng["numpy"])
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            states = rng["cuda"]
            if len(states) != torch.cuda.device_count():
                _log.warning("keel restore: %d CUDA RNG states saved, %d devices now; restoring the first ones",
                             len(states), torch.cuda.device_count())
            for device, state in enumerate(states[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(state, device)


    def _apply_sharded(self, tree: dict[str, Any], source: str) -> None:
        """Load a sharded model's state with DCP's ``set_state_dict``: every ``ShardedTensor`` becomes a DTensor
        on its parameter's live mesh (model tensors view the checkpoint, ``set_state_dict`` copies them into
        the parameters; the optimizer gets its own copies, which it keeps)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        assert self.model is not None
        meshes = self._live_meshes()
        distinct = {id(m): m for m in meshes.values()}
        only = next(iter(distinct.values())) if len(distinct) == 1 else None

        def live(obj: Any, name: str | None) -> Any:
            if isinstance(obj, shard.ShardedTensor):
                mesh = meshes.get(name) if name is not None else None
                mesh = mesh if mesh is not None else only
                if mesh is None:
                    raise CheckpointMismatchError(f"{source}: no live device mesh for the sharded tensor {name!r}")
                return obj.to_dtensor(mesh)
            if isinstance(obj, dict):
                return {k: live(v, name) for k, v in obj.items()}
            if isinstance(obj, list):
                return [live(v, name) for v in obj]
            return obj

        model_sd = {key: live(value, key) for key, value in tree["model"].items()}
        try:
            saved_optim = _own_copy(tree["optimizer"]) if self.optimizer is not None else None
            if self.optimizer is not None and saved_optim and saved_optim.get("state"):
                optim_sd = {**saved_optim, "state": {fqn: live(state, fqn) for fqn, state in saved_optim["state"].items()}}
                set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
            else:
                set_model_state_dict(self.model, model_sd)
                if self.optimizer is not None:
                    # Saved before the optimizer had state: no state now either, the saved hyperparameters (not
                    # set_state_dict, which would first create state with a zero-gradient optimizer.step()).
                    groups = (saved_optim or {}).get("param_groups") or []
                    if len(groups) != len(self.optimizer.param_groups):
                        raise CheckpointMismatchError(f"{source}: {len(groups)} optimizer parameter groups in the "
                                                      f"checkpoint, {len(self.optimizer.param_groups)} now")
                    self.optimizer.state.clear()
                    for group, saved_group in zip(self.optimizer.param_groups, groups, strict=True):
                        group.update({k: v for k, v in saved_group.items() if k != "params"})
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:
            raise CheckpointMismatchError(f"{source}: loading the sharded model and optimizer failed: {exc}") from exc


def read_checkpoint_ranks(sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
                      ) -> tuple[list[tuple[dict[str, Any], Any]], str]:
    """Every saved rank's ``(meta, tree)`` of one checkpoint, in rank order, and where they came from.

    ``sources``: a persistent-tier step directory ``<root>/<job>/step-<s>`` (read by ``keel.checkpoint.disk``: each
    shard checked against ``manifest.json``'s size and SHA-256) or every rank's slot or shard file (a slot checked
    against its own digest). Each is verified before it is decoded;
    the trees' tensors are views of the bytes read. ``CheckpointMismatchError`` unless they are every rank of one
    world size and one step; ``CheckpointCorruptError`` / ``CheckpointError`` for bytes that fail or cannot be read."""
    from keel.checkpoint import disk

    payloads: list[tuple[Path, Callable[[], bytes]]]
    if isinstance(sources, (str, os.PathLike)) and Path(sources).is_dir():
        # The persistent tier's own reader: the manifest parsed and checked, each shard's size and SHA-256 verified.
        try:
            root, job, step = disk.locate_step(Path(sources))
            manifest = disk.read_manifest(root, job, step)
        except disk.CheckpointError as exc:
            raise CheckpointError(f"{sources}: {exc}") from None
        payloads = [(manifest.path.parent / e.file, functools.partial(disk.load_shard, root, job, step, e.rank))
                    for e in manifest.shards]
        where = str(sources)
    else:
        paths = [Path(p) for p in ([sources] if isinstance(sources, (str, os.PathLike)) else sources)]
        payloads = [(p, functools.partial(_slot_or_shard_bytes, p)) for p in paths]
        where = f"{paths[0].parent}" if paths else "no files"
    if not payloads:
        raise CheckpointError("load_resharded: no shards given")
    decoded = []
    for path, read in payloads:
        try:
            decoded.append(shard.decode_shard(read(), copy=False))
        except disk.CheckpointCorrupt as exc:
            raise CheckpointCorruptError(f"{exc}: the checkpoint is corrupt") from None
        except (disk.CheckpointError, OSError) as exc:
            raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
        except ckpt_slots.SlotError as exc:
            corrupt = "digest mismatch" in str(exc)  # else not complete, torn or unreadable: not known to be bad bytes
            raise (CheckpointCorruptError if corrupt else CheckpointError)(f"slot {path}: {exc}") from None
        except shard.ShardFormatError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
    decoded.sort(key=lambda item: int(item[0]["rank"]))
    ranks = [int(m["rank"]) for m, _ in decoded]
    worlds = {int(m["world_size"]) for m, _ in decoded}
    steps = {int(m["step"]) for m, _ in decoded}
    if len(worlds) != 1 or ranks != list(range(next(iter(worlds)))):
        raise CheckpointMismatchError(f"{where}: the shards are ranks {ranks} of world sizes "
                                      f"{sorted(worlds)}: resharding needs every rank of one checkpoint")
    if len(steps) != 1:
        raise CheckpointMismatchError(f"{where}: the shards hold different steps {sorted(steps)}")
    return decoded, where


def _slot_or_shard_bytes(path: Path) -> bytes:
    """A slot's verified payload (its own digest checked), or a shard file's bytes (nothing to check them by)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
    if prefix == ckpt_slots.MAGIC:
        return ckpt_slots.read_payload(path, verify=True)[1]
    return path.read_bytes()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return type(value).__name__


def _optimizer_by_name(optim_sd: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A plain optimizer ``state_dict`` (state and group params keyed by index) keyed by parameter name, as DCP
    keys a sharded one; a name-keyed one unchanged. ``CheckpointMismatchError`` for an index beyond ``names``."""
    groups = optim_sd.get("param_groups") or []
    if not any(isinstance(i, int) for g in groups for i in g.get("params", [])):
        return optim_sd

    def name(index: int) -> str:
        if not 0 <= index < len(names):
            raise CheckpointMismatchError(f"optimizer state for parameter {index}; this optimizer holds {len(names)}")
        return names[index]

    return {**optim_sd, "state": {name(int(k)): v for k, v in (optim_sd.get("state") or {}).items()},
            "param_groups": [{**g, "params": [name(int(i)) for i in g.get("params", [])]} for g in groups]}


def _optimizer_by_index(optim_sd: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``_optimizer_by_name`` undone: what a plain optimizer's ``load_state_dict`` takes."""
    index = {n: i for i, n in enumerate(names)}
    try:
        # load_state_dict pairs a group's saved params with the live group's by position: the live order, which
        # the indices follow (the structure check made the groups hold the same parameters).
        return {**optim_sd, "state": {index[k]: v for k, v in (optim_sd.get("state") or {}).items()},
                "param_groups": [{**g, "params": sorted(index[n] for n in g.get("params", []))}
                                 for g in optim_sd.get("param_groups") or []]}
    except KeyError as exc:
        raise CheckpointMismatchError(f"optimizer state for {exc.args[0]!r}, which this optimizer does not hold") from None


def _is_parameter_shaped(value: Any, live_param: Any) -> bool:
    """Whether an optimizer state entry is laid out like its parameter (a moment), not a scalar (a step count)."""
    if isinstance(value, shard.ShardedTensor):
        return True
    return isinstance(value, torch.Tensor) and shard.is_dtensor(live_param) and tuple(value.shape) == tuple(live_param.shape)


_TOPOLOGY_GROUPS = ("dp", "pp", "tp")


def shard_group(model: nn.Module | None, optimizer: object = None) -> list[int]:
    """The global ranks across which this rank's training state is sharded, found from the state itself: for
    DTensor parameters (FSDP2 ``fully_shard``, tensor parallelism), every rank of each mesh dimension a parameter
    is sharded on (FSDP2 on a 1-D mesh: the DP group; HSDP: the shard dimension's group, not the replicas); for a
    ``ZeroRedundancyOptimizer``, the ranks of its process group (each holds one partition of the optimizer
    state). Empty when nothing is sharded (DDP: every DP peer holds a replica) or without torch.distributed.
    Through public APIs only: ``DTensor.device_mesh`` / ``.placements``, ``DeviceMesh.get_group``,
    ``torch.distributed.get_process_group_ranks``."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return []
    ranks: set[int] = set()
    seen: set[tuple[int, int]] = set()
    for param in model.parameters() if model is not None else ():
        if not shard.is_dtensor(param):
            continue
        dtensor: Any = param  # a DTensor: its mesh and placements
        mesh, placements = dtensor.device_mesh, dtensor.placements
        for dim, placement in enumerate(placements):
            if placement.is_shard() and (id(mesh), dim) not in seen:
                seen.add((id(mesh), dim))
                ranks.update(dist.get_process_group_ranks(mesh.get_group(dim)))
    if _is_zero_redundancy(optimizer):
        group = getattr(optimizer, "process_group", None)
        ranks.update(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    return sorted(ranks)


def _is_zero_redundancy(optimizer: object) -> bool:
    if optimizer is None or not torch.distributed.is_available():
        return False
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def inexact_resume_reasons(model: nn.Module | None, world_size: int) -> list[str]:
    """What is known to make a run restored with ``model`` differ from an uninterrupted one (pure). Today: a
    ``DistributedDataParallel`` wrapper over 3 or more ranks, freshly built for the restore, reduces its first
    iteration's gradients in one bucket in parameter order, and the long-running one in the buckets it rebuilt
    after its first iteration (gradient-ready order): with 3 or more addends the sums differ in the last bits.
    A DDP built with ``find_unused_parameters=True`` never rebuilds, so it is exact."""
    from torch.nn.parallel import DistributedDataParallel

    reasons = []
    if isinstance(model, DistributedDataParallel) and world_size >= 3 and not model.find_unused_parameters:
        reasons.append(f"DistributedDataParallel over {world_size} ranks: its first step after the restore sums the "
                       f"gradients in its initial bucket order, the uninterrupted run in the buckets it rebuilt after "
                       f"its first iteration, so the last bits of that step differ (exact with 2 ranks, or with "
                       f"find_unused_parameters=True, which never rebuilds)")
    return reasons


def _sharded_leaves(obj: Any, path: tuple[Any, ...] = ()) -> Any:
    """``obj`` with every DTensor replaced by its ``ShardedTensor`` (a view of its local shard, not a copy);
    ``path`` names where ``obj`` is, for the error on a placement the format cannot hold."""
    if shard.is_dtensor(obj):
        return shard.ShardedTensor.of(obj, path)
    if isinstance(obj, dict):
        return {k: _sharded_leaves(v, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_sharded_leaves(v, (*path, i)) for i, v in enumerate(obj)]
    return obj


def _diff_tensors(saved: Any, current: Mapping[str, Any], limit: int = 5) -> list[str]:
    """What differs between a saved and a current ``state_dict``: missing and unexpected keys, shapes, dtypes."""
    if not isinstance(saved, dict):
        return [f"saved state is a {type(saved).__name__}"]
    problems = []
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing:
        problems.append(f"missing in checkpoint {missing[:limit]}" + (" ..." if len(missing) > limit else ""))
    if unexpected:
        problems.append(f"not in this model {unexpected[:limit]}" + (" ..." if len(unexpected) > limit else ""))
    changed = []
    for key, now in current.items():
        old = saved.get(key)
        if shard.is_dtensor(now) or isinstance(old, shard.ShardedTensor):
            changed.extend(_diff_sharded(key, old, now))
            continue
        if isinstance(now, torch.Tensor) and isinstance(old, torch.Tensor):
            if old.shape != now.shape or old.dtype != now.dtype:
                changed.append(f"{key}: {str(old.dtype).removeprefix('torch.')}{list(old.shape)} in checkpoint, "
                               f"{str(now.dtype).removeprefix('torch.')}{list(now.shape)} now")
    if changed:
        problems.append(", ".join(changed[:limit]) + (" ..." if len(changed) > limit else ""))
    return problems
