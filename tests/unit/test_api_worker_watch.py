"""An API worker stops when the process that forked it is gone, whatever became of its parent-death signal (one
that comes before uvicorn installs its handlers meets the no-op SIGTERM handler inherited from the parent)."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

from keel.api.main import _watch_parent


def test_a_worker_whose_parent_is_gone_is_told_to_stop_and_one_whose_parent_lives_is_not() -> None:
    gone = SimpleNamespace(should_exit=False)
    asyncio.run(asyncio.wait_for(_watch_parent(gone, parent=os.getppid() + 1_000_000), 5))
    assert gone.should_exit

    alive = SimpleNamespace(should_exit=False)

    async def watch_a_while() -> None:
        task = asyncio.create_task(_watch_parent(alive, parent=os.getppid()))
        await asyncio.sleep(0.5)
        assert not task.done() and not alive.should_exit
        alive.should_exit = True  # uvicorn stopping for another reason ends the watch too
        await asyncio.wait_for(task, 5)

    asyncio.run(watch_a_while())
