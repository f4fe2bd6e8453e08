"""PyTorch Lightning under Keel: heartbeats, phases, every-step checkpoints and exact resume.

    from keel.sdk.lightning import KeelCallback

    keel_cb = KeelCallback()                                  # the session and slots come from the environment
    trainer = L.Trainer(callbacks=[keel_cb], ...)
    trainer.fit(model, train_dataloaders=keel.sdk.ResumableLoader(loader), ckpt_path=keel_cb.resume_path())

What the callback does, on Lightning's own hooks:

- **Heartbeats and phases.** ``setup`` until training starts, ``step`` while it trains (every optimizer step is
  ``Session.step_done(global_step - 1, loss=...)``), ``eval`` during validation, ``done`` at the end.
- **Every-step checkpoints.** After each optimizer step (``on_train_batch_end``), the whole Lightning
  checkpoint (model, optimizers, schedulers, loops with the data position, callbacks' state, precision plugin,
  the datamodule's state) goes into the node's shared-memory slots through the SDK's ``Checkpointer``: the
  parameters and optimizer state by reference, copied on the Checkpointer's thread while the next step
  computes (each optimizer waits for the copy before it steps), everything else captured on the spot. The
  global RNG states are saved with it.
- **Exact resume.** ``resume_path()`` restores the newest verified snapshot (the agent's restore plan, or this
  node's slots) and returns a checkpoint path for ``trainer.fit``, or ``None`` to start fresh. Lightning then
  loads it as it loads any checkpoint (through a ``CheckpointIO`` the callback puts in front of the strategy's
  own; files still go to that one), restarting its loops mid-epoch where the snapshot was taken. The RNG
  states are put back just before the first resumed batch, after anything Lightning draws while it sets up.

Exact means the resumed run's losses and final weights equal an uninterrupted run's bit for bit. That holds
under the SDK's conditions (``docs/sdk.md``) and, for Lightning, when the training data comes through
``keel.sdk.ResumableLoader``, set on epochs by the callback (Lightning sets epochs only on a ``DataLoader``'s
sampler). A loader without a length is fetched one batch ahead of the one being trained: the callback tells
the wrapper which batches were trained, and the wrapper fetches the one ahead again on resume under the RNG
state it was first fetched under. A plain ``DataLoader`` resumes at the start of its epoch, as Lightning warns.
A step followed by a validation is taken after it (the validation's loader draws from the global RNG, and
Lightning resumes a checkpoint taken before a validation by skipping it). Multiple optimizers, gradient
accumulation and sharded strategies (FSDP, DeepSpeed) are refused at ``on_train_start`` with a ``CheckpointError``
that says so: their state is not yet captured by this callback.

Lightning is imported here, not by ``keel.sdk``: install it beside the SDK (``pip install lightning``).
"""

from __future__ import annotations

import logging
import random
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("keel.sdk.lightning needs PyTorch Lightning: pip install lightning") from exc

from keel.sdk.checkpoint import Checkpointer, CheckpointError, _own_copy
from keel.sdk.data import ResumableLoader
from keel.sdk.session import Session, init

__all__ = ["KeelCallback", "KeelCheckpointIO", "RESUME_PREFIX"]

_log = logging.getLogger("keel.sdk.lightning")

RESUME_PREFIX = "keel-restore:"
"""The checkpoint path ``resume_path()`` returns starts with this; ``KeelCheckpointIO`` answers it from memory."""

# Lightning checkpoint keys left out of the every-step snapshot: the hyperparameters are whatever the user's
# constructor took (any Python object; the model being fitted was built with them already).
_NOT_SNAPSHOTTED = ("hyper_parameters", "hparams_name", "hparams_type", "datamodule_hyper_parameters",
                    "datamodule_hparams_name", "datamodule_hparams_type")


class KeelCheckpointIO(CheckpointIO):
    """The strategy's ``CheckpointIO`` with Keel's restore in front: a path from ``KeelCallback.resume_path()``
    loads the restored snapshot from memory; every other path, and every save, goes to ``delegate``."""

    def __init__(self, callback: KeelCallback, delegate: CheckpointIO) -> None:
        self.callback = callback
        self.delegate = delegate

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.delegate.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if isinstance(path, str) and path.startswith(RESUME_PREFIX):
            return self.callback.restored_checkpoint(path)
        return self.delegate.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.delegate.remove_checkpoint(path)

    def teardown(self) -> None:
        self.delegate.teardown()


