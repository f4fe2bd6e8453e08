"""keel.sdk: the few lines a training loop adds to be supervised by Keel.

    import keel.sdk
    session = keel.sdk.init()
    with session.phase("setup"): ...
    with session.phase("step"):
        for step in ...:
            ...
            session.step_done(step, loss=loss, grad_norm=grad_norm, tokens=tokens)
    session.done()

See ``keel.sdk.session`` for the call-order contract and ``keel.sdk.faults`` for injected faults.
"""

from keel.sdk.faults import FAULT_KINDS, FaultFileError, InjectedFault, parse_fault
from keel.sdk.session import PHASES, Session, SessionConfig, init

__all__ = ["FAULT_KINDS", "PHASES", "FaultFileError", "InjectedFault", "Session", "SessionConfig", "init", "parse_fault"]
