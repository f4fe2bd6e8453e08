"""keel.sdk: the few lines a training loop adds to be supervised by Keel.

    import keel.sdk
    session = keel.sdk.init()
    with session.phase("setup"): ...
    with session.phase("step"):
        for step in ...:
            ...
            session.step_done(step, loss=loss, grad_norm=grad_norm, tokens=tokens)
    session.done()

See ``keel.sdk.session`` for the call-order contract, ``keel.sdk.faults`` for injected faults and
``keel.sdk.checkpoint`` for every-step checkpoints (``Checkpointer``; payload format in ``keel.sdk.shard``), and
``keel.sdk.data`` for data loaders that resume mid-epoch exactly (``ResumableLoader``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from keel.sdk.faults import FAULT_KINDS, FaultFileError, InjectedFault, parse_fault
from keel.sdk.session import PHASES, Session, SessionConfig, init

if TYPE_CHECKING:
    from keel.sdk.checkpoint import Checkpointer, CheckpointError, CheckpointMismatchError, CheckpointStats
    from keel.sdk.data import LoaderStateError, ResumableLoader
    from keel.sdk.shard import ShardFormatError

# Imported on first use: they need torch and numpy, which a plain ``import keel.sdk`` (a process that
# only reports, or reads ``keel.sdk.faults``) should not pay for.
_LAZY = {
    "CheckpointError": "keel.sdk.checkpoint",
    "CheckpointMismatchError": "keel.sdk.checkpoint",
    "CheckpointStats": "keel.sdk.checkpoint",
    "Checkpointer": "keel.sdk.checkpoint",
    "LoaderStateError": "keel.sdk.data",
    "ResumableLoader": "keel.sdk.data",
    "ShardFormatError": "keel.sdk.shard",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keel.sdk' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "FAULT_KINDS",
    "PHASES",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointStats",
    "Checkpointer",
    "FaultFileError",
    "InjectedFault",
    "LoaderStateError",
    "ResumableLoader",
    "Session",
    "SessionConfig",
    "ShardFormatError",
    "init",
    "parse_fault",
]
