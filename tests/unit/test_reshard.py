"""Resharding's pure parts (``keel.sdk.reshard``): the box a rank holds follows PyTorch's own DTensor rule (checked
against torch's implementation, the contract), chunks of one layout reassemble bitwise into any other, and what
cannot be resharded is refused with the reason."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from keel.sdk.reshard import Box, ReshardError, assemble, chunk_box, equal_states, merge_rank_states, saved_box
from keel.sdk.shard import ShardedTensor
from keel.workload.data import ShardedSampler

_LAYOUTS = [
    ((4,), ("S(0)",)),
    ((3,), ("S(0)",)),
    ((5,), ("S(1)",)),
    ((2, 2), ("S(0)", "S(1)")),
    ((2, 3), ("S(0)", "S(0)")),
    ((2, 2), ("R", "S(0)")),
    ((3, 2), ("S(1)", "R")),
    ((1,), ("R",)),
]


def _torch_placement(text: str):
    return Replicate() if text == "R" else Shard(int(text[2:-1]))


@pytest.mark.parametrize(("mesh", "placements"), _LAYOUTS)
@pytest.mark.parametrize("shape", [(10, 7), (3, 4), (1, 9), (0, 5), (7, 1)])
def test_the_box_of_every_coordinate_is_pytorchs(mesh, placements, shape) -> None:
    for coord in itertools.product(*(range(n) for n in mesh)):
        sizes, offsets = _compute_local_shape_and_global_offset(
            shape, mesh, list(coord), [_torch_placement(p) for p in placements])
        box = chunk_box(shape, placements, mesh, coord)
        assert (box.sizes, box.offsets if not box.empty else None) == (
            tuple(sizes), tuple(offsets) if not box.empty else None), (mesh, placements, shape, coord)


def _chunks(whole: torch.Tensor, mesh, placements) -> list[ShardedTensor]:
    out = []
    for coord in itertools.product(*(range(n) for n in mesh)):
        box = chunk_box(whole.shape, placements, mesh, coord)
        local = whole[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes, strict=True))].clone()
        out.append(ShardedTensor(local=local, shape=tuple(whole.shape), stride=tuple(whole.stride()),
                                 placements=tuple(placements), mesh_shape=tuple(mesh), mesh_dim_names=None,
                                 coord=tuple(coord)))
    return out


@pytest.mark.parametrize(("old", "new"), list(itertools.permutations(_LAYOUTS[:6], 2)))
def test_chunks_of_one_layout_reassemble_bitwise_into_another(old, new) -> None:
    whole = torch.randn(11, 6, dtype=torch.float32)
    whole[0, 0] = float("nan")  # bytes, not values: a NaN and a -0.0 survive
    whole[1, 1] = -0.0
    saved = _chunks(whole, *old)
    world = math.prod(old[0])
    pieces = [(saved_box(c, r, world), c.local) for r, c in enumerate(saved)]
    for coord in itertools.product(*(range(n) for n in new[0])):
        target = chunk_box(whole.shape, new[1], new[0], coord)
        got = assemble(target, pieces, dtype=torch.float32)
        expected = whole[target.slices(Box((0, 0), tuple(whole.shape)))]
        assert torch.equal(got.view(torch.int32), expected.contiguous().view(torch.int32))


def test_a_missing_chunk_a_partial_placement_and_an_unknown_coordinate_are_refused() -> None:
    whole = torch.arange(12.0).reshape(4, 3)
    saved = _chunks(whole, (4,), ("S(0)",))
    pieces = [(saved_box(c, r, 4), c.local) for r, c in enumerate(saved)]
    with pytest.raises(ReshardError, match="3 of 6 elements .* are in no saved shard"):
        assemble(Box((0, 0), (2, 3)), pieces[:1], dtype=torch.float32, what="w")
    with pytest.raises(ReshardError, match="saved as torch.float32, live as torch.float64"):
        assemble(Box((0, 0), (1, 3)), pieces, dtype=torch.float64, what="w")
    with pytest.raises(ReshardError, match="pending reduction"):
        chunk_box((4, 3), ("P(sum)",), (2,), (0,))
    # Written before coordinates were recorded: placed by its rank on a 1-D mesh over every rank, refused elsewhere.
    old = ShardedTensor(local=whole[2:3], shape=(4, 3), stride=(3, 1), placements=("S(0)",), mesh_shape=(4,),
                        mesh_dim_names=None)
    assert saved_box(old, 2, 4) == Box((2, 0), (1, 3))
    two_d = ShardedTensor(local=whole[:2, :2], shape=(4, 3), stride=(3, 1), placements=("S(0)", "S(1)"),
                          mesh_shape=(2, 2), mesh_dim_names=None)
    with pytest.raises(ReshardError, match="without its mesh coordinate"):
        saved_box(two_d, 0, 4)
    lying = ShardedTensor(local=whole[:2], shape=(4, 3), stride=(3, 1), placements=("S(0)",), mesh_shape=(4,),
                          mesh_dim_names=None, coord=(1,))
    with pytest.raises(ReshardError, match=r"rank 1's chunk is \[2, 3\], .* says \[1, 3\]"):
        saved_box(lying, 1, 4)


def test_per_rank_state_is_kept_when_equal_resharded_by_its_rule_or_refused() -> None:
    same = [{"lr": 0.1, "step": torch.tensor(3.0)}, {"lr": 0.1, "step": torch.tensor(3.0)}]
    assert merge_rank_states("scheduler", same, None) is same[0]
    differ = [{"rank": 0}, {"rank": 1}]
    with pytest.raises(ReshardError, match="the sampler's state differs .* no reshard_state_dict"):
        merge_rank_states("sampler", differ, None)
    assert merge_rank_states("sampler", differ, lambda states: {"ranks": len(states)}) == {"ranks": 2}
    with pytest.raises(ReshardError, match="refused the saved states: no"):
        merge_rank_states("sampler", differ, lambda states: (_ for _ in ()).throw(ValueError("no")))
    assert equal_states(float("nan"), float("nan")) and not equal_states(torch.tensor(0.0), torch.tensor(-0.0))
    assert not equal_states(1, 1.0) and equal_states((1, [2, "a"]), (1, [2, "a"]))


@pytest.mark.parametrize(("old", "new"), [(4, 3), (4, 2), (2, 4), (3, 3), (1, 2)])
def test_a_resharded_sampler_deals_every_sample_of_the_epoch_exactly_once(old: int, new: int) -> None:
    n, batch, taken = 120, 3, 4
    before = [ShardedSampler(n, batch_size=batch, dp_rank=r, dp_size=old, seed=5) for r in range(old)]
    seen = [i for s in before for _ in range(taken) for i in s.next_indices()]
    states = [s.state_dict() for s in before]
    after = [ShardedSampler(n, batch_size=batch, dp_rank=r, dp_size=new, seed=5) for r in range(new)]
    for s in after:
        s.load_state_dict(s.reshard_state_dict(states))
    while all(s.epoch == 0 for s in after):
        drawn = [s.next_indices() for s in after]
        if any(s.epoch for s in after):
            break
        seen += [i for d in drawn for i in d]
    assert len(seen) == len(set(seen)) and len(seen) > n - new * batch * 2  # no sample twice, almost all dealt
    # Same number of ranks: the exact batches the saved ranks would have drawn next.
    if old == new:
        fresh = [ShardedSampler(n, batch_size=batch, dp_rank=r, dp_size=old, seed=5) for r in range(old)]
        for s in fresh:
            for _ in range(taken):
                s.next_indices()
        replay = [ShardedSampler(n, batch_size=batch, dp_rank=r, dp_size=old, seed=5) for r in range(old)]
        for s in replay:
            s.load_state_dict(s.reshard_state_dict(states))
        assert [s.next_indices() for s in replay] == [s.next_indices() for s in fresh]
    with pytest.raises(ValueError, match="not one complete set"):
        after[0].reshard_state_dict(states[:-1])
    if old > 1:
        states[1]["position"] += 1
        with pytest.raises(ValueError, match="different positions"):
            after[0].reshard_state_dict(states)


def test_a_sampler_resharded_from_ranks_of_several_pipeline_stages_counts_each_dp_rank_once() -> None:
    """With PP = 2 the Checkpointer hands one state per saved world rank: DP ranks [0, 0, 1, 1]."""
    before = [ShardedSampler(60, batch_size=2, dp_rank=r, dp_size=2, seed=1) for r in range(2)]
    for s in before:
        s.next_indices()
    states = [before[0].state_dict(), before[0].state_dict(), before[1].state_dict(), before[1].state_dict()]
    after = ShardedSampler(60, batch_size=2, dp_rank=0, dp_size=3, seed=1)
    assert after.reshard_state_dict(states)["offset"] == 4
    states[1] = {**states[1], "position": 0}
    with pytest.raises(ValueError, match="two saved ranks of DP rank 0 are at different positions"):
        after.reshard_state_dict(states)


def test_a_rule_is_used_even_when_one_rank_saved() -> None:
    """One saved state is always "equal": the object's rule must still decide (a sampler of 1 rank onto 2)."""
    assert merge_rank_states("sampler", [{"dp_size": 1}], lambda states: {"dp_size": 2}) == {"dp_size": 2}
