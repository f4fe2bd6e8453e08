"""Hugging Face ``transformers.Trainer`` under Keel: heartbeats, phases, every-step checkpoints and exact resume.

    from keel.sdk.hf import KeelCallback

    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val)   # any Trainer subclass
    keel_cb = KeelCallback.attach(trainer)
    trainer.train(resume_from_checkpoint=keel_cb.resume_dir())

What it does:

- **Heartbeats and phases.** ``step`` while training (each optimizer step is ``Session.step_done(global_step -
  1)``), ``eval`` while ``trainer.evaluate`` runs (``attach`` wraps it on the instance: the Trainer has no hook at
  an evaluation's start), ``done`` at the end.
- **Every-step checkpoints.** After each optimizer step (``on_step_end``): the model's parameters and the
  optimizer's state by reference, copied on the ``Checkpointer``'s thread while the next step computes (the
  optimizer waits for the copy before it steps), with the buffers, the LR scheduler, the ``TrainerState``
  (as the JSON the Trainer itself writes) and the global RNG states captured on the spot. A step followed by
  an evaluation is taken after it (the evaluation's loader draws from the global RNG, and a resumed run does not
  evaluate that step again).
- **Exact resume.** ``resume_dir()`` restores the newest verified snapshot (the agent's restore plan, or this
  node's slots) and returns a folder holding only its ``trainer_state.json`` (or ``None`` to start fresh).
  ``trainer.train(resume_from_checkpoint=...)`` then resumes as from any checkpoint: it skips the batches
  already trained on in the epoch, and the Trainer's loading of the weights, the optimizer and scheduler, the
  gradient scaler and the RNG states from that folder is answered from memory (``attach`` puts Keel's loaders
  in front of the Trainer's own on this instance; another folder still loads from disk).

Refused with a ``CheckpointError`` at ``on_train_begin``: gradient accumulation (the gradients accumulated
between optimizer steps are not captured), DeepSpeed and FSDP (sharded state through the Trainer is not
captured yet), and a snapshot that exists while ``train`` was not given ``resume_dir()``.

Transformers is imported here, not by ``keel.sdk``: install it beside the SDK (tested with 5.25.0, whose
``Trainer._load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler`` and ``_load_rng_state``
are what ``attach`` wraps).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import tempfile
import weakref
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("keel.sdk.hf needs Hugging Face transformers: pip install transformers accelerate") from exc

from keel.sdk.checkpoint import Checkpointer, CheckpointError
from keel.sdk.data import _global_rng_states, _set_global_rng_states
from keel.sdk.session import Session, init

__all__ = ["KeelCallback"]

TRAINER_STATE_FILE = "trainer_state.json"
"""What the Trainer reads from a checkpoint folder to know where it was (``transformers.trainer.TRAINER_STATE_NAME``)."""
_RESUME_FOLDER_PREFIX = "keel-restore-step-"


class _TrainerState:
    """The Trainer's training state as one ``Checkpointer`` extra, its tensors kept by reference at a snapshot
    (``keel_snapshot_by_reference``): parameters and optimizer state change only in an optimizer step, which waits
    for the copy; buffers (a forward pass updates them) are copied on the spot."""

    keel_snapshot_by_reference = True

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.state: TrainerState | None = None
        self.trainer: Trainer | None = None
        self.epoch_rng: tuple[Any, Any, torch.Tensor] | None = None
        """The global RNG states as the epoch in progress began: its data loader's iterator was created under them."""
        self.request_rng: tuple[Any, Any, torch.Tensor] | None = None
        """The global RNG states as the Trainer asked its loader for the last batch trained on. A loader that fetches
        one batch ahead (accelerate's ``DataLoaderShard`` does) fetched the next batch under them."""
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.model is None or self.state is None:
            raise CheckpointError("the Trainer's state was asked for before training started")
        weights: dict[str, Any] = {}
        for name, value in self.model.state_dict(keep_vars=True).items():
            if isinstance(value, torch.nn.Parameter):
                weights[name] = value.detach()
            else:
                weights[name] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        return {"model": weights,
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "trainer_state": json.dumps(self._trainer_state(), sort_keys=True),
                "epoch_rng": list(self.epoch_rng) if self.epoch_rng is not None else None,
                "request_rng": list(self.request_rng) if self.request_rng is not None else None}

    def _trainer_state(self) -> dict[str, Any]:
        """The ``TrainerState`` as the Trainer writes it to a checkpoint: with the state of every stateful callback
        (early stopping's patience, the control flags) as it is now, which the Trainer refreshes only when it
        saves a checkpoint of its own."""
        assert self.state is not None
        state = dataclasses.asdict(self.state)
        if self.trainer is not None:
            from transformers.trainer_callback import ExportableState

            states: dict[str, list[Any]] = {}
            for cb in [*self.trainer.callback_handler.callbacks, self.trainer.control]:
                if isinstance(cb, ExportableState):
                    states.setdefault(cb.__class__.__name__, []).append(cb.state())
            state["stateful_callbacks"] = {name: found[0] if len(found) == 1 else found for name, found in states.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not {"model", "trainer_state"} <= set(state):
            raise CheckpointError("the snapshot holds no Trainer state (was it taken by keel.sdk.hf.KeelCallback?)")
        self.restored = state


def _innermost(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (and any other such wrapper)."""
    while not type(optimizer).__module__.startswith("torch.optim") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


class KeelCallback(TrainerCallback):
    """Keel for a ``transformers.Trainer`` (see the module docstring). Build it with ``attach(trainer)``.
    ``session``: a ``keel.sdk`` session (default ``keel.sdk.init()``, which reports nothing without an agent);
    ``ckpt_dir`` and ``slots`` go to the ``Checkpointer`` (default ``$KEEL_CKPT_DIR``; without one, no snapshots)."""

    def __init__(self, session: Session | None = None, *, ckpt_dir: str | None = None, slots: int = 2) -> None:
        self.session = session if session is not None else init()
        self._state = _TrainerState()
        self.checkpointer = Checkpointer(self.session, extra={"trainer": self._state}, ckpt_dir=ckpt_dir, slots=slots)
        self.trainer: Trainer | None = None
        self._resume_asked = False
        self._restored_step = -1
        self._restored_rng: tuple[Any, Any, torch.Tensor] | None = None
        self._restored_epoch_rng: tuple[Any, Any, torch.Tensor] | None = None
        self._restored_request_rng: tuple[Any, Any, torch.Tensor] | None = None
        self._data_replayed = False
        self._resume_folder: Path | None = None
        self._loaded: set[str] = set()
        self._phase: AbstractContextManager[None] | None = None
        self._last_step = -1
        self._evaluated = False
        self._guarded: list[Any] = []

    @classmethod
    def attach(cls, trainer: Trainer, session: Session | None = None, *, ckpt_dir: str | None = None,
               slots: int = 2) -> KeelCallback:
        """A callback added to ``trainer``, whose loading of a ``resume_dir()`` folder it answers from memory."""
        callback = cls(session, ckpt_dir=ckpt_dir, slots=slots)
        callback.trainer = trainer
        trainer.add_callback(callback)
        for name, load in (("_load_from_checkpoint", callback._load_weights),
                           ("_load_optimizer_and_scheduler", callback._load_optimizer_and_scheduler),
                           ("_load_scaler", callback._load_scaler), ("_load_rng_state", callback._load_rng_state)):
            original = getattr(trainer, name)
            setattr(trainer, name, _in_front(callback, load, original))
        evaluate = trainer.evaluate

        def evaluate_in_eval_phase(*args: Any, **kwargs: Any) -> Any:
            with callback.session.phase("eval"):
                return evaluate(*args, **kwargs)

        trainer.evaluate = evaluate_in_eval_phase  # type: ignore[method-assign]
        resumed_dataloader = trainer.get_resumed_dataloader

        def replayed_dataloader(dataloader: Any, num_batches: int) -> Any:
            if callback._resume_folder is None or callback._restored_epoch_rng is None:
                return resumed_dataloader(dataloader, num_batches)
            return _ReplayedEpoch(callback, dataloader, num_batches)

        trainer.get_resumed_dataloader = replayed_dataloader  # type: ignore[method-assign]
        get_batch_samples = trainer.get_batch_samples

        def recorded_request(*args: Any, **kwargs: Any) -> Any:
            callback._state.request_rng = _global_rng_states()
            return get_batch_samples(*args, **kwargs)

        trainer.get_batch_samples = recorded_request  # type: ignore[method-assign]
        log_save_evaluate = trainer._maybe_log_save_evaluate

        def then_snapshot(*args: Any, **kwargs: Any) -> Any:
            result = log_save_evaluate(*args, **kwargs)
            callback.after_log_save_evaluate()
            return result

        trainer._maybe_log_save_evaluate = then_snapshot  # type: ignore[method-assign]
        return callback

    # -- resume ---------------------------------------------------------------------------------------------------

    def resume_dir(self) -> str | None:
        """Restore the newest verified snapshot; the folder to give ``trainer.train(resume_from_checkpoint=...)``,
        or ``None`` to start fresh. Call it once, before ``train``. Raises ``CheckpointError`` for a snapshot that
        cannot be used."""
        if self._resume_asked:
            raise CheckpointError("resume_dir() was already called: call it once, for the one trainer.train")
        self._resume_asked = True
        step = self.checkpointer.restore()
        if step < 0:
            return None
        restored = self._state.restored
        assert restored is not None
        self._restored_step = step
        self._restored_rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        epoch_rng = restored.get("epoch_rng")
        self._restored_epoch_rng = tuple(epoch_rng) if epoch_rng else None
        request_rng = restored.get("request_rng")
        self._restored_request_rng = tuple(request_rng) if request_rng else None
        folder = Path(tempfile.mkdtemp(prefix=f"{_RESUME_FOLDER_PREFIX}{step}-"))
        (folder / TRAINER_STATE_FILE).write_text(restored["trainer_state"])
        self._resume_folder = folder
        weakref.finalize(self, shutil.rmtree, str(folder), True)  # also when train() raises
        return str(folder)

    def _ours(self, checkpoint: str | None) -> bool:
        return checkpoint is not None and self._resume_folder is not None and Path(checkpoint) == self._resume_folder

    def _restored(self, what: str) -> dict[str, Any]:
        restored = self._state.restored
        if restored is None:
            raise CheckpointError(f"{self._resume_folder}: its snapshot is no longer held (a second train()?)")
        self._loaded.add(what)
        return restored

    def _load_weights(self, checkpoint: str, model: torch.nn.Module | None = None) -> None:
        assert self.trainer is not None
        target = model if model is not None else self.trainer.model
        if target is None:
            raise CheckpointError("the Trainer has no model to load the restored weights into")
        target.load_state_dict(self._restored("weights")["model"], strict=True)

    def _load_optimizer_and_scheduler(self, checkpoint: str) -> None:
        assert self.trainer is not None
        restored = self._restored("optimizer")
        if restored["optimizer"] is not None:
            _innermost(self.trainer.optimizer).load_state_dict(restored["optimizer"])
        if restored["scheduler"] is not None and self.trainer.lr_scheduler is not None:
            self.trainer.lr_scheduler.load_state_dict(restored["scheduler"])

    def _load_scaler(self, checkpoint: str) -> None:
        self._loaded.add("scaler")  # CPU and bf16 runs have no gradient scaler; fp16 is refused at train begin

    def _load_rng_state(self, checkpoint: str) -> None:
        # At an epoch's start, before its loader's iterator is created: the snapshot's states. Mid-epoch the
        # Trainer calls this after it fetched the first batch past the skipped ones: the replayed epoch
        # (``_ReplayedEpoch``) put the snapshot's states back before that fetch, as the uninterrupted run had them,
        # and the fetch moved them on as it did there; setting them again would undo that.
        if self._restored_rng is not None and not self._data_replayed:
            _set_global_rng_states(self._restored_rng)
            self._state.epoch_rng = self._restored_rng  # the epoch's iterator is created under these next
        self._loaded.add("rng")

    # -- Trainer hooks --------------------------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        trainer = self.trainer
        if trainer is None:
            raise CheckpointError("build the callback with KeelCallback.attach(trainer), not KeelCallback()")
        if self.checkpointer.closed:
            raise CheckpointError("this KeelCallback ended with its training run: attach a new one for another train()")
        problems = []
        if args.gradient_accumulation_steps != 1:
            problems.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps} (the gradients "
                            f"accumulated between optimizer steps are not captured)")
        if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
            problems.append("DeepSpeed or FSDP (sharded state through the Trainer is not captured yet)")
        if args.fp16:
            problems.append("fp16 (its gradient scaler is not captured yet; bf16 needs none)")
        if problems and self.checkpointer.enabled:
            raise CheckpointError("keel.sdk.hf.KeelCallback cannot checkpoint this run: " + "; ".join(problems))
        if not self._resume_asked:
            if self.checkpointer.enabled and self.checkpointer.restore() >= 0:
                raise CheckpointError("a Keel snapshot exists for this run but trainer.train was not given it: pass "
                                      "resume_from_checkpoint=keel_callback.resume_dir()")
            self._resume_asked = True
        elif self._restored_step >= 0:
            if not {"weights", "optimizer"} <= self._loaded:
                raise CheckpointError(f"resume_dir() restored step {self._restored_step} but trainer.train did not "
                                      f"load it: pass its return value as resume_from_checkpoint")
            self._state.restored = None  # loaded into the live objects: nothing keeps it now
        self._state.model = trainer.model
        self._state.optimizer = _innermost(trainer.optimizer) if trainer.optimizer is not None else None
        self._state.scheduler = trainer.lr_scheduler
        self._state.state = state
        self._state.trainer = trainer
        if self._state.optimizer is not None:
            # The snapshot holds parameters and optimizer state by reference: the step waits for their copy.
            self._guarded.append(self._state.optimizer.register_step_pre_hook(lambda *_: self.checkpointer.wait()))
        self._last_step = state.global_step - 1
        if self._phase is None:
            self._phase = self.session.phase("step")
            self._phase.__enter__()

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        # The Trainer creates the epoch's loader iterator next, drawing from these (its workers' seed). The first
        # epoch after a restore is created under the interrupted epoch's states (a replay, mid-epoch) or under the
        # snapshot's (``_load_rng_state``, at an epoch's start): those set it again, so that a second failure in
        # this epoch replays it as the first did.
        self._state.epoch_rng = _global_rng_states()
        if self._restored_epoch_rng is not None and not self._data_replayed:
            self._state.epoch_rng = self._restored_epoch_rng

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        step = state.global_step - 1
        if step == self._last_step:
            return
        self._last_step = step
        # An evaluation follows (DefaultFlowCallback, ahead of this one, decided): the step is taken after it, so
        # that a snapshot never precedes an evaluation a resumed run would not run again.
        self.session.step_done(step, snapshot=not control.should_evaluate)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        # Taken once the Trainer is done with the evaluation (``after_log_save_evaluate``): it still steps a
        # plateau scheduler and records the best metric after this hook.
        self._evaluated = True

    def after_log_save_evaluate(self) -> None:
        """Called (``attach``) when the Trainer's ``_maybe_log_save_evaluate`` returns: an evaluation that ran drew
        from the global RNGs, and a resumed run does not evaluate that step again, so the step is taken now (again,
        if it was taken before the evaluation was known, as with ``eval_strategy="epoch"``)."""
        if self._evaluated and self._last_step >= 0 and self.checkpointer.enabled:
            self.checkpointer.snapshot(self._last_step, again=True)
        self._evaluated = False

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        for handle in self._guarded:
            handle.remove()
        self._guarded.clear()
        self.checkpointer.wait()
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None
        self.checkpointer.close()
        self.session.done()
        if self._resume_folder is not None:
            shutil.rmtree(self._resume_folder, ignore_errors=True)


class _ReplayedEpoch:
    """The resumed epoch's loader, for ``Trainer.get_resumed_dataloader``: its iterator is created under the RNG
    states the interrupted epoch's was (the workers' seed, a sampler's seed drawn from the global RNG), the
    batches already trained on are fetched and dropped (every worker sees what it saw), the last of them asked for
    under the RNG states the interrupted run asked under (a loader that fetches one ahead fetches the next batch
    then, drawing its main-process augmentation as it did), then the snapshot's RNG states are put back, where the
    uninterrupted run had them when it asked for the next batch."""

    def __init__(self, callback: KeelCallback, dataloader: Any, skip: int) -> None:
        self.callback, self.dataloader, self.skip = callback, dataloader, skip

    def __len__(self) -> int:
        return len(self.dataloader) - self.skip

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataloader, "set_epoch"):
            self.dataloader.set_epoch(epoch)

    def __iter__(self) -> Any:
        callback = self.callback
        assert callback._restored_epoch_rng is not None and callback._restored_rng is not None
        _set_global_rng_states(callback._restored_epoch_rng)
        iterator = iter(self.dataloader)
        for index in range(self.skip):
            if index == self.skip - 1 and callback._restored_request_rng is not None:
                _set_global_rng_states(callback._restored_request_rng)
            next(iterator)
        _set_global_rng_states(callback._restored_rng)
        callback._data_replayed = True
        # The resumed epoch is the interrupted one, and the batch asked for next is asked for under the snapshot's
        # states (the Trainer's request was recorded before this replay ran).
        callback._state.epoch_rng = callback._restored_epoch_rng
        callback._state.request_rng = callback._restored_rng
        yield from iterator


def _in_front(callback: KeelCallback, keel_load: Any, original: Any) -> Any:
    """``original`` (a Trainer's loader of one part of a checkpoint folder), answered by ``keel_load`` for the
    folder ``callback.resume_dir()`` made."""
    def load(checkpoint: str | None, *args: Any, **kwargs: Any) -> Any:
        if callback._ours(checkpoint):
            return keel_load(checkpoint, *args, **kwargs)
        return original(checkpoint, *args, **kwargs)

    return load
