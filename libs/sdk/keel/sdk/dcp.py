"""Keel checkpoints for ``torch.distributed.checkpoint``: a ``StorageReader`` over Keel's shards, so that a sharded
job (FSDP2 / DTensor) that leaves Keel loads its newest checkpoint with plain DCP, on any layout DCP can reshard
to. A checkpoint of a model that is not sharded (DDP) keys its optimizer state by index, as a plain optimizer
does, not by name as DCP does: the reader refuses its optimizer part (its model part loads, under the names
``model.state_dict()`` gave, ``module.`` included for DDP).

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp
    from keel.sdk.dcp import KeelStorageReader

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optimizer": optim_sd},
             storage_reader=KeelStorageReader("/ckpt/my-job/step-000001200"))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

The reader presents the checkpoint as DCP metadata: each sharded tensor (``ShardedTensor``) as the chunks its
saving ranks held, a replicated tensor as one chunk, everything else (optimizer hyperparameters) as DCP's
"bytes" entries. Keys are DCP's: the dotted paths of the nested state dict, under the top-level names given by
``names`` (Keel's parts ``model`` and ``optimizer`` by default; torchtitan-style loops use the same).

DCP's load planner takes a non-tensor value only as ``torch.save`` bytes, which it unpickles itself; the reader
produces those bytes in memory from the JSON values of Keel's shard (``torch.save`` of plain numbers, strings,
lists and tuples). Keel never reads pickle: nothing pickled is stored, and nothing comes from outside.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, Metadata, StorageReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from keel.sdk.checkpoint import CheckpointError, read_checkpoint_ranks
from keel.sdk.reshard import Box, saved_box
from keel.sdk.shard import ShardedTensor

__all__ = ["KeelStorageReader"]

_DEFAULT_NAMES = {"model": "model", "optimizer": "optimizer"}


class KeelStorageReader(StorageReader):
    """``torch.distributed.checkpoint``'s view of one Keel checkpoint.

    ``path``: a persistent-tier step directory (``manifest.json`` and the shards it lists, each verified), or every
    saved rank's slot or shard file. ``names``: Keel part -> the top-level key it has in the state dict given to
    ``dcp.load`` (default ``{"model": "model", "optimizer": "optimizer"}``); parts not named are not offered."""

    def __init__(self, path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                 names: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.path = path
        self.names = dict(names or _DEFAULT_NAMES)
        self._chunks: dict[str, list[tuple[Box, torch.Tensor]]] = {}
        self._values: dict[str, Any] = {}
        self._metadata: Metadata | None = None

    # -- the StorageReader contract --------------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
            self._metadata = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """A folder holding a Keel ``manifest.json`` (a persistent-tier step)."""
        return (Path(checkpoint_id) / "manifest.json").is_file()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = self._index()
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._metadata is None:  # a reader on a rank that did not read the metadata itself
            self._metadata = self._index()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(self._values[fqn], buffer)  # DCP's planner takes bytes it unpickles (module docstring)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            source = self._chunk(item.storage_index)
            piece = source[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True))]
            target = planner.resolve_tensor(item).detach()
            target.copy_(piece)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    # -- the checkpoint as DCP sees it -----------------------------------------------------------------------------

    def _index(self) -> Metadata:
        saved, _ = read_checkpoint_ranks(self.path)
        world = len(saved)
        self._chunks, self._values = {}, {}
        entries: dict[str, Any] = {}
        optimizer = saved[0][1].get("optimizer") if "optimizer" in self.names else None
        if isinstance(optimizer, dict) and any(isinstance(i, int) for g in optimizer.get("param_groups") or []
                                               for i in g.get("params", [])):
            raise CheckpointError(f"{self.path}: a checkpoint of a model that is not sharded (DDP) keys its optimizer "
                                  "state by parameter index, which DCP's state dicts do not: this reader is for sharded "
                                  "(FSDP2 / DTensor) checkpoints; load it with keel.sdk.Checkpointer (load_file, "
                                  "load_resharded), or leave the optimizer out (names={'model': ...})")
        for rank, (_, tree) in enumerate(saved):
            parts = {self.names[part]: value for part, value in tree.items() if part in self.names}
            flat, _ = flatten_state_dict(parts)
            for fqn, value in flat.items():
                if isinstance(value, ShardedTensor):
                    box = saved_box(value, rank, world)
                    held = self._chunks.setdefault(fqn, [])
                    if not box.empty and all(b != box for b, _ in held):  # a replica adds no chunk
                        held.append((box, value.local))
                    entries[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=value.local.dtype),
                                                         size=torch.Size(value.shape), chunks=[])
                elif isinstance(value, torch.Tensor):
                    if rank == 0:  # replicated: rank 0's copy is the tensor
                        self._chunks[fqn] = [(Box((0,) * value.dim(), tuple(value.shape)), value)]
                        entries[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=value.dtype),
                                                             size=value.shape, chunks=[])
                elif rank == 0:
                    self._values[fqn] = value
                    entries[fqn] = BytesStorageMetadata()
        for fqn, entry in entries.items():
            if isinstance(entry, TensorStorageMetadata):
                entry.chunks = [ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
                                for box, _ in self._chunks.get(fqn, [])]
        return Metadata(state_dict_metadata=entries)

    def _chunk(self, index: MetadataIndex) -> torch.Tensor:
        offsets = tuple(index.offset) if index.offset is not None else None
        for box, data in self._chunks.get(index.fqn, []):
            if offsets is None or box.offsets == offsets:
                return data
        raise KeyError(f"the Keel checkpoint has no chunk of {index.fqn} at {offsets}")
