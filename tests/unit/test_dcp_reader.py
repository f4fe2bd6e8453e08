"""``keel.sdk.dcp.KeelStorageReader``: plain ``torch.distributed.checkpoint.load`` reads a Keel checkpoint (a
persistent-tier step of 2 ranks with sharded and replicated tensors and optimizer hyperparameters) into full
tensors, bitwise, and into a state dict named as the user's loop names it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from keel.sdk import CheckpointError
from keel.sdk.dcp import KeelStorageReader
from keel.sdk.reshard import chunk_box
from keel.sdk.shard import ShardedTensor, encode_state


def _chunk(whole: torch.Tensor, rank: int, world: int) -> ShardedTensor:
    box = chunk_box(whole.shape, ("S(0)",), (world,), (rank,))
    local = whole[box.offsets[0]: box.offsets[0] + box.sizes[0]].clone()
    return ShardedTensor(local=local, shape=tuple(whole.shape), stride=tuple(whole.stride()), placements=("S(0)",),
                         mesh_shape=(world,), mesh_dim_names=None, coord=(rank,))


def _write_step(directory: Path, trees: list[dict]) -> None:
    directory.mkdir(parents=True)
    shards = []
    for rank, tree in enumerate(trees):
        payload = bytes(encode_state(tree, step=7, rank=rank, world_size=len(trees), topology={}))
        (directory / f"rank-{rank:05d}.shard").write_bytes(payload)
        shards.append({"rank": rank, "file": f"rank-{rank:05d}.shard", "bytes": len(payload),
                       "sha256": hashlib.sha256(payload).hexdigest()})
    (directory / "manifest.json").write_text(json.dumps({"job": "j", "step": 7, "world_size": len(trees),
                                                         "shards": shards, "created_at": "2026-12-07T00:00:00Z"}))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    whole = {"w": torch.randn(5, 3, generator=gen), "exp_avg": torch.randn(5, 3, generator=gen),
             "bias": torch.randn(3, generator=gen)}
    trees = [{"model": {"w": _chunk(whole["w"], r, 2), "bias": whole["bias"]},
              "optimizer": {"state": {"w": {"exp_avg": _chunk(whole["exp_avg"], r, 2), "step": torch.tensor(7.0)}},
                            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": ["w", "bias"]}]},
              "scheduler": {"last_epoch": 8}} for r in range(2)]
    _write_step(tmp_path / "j" / "step-000000007", trees)  # <root>/<job>/step-<s>, as the persistent tier lays it out
    return tmp_path / "j" / "step-000000007", whole


def test_dcp_loads_a_keel_checkpoint_into_full_tensors_bitwise(saved) -> None:
    step_dir, whole = saved
    assert KeelStorageReader.validate_checkpoint_id(step_dir)
    state = {"model": {"w": torch.zeros(5, 3), "bias": torch.zeros(3)},
             "optim": {"state": {"w": {"exp_avg": torch.zeros(5, 3), "step": torch.tensor(0.0)}},
                       "param_groups": [{"lr": 1.0, "betas": (0.0, 0.0), "params": ["w", "bias"]}]}}
    dcp.load(state, storage_reader=KeelStorageReader(step_dir, names={"model": "model", "optimizer": "optim"}))
    assert torch.equal(state["model"]["w"], whole["w"]) and torch.equal(state["model"]["bias"], whole["bias"])
    moments = state["optim"]["state"]["w"]
    assert torch.equal(moments["exp_avg"], whole["exp_avg"]) and float(moments["step"]) == 7.0
    assert state["optim"]["param_groups"][0]["lr"] == 0.01 and state["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)


def test_a_part_not_offered_or_a_corrupt_shard_is_refused(saved) -> None:
    step_dir, _ = saved
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: scheduler"):  # DCP names it
        dcp.load({"scheduler": {"last_epoch": 0}}, storage_reader=KeelStorageReader(step_dir))
    shard = step_dir / "rank-00001.shard"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises((CheckpointException, CheckpointError), match="SHA-256 mismatch .*the checkpoint is corrupt"):
        dcp.load({"model": {"w": torch.zeros(5, 3)}}, storage_reader=KeelStorageReader(step_dir))


def test_a_checkpoint_of_a_model_that_is_not_sharded_has_its_optimizer_refused_with_the_reason(tmp_path: Path) -> None:
    w = torch.randn(4, 2)
    trees = [{"model": {"w": w}, "optimizer": {"state": {0: {"exp_avg": w.clone()}},
                                               "param_groups": [{"lr": 0.1, "params": [0]}]}}]
    step_dir = tmp_path / "j" / "step-000000007"
    _write_step(step_dir, trees)
    with pytest.raises((CheckpointException, CheckpointError), match="keys its optimizer state by parameter index"):
        dcp.load({"model": {"w": torch.zeros(4, 2)}}, storage_reader=KeelStorageReader(step_dir))
    target = {"model": {"w": torch.zeros(4, 2)}}
    dcp.load(target, storage_reader=KeelStorageReader(step_dir, names={"model": "model"}))
    assert torch.equal(target["model"]["w"], w)