class _LightningState:
    """The Lightning checkpoint as one ``Checkpointer`` extra (``keel_snapshot_by_reference``: this object decides
    what is copied). The model's parameters and the optimizers' state are kept by reference: they change only in
    an optimizer step, which waits for the copy. Everything else is copied on the spot: buffers (a forward pass
    updates them), and whatever callbacks' ``on_save_checkpoint`` put in, such as averaged weights."""

    keel_snapshot_by_reference = True

    def __init__(self) -> None:
        self.trainer: pl.Trainer | None = None
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        if trainer is None:
            raise CheckpointError("the Lightning state was asked for before training started")
        # weights_only=False is Lightning's "optimizers, schedulers and callbacks too", not a loading mode: nothing is
        # pickled here; the Checkpointer encodes this dict in Keel's own shard format.
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in _NOT_SNAPSHOTTED:
            checkpoint.pop(key, None)
        parameters = {p.data_ptr() for p in trainer.lightning_module.parameters() if p.numel()}
        weights = checkpoint.get("state_dict") or {}
        checkpoint["state_dict"] = {
            name: value.detach() if isinstance(value, torch.Tensor) and value.numel() and value.data_ptr() in parameters
            else _own_copy(value) for name, value in weights.items()}
        for key in checkpoint:
            if key not in ("state_dict", "optimizer_states"):
                checkpoint[key] = _own_copy(checkpoint[key])
        return checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "state_dict" not in state or "loops" not in state:
            raise CheckpointError("the snapshot holds no Lightning checkpoint (was it taken by KeelCallback?)")
        self.restored = state


