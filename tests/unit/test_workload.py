"""The example workload's pure parts: generated data, the resumable sampler, topology, the model split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from keel.workload.data import MarkovDataset, ShardedSampler, collate
from keel.workload.model import SIZES, GPTConfig, build_model, split_stages, stage_layers
from keel.workload.train import parse_args, topology

TINY = SIZES["tiny"]


def test_dataset_is_a_pure_function_of_seed_split_and_index() -> None:
    a, b = MarkovDataset(64, 32, seed=7), MarkovDataset(64, 32, seed=7)
    for i in (0, 1, 999):
        assert np.array_equal(a.sample(i), b.sample(i))
    assert not np.array_equal(a.sample(0), MarkovDataset(64, 32, seed=8).sample(0))
    assert not np.array_equal(a.sample(0, "train"), a.sample(0, "eval"))
    seq = a.sample(3)
    assert seq.shape == (33,) and seq.dtype == np.int64 and seq.min() >= 0 and seq.max() < 64
    # Every transition follows the chain: the data is learnable.
    for prev, nxt in zip(seq[:-1], seq[1:]):
        assert nxt in a._successors[prev]


def test_collate_shifts_targets_by_one() -> None:
    ds = MarkovDataset(64, 32, seed=0)
    inputs, targets = collate(ds, [4, 5])
    assert inputs.shape == targets.shape == (2, 32)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def _take(sampler: ShardedSampler, n: int) -> list[list[int]]:
    return [sampler.next_indices() for _ in range(n)]


def test_sampler_resumes_exactly_across_an_epoch_boundary() -> None:
    # 40 samples / 2 ranks / batch 4 = 5 batches per epoch: 7 batches cross into epoch 1.
    original = ShardedSampler(40, batch_size=4, dp_rank=1, dp_size=2, seed=3)
    _take(original, 3)
    state = original.state_dict()
    expected = _take(original, 7)
    resumed = ShardedSampler(40, batch_size=4, dp_rank=1, dp_size=2, seed=99)
    resumed.load_state_dict(state)
    assert _take(resumed, 7) == expected
    assert resumed.state_dict() == original.state_dict() and original.epoch == 1


def test_sampler_shards_are_disjoint_and_epochs_reshuffle() -> None:
    ranks = [ShardedSampler(40, batch_size=5, dp_rank=r, dp_size=2, seed=0) for r in range(2)]
    epoch0 = [sum(_take(s, 4), []) for s in ranks]
    assert not set(epoch0[0]) & set(epoch0[1]) and len(set(epoch0[0]) | set(epoch0[1])) == 40
    assert sum(_take(ranks[0], 4), []) != epoch0[0]


def test_sampler_refuses_state_from_another_sharding() -> None:
    state = ShardedSampler(40, batch_size=4, dp_rank=0, dp_size=2).state_dict()
    with pytest.raises(ValueError, match="dp_size"):
        ShardedSampler(40, batch_size=4, dp_rank=0, dp_size=4).load_state_dict(state)


@pytest.mark.parametrize("world, pp", [(1, 1), (2, 2), (4, 1), (4, 2), (6, 3), (8, 4)])
def test_topology_covers_every_rank_once(world: int, pp: int) -> None:
    topo = topology(world, pp)
    assert topo["dp"] * pp == world
    for group_key in ("pp_groups", "dp_groups"):
        flat = sorted(r for group in topo[group_key] for r in group)
        assert flat == list(range(world))
    for me in topo["ranks"]:
        r = me["rank"]
        assert (me["dp_rank"], me["pp_rank"]) == (r // pp, r % pp)
        assert me["pp_group"] == topo["pp_groups"][me["dp_rank"]] and r in me["pp_group"]
        assert me["dp_group"] == topo["dp_groups"][me["pp_rank"]] and r in me["dp_group"]
        assert len(me["pp_group"]) == pp and len(me["dp_group"]) == world // pp


def test_topology_world_4_pp_2_is_documented_layout() -> None:
    topo = topology(4, 2)
    assert topo["pp_groups"] == [[0, 1], [2, 3]] and topo["dp_groups"] == [[0, 2], [1, 3]]
    with pytest.raises(ValueError):
        topology(6, 4)


def test_stage_layers_split_contiguously() -> None:
    assert stage_layers(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert stage_layers(2, 3) == [range(0, 1), range(1, 2), range(2, 2)]


def test_build_model_is_deterministic_and_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a, b = build_model(TINY, 5), build_model(TINY, 5)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.blocks[0].attn.qkv.weight, build_model(TINY, 6).blocks[0].attn.qkv.weight)


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_pipelined_forward_equals_full_model(pp: int) -> None:
    model = build_model(TINY, 0)
    idx = torch.randint(0, TINY.vocab_size, (3, TINY.seq_len), generator=torch.Generator().manual_seed(1))
    stages = split_stages(model, pp)
    assert stages[0].is_first and stages[-1].is_last and stages[0].embed is not None and stages[-1].head is not None
    x = idx
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, model(idx))
    # The stages share the model's parameters: together exactly the model's.
    assert sum(p.numel() for s in stages for p in s.parameters()) == sum(p.numel() for p in model.parameters())


def test_config_validation_and_sizes() -> None:
    with pytest.raises(ValueError):
        GPTConfig(vocab_size=64, seq_len=32, d_model=30, n_layers=2, n_heads=4)
    assert sum(p.numel() for p in build_model(SIZES["small"], 0).parameters()) > 500_000


def test_parse_args_rejects_indivisible_micro_batches() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--batch", "6", "--micro-batches", "4"])
    assert parse_args(["--pg-timeout", "30s"]).pg_timeout.total_seconds() == 30


def test_parse_args_persist_every_needs_a_folder() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--persist-every", "5"])
    with pytest.raises(SystemExit):
        parse_args(["--persist-every", "-1", "--persist-dir", "/tmp/x"])
    args = parse_args(["--persist-every", "5", "--persist-dir", "/tmp/x"])
    assert (args.persist_every, args.persist_dir) == (5, "/tmp/x")


def test_single_process_training_runs_and_learns(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from keel.workload import train

    for name in ("WORLD_SIZE", "RANK", "KEEL_AGENT_SOCKET", "KEEL_FAULT_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert train.main(["--steps", "8", "--lr", "1e-2", "--eval-every", "4", "--eval-steps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    losses = [float(line.split()[3]) for line in lines if line.startswith("step ")]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.2
    assert sum(line.startswith("eval step ") for line in lines) == 2
