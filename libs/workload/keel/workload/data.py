"""A deterministic, generated language-modelling dataset and a resumable, DP-sharded sampler.

Nothing is downloaded. Sequences come from a seeded sparse Markov chain: every token has a few
possible successors with skewed probabilities, so a model can learn the chain and the loss falls
clearly from ``ln(vocab)`` towards the chain's entropy (about 0.8 nats with the defaults).

Every sample is a pure function of ``(seed, split, index)``: random access, no storage, identical on
every rank and in every run. The sampler's position is a small ``state_dict`` (epoch, position, seed),
so a resumed run sees exactly the batches it would have seen without the interruption.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["MarkovDataset", "ShardedSampler", "collate"]

_SPLITS = {"train": 0, "eval": 1}
_SUCCESSOR_PROBS = (0.7, 0.2, 0.1)


class MarkovDataset:
    """``num_samples`` sequences of ``seq_len + 1`` token ids per split (inputs and shifted targets).

    ``vocab_size`` must be at least ``len(_SUCCESSOR_PROBS)`` (3).
    """

    def __init__(self, vocab_size: int, seq_len: int, *, seed: int, num_samples: int = 1 << 16) -> None:
        if vocab_size < len(_SUCCESSOR_PROBS):
            raise ValueError(f"vocab_size must be >= {len(_SUCCESSOR_PROBS)}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = num_samples
        chain_rng = np.random.default_rng([seed, 0xC4A1])
        self._successors = np.stack(
            [chain_rng.choice(vocab_size, size=len(_SUCCESSOR_PROBS), replace=False) for _ in range(vocab_size)]
        )
        self._cum_probs = np.cumsum(_SUCCESSOR_PROBS)
        self._cum_probs[-1] = 1.0

    def __len__(self) -> int:
        return self.num_samples

    def entropy_nats(self) -> float:
        """The chain's per-token entropy: the lowest loss a perfect model reaches (ignoring token 0)."""
        p = np.asarray(_SUCCESSOR_PROBS)
        return float(-(p * np.log(p)).sum())

    def sample(self, index: int, split: str = "train") -> np.ndarray:
        """Sequence ``index`` of ``split`` (``"train"`` or ``"eval"``): ``int64[seq_len + 1]``."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, _SPLITS[split], index])
        u = rng.random(self.seq_len)
        branch = np.searchsorted(self._cum_probs, u, side="right")
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        token = int(rng.integers(self.vocab_size))
        out[0] = token
        successors = self._successors
        for t in range(self.seq_len):
            token = int(successors[token, branch[t]])
            out[t + 1] = token
        return out


def collate(dataset: MarkovDataset, indices: Sequence[int], split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, both ``int64[len(indices), seq_len]``; targets are inputs shifted by one."""
    seqs = torch.from_numpy(np.stack([dataset.sample(i, split) for i in indices]))
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


class ShardedSampler:
    """Batches of sample indices for one data-parallel rank, reshuffled every epoch.

    Epoch ``e`` is a permutation of ``range(num_samples)`` drawn from ``(seed, e)``; DP rank ``r`` of
    ``d`` takes every ``d``-th index starting at ``r`` and cuts it into batches of ``batch_size``
    (a short last batch is dropped). ``position`` counts the batches this rank has taken in the
    current epoch. ``state_dict()`` after ``n`` calls to ``next_indices()``, loaded into a fresh
    sampler, makes it return exactly what call ``n + 1`` would have returned.

    Seen globally, batch ``p`` of every rank together is the block of ``d * batch_size`` permuted positions
    starting at ``offset + p * d * batch_size``, rank ``r`` taking every ``d``-th from ``r``. ``offset`` is the
    samples of the epoch consumed before this sharding began (0 unless resharded), which is what lets
    ``reshard_state_dict`` move a position to another number of ranks: every sample of the epoch is still
    taken exactly once.
    """

    def __init__(self, num_samples: int, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self.offset = 0
        self.batches_per_epoch = (num_samples // dp_size) // batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(f"{num_samples} samples over {dp_size} DP ranks do not fill one batch of {batch_size}")
        self._shard: np.ndarray | None = None

    def _epoch_shard(self) -> np.ndarray:
        if self._shard is None:
            perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
            self._shard = perm[self.offset + self.dp_rank :: self.dp_size]
        return self._shard

    def _batches_left_in_epoch(self) -> int:
        """Whole global blocks left after ``offset`` (for offset 0, ``batches_per_epoch``)."""
        # At offset 0, N // (d * b) == (N // d) // b: batches_per_epoch, as before offsets existed.
        return max(0, (self.num_samples - self.offset) // (self.dp_size * self.batch_size))

    def next_indices(self) -> list[int]:
        """The next batch of ``batch_size`` sample indices; moves to the next epoch when one runs out."""
        if self.position >= self._batches_left_in_epoch():
            self.epoch += 1
            self.position = 0
            self.offset = 0
            self._shard = None
        start = self.position * self.batch_size
        batch = self._epoch_shard()[start : start + self.batch_size]
        self.position += 1
        return [int(i) for i in batch]

    def reshard_state_dict(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """This sampler's state, continuing where the saved ranks (``states``, one per saved DP rank in rank order)
        stopped, on this sampler's number of ranks: the epoch's samples consumed so far stay consumed, the next
        ones are dealt to the new ranks. Raises ``ValueError`` unless the saved ranks are one complete set at the
        same position of the same epoch and seed (what ranks that step together hold). Ranks of one DP rank in
        other pipeline stages or tensor-parallel groups hold the same state and count once."""
        if not states:
            raise ValueError("no saved states: not one complete set of DP ranks")
        by_dp_rank: dict[Any, dict[str, Any]] = {}
        for state in states:
            first = by_dp_rank.setdefault(state.get("dp_rank"), state)
            if first != state:
                raise ValueError(f"two saved ranks of DP rank {state.get('dp_rank')} are at different positions")
        dp_size = len(by_dp_rank)
        if set(by_dp_rank) != set(range(dp_size)) or any(
                s.get("dp_size") != dp_size for s in by_dp_rank.values()):
            raise ValueError(f"the saved states are DP ranks {[s.get('dp_rank') for s in states]} of "
                             f"{sorted({str(s.get('dp_size')) for s in states})}, not one complete set")
        states = [by_dp_rank[r] for r in range(dp_size)]
        where = {(s["epoch"], s["position"], s.get("offset", 0), s["seed"], s["batch_size"]) for s in states}
        if len(where) != 1:
            raise ValueError(f"the saved ranks are at different positions (epoch, batches, offset, seed, batch): "
                             f"{sorted(where)}")
        epoch, position, offset, seed, batch = where.pop()
        return {"epoch": epoch, "position": 0, "offset": offset + position * len(states) * batch, "seed": seed,
                "dp_rank": self.dp_rank, "dp_size": self.dp_size, "batch_size": self.batch_size}

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: ``epoch``, ``position`` (batches taken this epoch), ``seed`` and
        the sharding it is only valid for (``dp_rank``, ``dp_size``, ``batch_size``)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "offset": self.offset,
            "seed": self.seed,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``. Raises ``ValueError`` if it was taken with another sharding."""
        for key in ("dp_rank", "dp_size", "batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state was saved with {key}={state[key]}, this sampler has {getattr(self, key)}")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.offset = int(state.get("offset", 0))
        self._shard = None