class KeelCallback(pl.Callback):
    """Keel for a Lightning ``Trainer`` (see the module docstring). ``session``: a ``keel.sdk`` session (default:
    ``keel.sdk.init()``, which reports nothing without an agent). ``ckpt_dir`` and ``slots`` go to the
    ``Checkpointer`` (default: ``$KEEL_CKPT_DIR``; without one, no snapshots)."""

    def __init__(self, session: Session | None = None, *, ckpt_dir: str | None = None, slots: int = 2) -> None:
        super().__init__()
        self.session = session if session is not None else init()
        self._state = _LightningState()
        self.checkpointer = Checkpointer(self.session, extra={"lightning": self._state}, ckpt_dir=ckpt_dir,
                                         slots=slots)
        self._resume_asked = False
        self._restored_step = -1
        self._restored_rng: tuple[Any, Any, torch.Tensor] | None = None
        self._loaded_by_trainer = False
        self._phase: AbstractContextManager[None] | None = None
        self._eval: AbstractContextManager[None] | None = None
        self._last_step = -1
        self._guarded: list[Any] = []

    # -- resume ---------------------------------------------------------------------------------------------------

    def resume_path(self) -> str | None:
        """Restore the newest verified snapshot; the ``ckpt_path`` to give ``trainer.fit``, or ``None`` to start
        fresh. Call it once, before ``fit``. Raises ``CheckpointError`` for a snapshot that cannot be used."""
        if self._resume_asked:
            raise CheckpointError("resume_path() was already called: call it once, for the one trainer.fit")
        self._resume_asked = True
        step = self.checkpointer.restore()
        if step < 0:
            return None
        self._restored_step = step
        self._restored_rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        return f"{RESUME_PREFIX}step-{step}"

    def restored_checkpoint(self, path: str) -> dict[str, Any]:
        """The restored Lightning checkpoint for ``path`` (``KeelCheckpointIO`` asks, once, as ``fit`` starts)."""
        restored = self._state.restored
        if restored is None or path != f"{RESUME_PREFIX}step-{self._restored_step}":
            raise CheckpointError(f"{path}: no Keel snapshot was restored for it (call resume_path() and pass what "
                                  f"it returns to trainer.fit)")
        self._state.restored = None  # Lightning copies it into the live objects; nothing keeps it after
        self._loaded_by_trainer = True
        return restored

    # -- Lightning hooks ------------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.checkpointer.closed:
            raise CheckpointError("this KeelCallback ended with its fit: use a new one for another fit")
        strategy = trainer.strategy
        if not isinstance(strategy.checkpoint_io, KeelCheckpointIO):
            strategy.checkpoint_io = KeelCheckpointIO(self, strategy.checkpoint_io)
        self._state.trainer = trainer
        # Last of all callbacks (Lightning puts ModelCheckpoint last): a snapshot holds what every other callback did
        # in the same hook (early stopping's counters, the best checkpoints). A new list, so the loop that calls this
        # hook goes on over the old one undisturbed. The module's own hooks still run after it.
        trainer.callbacks = [c for c in trainer.callbacks if c is not self] + [self]  # type: ignore[attr-defined]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        problems = []
        if len(trainer.optimizers) != 1:
            problems.append(f"{len(trainer.optimizers)} optimizers (one is supported)")
        if trainer.accumulate_grad_batches != 1:
            problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches} (the accumulated gradients "
                            f"between optimizer steps are not captured)")
        strategy = type(trainer.strategy).__name__
        if any(name in strategy for name in ("FSDP", "DeepSpeed", "ModelParallel")):
            problems.append(f"the {strategy} strategy (sharded state is not captured through Lightning yet)")
        if problems and self.checkpointer.enabled:
            raise CheckpointError("KeelCallback cannot checkpoint this run: " + "; ".join(problems))
        if not self._resume_asked:
            if self.checkpointer.enabled and self.checkpointer.restore() >= 0:
                raise CheckpointError("a Keel snapshot exists for this run but trainer.fit was not given it: pass "
                                      "ckpt_path=keel_callback.resume_path() to trainer.fit")
            self._resume_asked = True
        elif self._restored_step >= 0 and not self._loaded_by_trainer:
            raise CheckpointError(f"resume_path() restored step {self._restored_step} but trainer.fit did not load "
                                  f"it: pass its return value as trainer.fit(ckpt_path=...)")
        for optimizer in trainer.optimizers:
            # The snapshot holds parameters and optimizer state by reference: the step waits for their copy.
            self._guarded.append(optimizer.register_step_pre_hook(lambda *_: self.checkpointer.wait()))
        if self._restored_rng is not None:
            # Lightning drew from the global RNGs while it set up (data loaders, sanity checks): put back the
            # snapshot's, as the uninterrupted run had them after the restored step.
            random.setstate(self._restored_rng[0])
            np.random.set_state(self._restored_rng[1])
            torch.set_rng_state(self._restored_rng[2])
            self._restored_rng = None
        self._last_step = trainer.global_step - 1
        self._enter_phase("step")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step - 1
        if step == self._last_step:
            return  # no optimizer step in this batch (skipped by the user, or a NaN)
        self._last_step = step
        loader = trainer.train_dataloader
        if isinstance(loader, ResumableLoader):
            # A loader without a length is fetched one batch ahead: the position is the batches trained on (this
            # one included: it is processed, not yet counted completed).
            progress = trainer.fit_loop.epoch_loop.batch_progress.current
            loader.trained(int(getattr(progress, "processed", progress.completed + 1)))
        loss = _loss_of(outputs)
        # A validation follows: the step is taken after it (on_validation_end), so that a snapshot never precedes
        # a validation a resumed run would skip. Lightning's own test, on the state it will decide on.
        self.session.step_done(step, loss=loss, snapshot=not _validation_follows(trainer))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = trainer.train_dataloader
        if isinstance(loader, ResumableLoader) and loader.epoch != trainer.current_epoch:
            loader.set_epoch(trainer.current_epoch)  # Lightning sets epochs on DataLoaders' samplers only

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._eval is None:
            self._eval = self.session.phase("eval")
            self._eval.__enter__()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._eval is not None:
            self._eval.__exit__(None, None, None)
            self._eval = None
        if trainer.state.fn == "fit" and not trainer.sanity_checking and self._last_step >= 0:
            # A validation after a step moved the global RNGs (its loader's iterator), and Lightning resumes a
            # checkpoint taken before it by skipping it: the step is taken now (again, if a validation came that
            # was not foreseen, such as a time-based one).
            self.checkpointer.snapshot(self._last_step, again=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.checkpointer.wait()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        for handle in self._guarded:
            handle.remove()
        self._guarded.clear()
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None
        self.checkpointer.close()
        self.session.done()

    def _enter_phase(self, name: str) -> None:
        if self._phase is None:
            self._phase = self.session.phase(name)
            self._phase.__enter__()


def _validation_follows(trainer: pl.Trainer) -> bool:
    """Whether the training loop validates after this batch (called at ``on_train_batch_end``). Lightning's own
    decision (``_should_check_val_fx``, private in 2.6; pure but for a time-based interval), on the state it will
    decide on; False where it is missing (the step is then taken at once, and again after a validation)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    decide = getattr(epoch_loop, "_should_check_val_fx", None)
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if decide is None or fetcher is None or trainer.limit_val_batches == 0:
        return False
    try:
        return bool(decide(fetcher))
    except (AttributeError, TypeError, AssertionError):
        return False


def _loss_of(outputs: Any) -> float | None:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach())
    return None
