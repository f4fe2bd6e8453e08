"""The job clock's choice of jobs: the controller's own needs, plus any job with a recent input."""

from __future__ import annotations

from datetime import timedelta

from keel.controller.adapter import Controller
from keel.events.envelope import Event
from keel.events.types import CLOCK_PRODUCER, CheckpointInventoryReported, TimerTicked, is_foreign_tick
from keel.infra.clock import tick_event
from keel.infra.config import ControllerSettings, Settings
from tests.factories import T0


class NoBus:
    """The choice of jobs publishes nothing; a bus that is never touched is enough."""


def test_a_job_with_a_recent_input_is_ticked_for_the_linger_even_when_the_controller_needs_no_time() -> None:
    now = [T0]
    settings = Settings(controller=ControllerSettings(clock_linger="10m"))  # type: ignore[arg-type]
    controller = Controller(NoBus(), None, settings, clock=lambda: now[0])  # type: ignore[arg-type]
    assert controller.jobs_to_tick() == []
    # The checkpoint broker waits on inventories for "j2" (a human restarted it after a stop): the
    # controller has no rule needing time for it, but the clock must keep ticking it for the broker.
    inventory = Event.create(CheckpointInventoryReported(node_id="n0", generation=2, entries=[]), job_id="j2",
                             subject="node/n0", producer="node-agent", occurred_at=T0)
    controller._note_input(inventory)
    assert controller.jobs_to_tick() == ["j2"]
    # Its own ticks do not keep a job alive: only inputs do.
    now[0] = T0 + timedelta(minutes=9)
    controller._note_input(tick_event("j2", now[0]))
    assert controller.jobs_to_tick() == ["j2"]
    now[0] = T0 + timedelta(minutes=10, seconds=1)
    assert controller.jobs_to_tick() == []


def test_the_clock_tick_is_the_one_clock_and_legacy_clocks_still_count() -> None:
    tick = tick_event("j1", T0)
    assert tick.producer == CLOCK_PRODUCER and tick.subject == "clock/j1" and isinstance(tick.payload, TimerTicked)
    assert not is_foreign_tick(tick)
    for legacy in ("controller-clock", "checkpoint-broker-clock"):
        assert not is_foreign_tick(tick.model_copy(update={"producer": legacy}))
    assert is_foreign_tick(tick.model_copy(update={"producer": "analyzer"}))
