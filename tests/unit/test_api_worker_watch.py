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


def test_a_worker_of_an_api_that_is_pid_1_lives_and_one_whose_parent_died_before_it_armed_exits() -> None:
    """In a container the API is PID 1: its worker's parent being PID 1 is no orphan (a compose run caught the API
    killing every worker it forked, over and over). Run as PID 1 of a new PID namespace."""
    import subprocess
    import sys

    probe = (
        "import os\n"
        "from keel.api.main import _die_with_parent\n"
        "assert os.getpid() == 1\n"
        "api = os.getpid()\n"
        "for expected, status in ((api, 0), (api + 12345, 1)):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        _die_with_parent(expected)\n"
        "        os._exit(0)\n"
        "    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == status, (expected, status)\n"
        "print('ok')\n"
    )
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc",
                           sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
