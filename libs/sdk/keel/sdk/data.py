"""Exact mid-epoch resume for the data loaders people already have.

    loader = keel.sdk.ResumableLoader(DataLoader(dataset, batch_size=32, sampler=DistributedSampler(dataset),
                                                 num_workers=4))
    ckpt = keel.sdk.Checkpointer(session, model=model, optimizer=optimizer, loader=loader)
    step = ckpt.restore() + 1
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)                  # also the sampler's (DistributedSampler.set_epoch)
        for batch in loader:                     # after a restore: from the batch after the last one trained on
            ...
            ckpt.snapshot(step)
            step += 1

A plain ``DataLoader`` has no position to save, and creating its iterator draws from the global torch RNG
(its workers' base seed, and a ``RandomSampler``'s seed when it has no generator). Started again after a
restore, it would shuffle differently and move the global RNG, so dropout and every later draw would differ from
an uninterrupted run. ``ResumableLoader`` counts the batches it hands to the loop and records the RNG state its
epoch's iterator was created from. On resume it creates the iterator from that same state and puts the
caller's RNG back as it was, so the order, the workers' seeds and the global RNG all match the uninterrupted
run. It then fetches and discards the batches already trained on. Skipping indices in the sampler instead
would be cheaper, but each worker's augmentation RNG would then have seen fewer batches than in the
uninterrupted run.

A loop that fetches ahead (PyTorch Lightning's fetches one batch before it trains the current one) calls
``trained(n)`` before each snapshot: the position saved is then the ``n`` batches trained on, and the batches
fetched beyond them are fetched again on resume under the RNG states they were first fetched under (recorded
for every batch handed out), so a loader that draws augmentations from the global RNGs gives the same batches.

A torchdata ``StatefulDataLoader`` saves its own position: pass it as ``loader=`` directly.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

__all__ = ["ResumableLoader", "LoaderStateError"]


class LoaderStateError(ValueError):
    """A saved position that does not fit this loader (another length, batch size or shuffling)."""


class ResumableLoader:
    """Wraps a ``torch.utils.data.DataLoader`` (any sampler, any number of workers) so that its position in
    the epoch and the RNG state it was created from are part of the checkpoint.

    Iterate the wrapper, not the loader inside it: only what the wrapper hands out is counted.
    ``state_dict()`` holds the epoch, the batches handed out in it, and the RNG state the epoch's iterator
    was created from. ``load_state_dict()`` makes the next iteration of that epoch resume after those
    batches. An epoch that was finished resumes at the next one, with nothing to skip. ``trained(n)``: for a loop
    that fetches ahead of what it has trained on (see the module docstring)."""

    FETCHED_AHEAD_MAX = 4
    """The most batches a loop may have fetched beyond those it trained on (``trained``)."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        if not isinstance(loader, DataLoader):
            raise TypeError(f"ResumableLoader wraps a torch.utils.data.DataLoader, not {type(loader).__name__}")
        self.loader = loader
        self.epoch = 0
        self.consumed = 0
        """Batches handed to the training loop in the current epoch."""
        self._created_from: torch.Tensor | None = None
        self._resume: dict[str, Any] | None = None
        self._ahead = 0
        """Batches handed out beyond those trained on (``trained``), as of the last call."""
        self._fetched_under: deque[tuple[Any, Any, torch.Tensor]] = deque(maxlen=self.FETCHED_AHEAD_MAX)
        """The global RNG states the last batches handed out were fetched under, oldest first."""

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (the sampler's ``set_epoch`` too, where it has one). The restored epoch keeps
        its position; any other drops it."""
        if self._resume is not None and epoch != self.epoch:
            self._resume = None
        self.epoch = epoch
        self._set_sampler_epoch()

    def _generator_state(self) -> torch.Tensor:
        generator = self.loader.generator
        return generator.get_state() if generator is not None else torch.get_rng_state()

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        self.consumed = 0
        self._ahead = 0
        self._fetched_under.clear()
        refetched: list[tuple[Any, tuple[Any, Any, torch.Tensor]]] = []
        if resume is None:
            self._created_from = self._generator_state()
            iterator = iter(self.loader)
        else:
            # Recreate the epoch's iterator from the state the first one was created from, and fetch the batches
            # already trained on (dropped; every worker sees the batches it saw before), all under that state:
            # the sampler draws its seed lazily, at the first batch, and a loader without workers draws its
            # augmentations from the global RNGs. Batches a prefetching loop had fetched beyond those are fetched
            # again under the RNG states they were first fetched under, and kept. Then the caller's RNGs go back
            # to where the restore put them, where the uninterrupted run had them at this step.
            self._created_from = resume["created_from"]
            caller = _global_rng_states()
            try:
                if self.loader.generator is not None:  # the loader's own generator: left advanced, as it was
                    self.loader.generator.set_state(self._created_from)
                else:
                    torch.set_rng_state(self._created_from)
                iterator = iter(self.loader)
                for _ in range(resume["consumed"]):
                    next(iterator)
                    self.consumed += 1
                for states in resume["fetched_under"]:
                    _set_global_rng_states(states)
                    try:
                        refetched.append((next(iterator), states))
                    except StopIteration:
                        break
            finally:
                _set_global_rng_states(caller)
        for batch, states in refetched:
            self.consumed += 1
            self._fetched_under.append(states)
            yield batch
        while True:
            states = _global_rng_states()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.consumed += 1
            self._fetched_under.append(states)
            yield batch

    def trained(self, batches: int) -> None:
        """The training loop has finished ``batches`` batches of this epoch; those it fetched beyond them are
        not part of the position (a loop that fetches ahead calls this before each snapshot)."""
        ahead = self.consumed - int(batches)
        if not 0 <= ahead <= min(self.FETCHED_AHEAD_MAX, len(self._fetched_under)):
            raise LoaderStateError(f"trained({batches}): {self.consumed} batches of epoch {self.epoch} were handed "
                                   f"out; a loop may have trained on at most that many and fetched at most "
                                   f"{self.FETCHED_AHEAD_MAX} beyond them")
        self._ahead = ahead

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "consumed": self.consumed - self._ahead,
                                 "length": self._length(), "batch_size": self.loader.batch_size,
                                 "sampler": type(self.loader.sampler).__name__}
        if self._created_from is not None:
            state["created_from"] = self._created_from.clone()
        if self._ahead:
            ahead = list(self._fetched_under)[-self._ahead:]
            state["fetched_under"] = [[py, np_state, torch_state.clone()] for py, np_state, torch_state in ahead]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        length, consumed = self._length(), int(state["consumed"])
        for key, mine in (("length", length), ("batch_size", self.loader.batch_size),
                          ("sampler", type(self.loader.sampler).__name__)):
            if state.get(key) != mine:
                raise LoaderStateError(f"the saved data position is for a loader with {key}={state.get(key)!r}, this "
                                       f"one has {key}={mine!r}: its batches would not be the same ones")
        self.epoch = int(state["epoch"])
        self._resume = None
        if length is not None and consumed >= length:  # the epoch was finished: the next one starts fresh
            self.epoch += 1
            self.consumed = 0
        elif consumed > 0 or state.get("fetched_under"):
            created_from = state.get("created_from")
            if not isinstance(created_from, torch.Tensor):
                raise LoaderStateError("the saved data position has no RNG state to recreate its epoch from")
            try:
                fetched_under = [(py, tuple(np_state), torch_state) for py, np_state, torch_state
                                 in state.get("fetched_under") or []]
            except (TypeError, ValueError):
                raise LoaderStateError("the saved data position's prefetched batches are malformed") from None
            self._resume = {"consumed": consumed, "created_from": created_from.clone(), "fetched_under": fetched_under}
            self.consumed = consumed
        else:
            self.consumed = 0
        self._set_sampler_epoch()

    def _set_sampler_epoch(self) -> None:
        """``set_epoch`` of the sampler (``DistributedSampler``), or of the batch sampler's, where there is one."""
        for sampler in (self.loader.sampler, getattr(self.loader.batch_sampler, "sampler", None)):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)

    def _length(self) -> int | None:
        try:
            return len(self.loader)
        except TypeError:  # an IterableDataset without __len__
            return None


def _global_rng_states() -> tuple[Any, Any, torch.Tensor]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_global_rng_states(states: tuple[Any, Any, torch.Tensor]) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
