"""Resharding: one rank's state on a new layout, built from every rank's shard of another layout.

A checkpoint saved by ``W`` ranks is ``W`` shard payloads (``keel.sdk.shard``). A sharded tensor
(``ShardedTensor``: a DTensor's local chunk, its global shape, placements, mesh shape and the saving rank's
mesh coordinate) says which box of the global tensor it holds, so the box a rank of the *new* layout needs is
cut from the saved chunks that overlap it (``assemble``): bytes are copied, never summed, so a resharded
tensor is bitwise the one a synchronous checkpoint of the old layout would give on the new one.

Pure functions over tensors and plain values; the ``Checkpointer`` (``load_resharded``) supplies the live
layout and loads the result. What cannot be resharded is refused with ``ReshardError`` naming it:

- a ``Partial`` placement (a pending sum, not a chunk);
- a chunk whose saving rank's mesh coordinate was not recorded, on a mesh of more than one dimension (on a
  one-dimensional mesh over all ranks the coordinate is the rank);
- a box of the global tensor that no saved chunk covers (a missing rank's shard);
- per-rank state that differs between the saved ranks and has no rule for a new layout (see
  ``merge_rank_states``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from keel.sdk.shard import ShardedTensor, parse_placement

__all__ = ["ReshardError", "Box", "chunk_box", "saved_box", "assemble", "equal_states", "merge_rank_states"]


class ReshardError(ValueError):
    """The saved shards cannot be turned into this rank's state on the new layout; the message says why."""


@dataclass(frozen=True)
class Box:
    """A box of a global tensor: where it starts (``offsets``) and its extent (``sizes``), per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return any(n == 0 for n in self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common box, or ``None`` when the two do not overlap."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        ends = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes,
                                                             strict=True))
        if any(e <= s for s, e in zip(starts, ends, strict=True)):
            return None
        return Box(starts, tuple(e - s for s, e in zip(starts, ends, strict=True)))

    def slices(self, within: Box) -> tuple[slice, ...]:
        """Index of this box in a tensor that holds the box ``within``."""
        return tuple(slice(o - w, o - w + n) for o, n, w in zip(self.offsets, self.sizes, within.offsets, strict=True))


def chunk_box(shape: Sequence[int], placements: Sequence[str], mesh_shape: Sequence[int],
              coord: Sequence[int]) -> Box:
    """The box of a global tensor of ``shape`` that the rank at mesh coordinate ``coord`` holds under
    ``placements`` (one ``"S(d)"`` / ``"R"`` per mesh dimension, in order).

    PyTorch's rule for DTensor (``torch.chunk``'s): along each mesh dimension that shards tensor dimension ``d``,
    the current extent ``n`` is cut into ``k`` chunks of ``ceil(n / k)``, the last ones shorter or empty;
    successive mesh dimensions sharding the same tensor dimension cut the chunk already taken. Raises
    ``ReshardError`` for a ``Partial`` placement."""
    if not (len(placements) == len(mesh_shape) == len(coord)):
        raise ReshardError(f"{len(placements)} placements, a mesh of {len(mesh_shape)} dimensions, a coordinate of "
                           f"{len(coord)}")
    offsets = [0] * len(shape)
    sizes = list(shape)
    for text, k, c in zip(placements, mesh_shape, coord, strict=True):
        placement = parse_placement(text)
        if text == "R":
            continue
        dim = getattr(placement, "dim", None)
        if dim is None:
            raise ReshardError(f"placement {text} holds a pending reduction, not a chunk: it cannot be resharded")
        full = math.ceil(sizes[dim] / k) if sizes[dim] else 0
        start = min(c * full, sizes[dim])
        offsets[dim] += start
        sizes[dim] = max(0, min(full, sizes[dim] - start))
    return Box(tuple(offsets), tuple(sizes))


def saved_box(chunk: ShardedTensor, rank: int, world_size: int) -> Box:
    """The box ``chunk`` holds, saved by ``rank`` of ``world_size``. The coordinate recorded with it decides;
    a chunk written before coordinates were recorded is placed by its rank on a one-dimensional mesh over every
    rank (what FSDP2 over the whole world builds), and refused on any other mesh."""
    coord = chunk.coord
    if coord is None:
        if len(chunk.mesh_shape) != 1 or chunk.mesh_shape[0] != world_size:
            raise ReshardError(f"a chunk on mesh {chunk.mesh_shape} of a checkpoint of {world_size} ranks was saved "
                               "without its mesh coordinate (a shard written before resharding existed): cannot tell "
                               "which part of the tensor it is")
        coord = (rank,)
    box = chunk_box(chunk.shape, chunk.placements, chunk.mesh_shape, coord)
    if tuple(chunk.local.shape) != box.sizes:
        raise ReshardError(f"rank {rank}'s chunk is {list(chunk.local.shape)}, its layout "
                           f"{chunk.layout_text()} at {list(coord)} says {list(box.sizes)}")
    return box


def assemble(target: Box, chunks: Sequence[tuple[Box, torch.Tensor]], *, dtype: torch.dtype,
             what: str = "tensor") -> torch.Tensor:
    """A new tensor holding box ``target`` of the global tensor, copied from the saved ``chunks`` (each the box
    it holds and its data) that overlap it. Where chunks overlap (replicated placements) the first one wins,
    which is exact: replicas are equal. Raises ``ReshardError`` when part of ``target`` is in no chunk."""
    out = torch.empty(target.sizes, dtype=dtype)
    if target.empty:
        return out
    covered = torch.zeros(target.sizes, dtype=torch.bool)
    for box, data in chunks:
        if data.dtype != dtype:
            raise ReshardError(f"{what}: saved as {data.dtype}, live as {dtype}")
        common = box.intersect(target)
        if common is None:
            continue
        into = common.slices(target)
        if bool(covered[into].all()):
            continue
        out[into] = data[common.slices(box)]
        covered[into] = True
    if not bool(covered.all()):
        missing = int((~covered).sum())
        raise ReshardError(f"{what}: {missing} of {covered.numel()} elements of box offsets {list(target.offsets)} "
                           f"sizes {list(target.sizes)} are in no saved shard")
    return out


def equal_states(a: Any, b: Any) -> bool:
    """Whether two decoded state values are equal, tensors compared bitwise (dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(_raw(a), _raw(b)))  # bytes, so that NaN == NaN and -0.0 != 0.0
    if isinstance(a, ShardedTensor) or isinstance(b, ShardedTensor):
        return False
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(equal_states(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal_states(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b) and type(a) is type(b)
    except (TypeError, ValueError):  # NumPy arrays compare elementwise
        import numpy as np

        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)


def merge_rank_states(name: str, states: Sequence[Any], reshard: Callable[[list[Any]], Any] | None) -> Any:
    """One object's state for a rank of the new layout, from every saved rank's (ordered by saved rank).

    The object's own rule when it has one, ``reshard(states)`` (``reshard_state_dict`` on the object: a sampler
    knows how its position maps onto another number of ranks, even from one saved rank). Without one: the state,
    if equal on every saved rank (a scheduler, a scaler, optimizer hyperparameters); else ``ReshardError``: Keel
    does not guess a data position."""
    if reshard is None and all(equal_states(states[0], s) for s in states[1:]):
        return states[0]
    if reshard is None:
        raise ReshardError(f"the {name}'s state differs between the saved ranks and it has no reshard_state_dict(states) "
                           "saying what it becomes on another number of ranks")
    try:
        return reshard(list(states))
    except (ValueError, KeyError, TypeError) as exc:
        raise ReshardError(f"the {name}'s reshard_state_dict refused the saved states: {exc}") from exc


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
