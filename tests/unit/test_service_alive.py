"""A ready service touches its ready file from its event loop, so a liveness probe (infra/terraform: older than
60 s restarts the pod) tells a wedged loop from a live one."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from keel.infra import service
from keel.infra.config import load_settings


def _run(wedged: bool, ready_file: Path, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    monkeypatch.setattr(service, "ALIVE_INTERVAL_S", 0.05)
    monkeypatch.setenv(service.READY_FILE_ENV, str(ready_file))
    seen: list[float] = []

    ready_file.write_text("stale: a previous process's\n")

    async def serve(_settings: object, _nats: str, _db: str, _stop: asyncio.Event, on_ready: Callable[[], None]) -> None:
        assert not ready_file.exists(), "not ready before on_ready, whatever a previous process left"
        on_ready()
        os.utime(ready_file, (0, 0))  # as if long ago: only a touch moves it
        for _ in range(6):
            if wedged:
                time.sleep(0.1)  # a synchronous call blocks the loop: no touch can run
            else:
                await asyncio.sleep(0.1)
            seen.append(ready_file.stat().st_mtime)

    service.run_service(serve, load_settings(environ={}), "nats://unused", "")
    return seen


def test_a_live_loop_keeps_touching_its_ready_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _run(False, tmp_path / "alive", monkeypatch)
    assert seen[-1] > time.time() - 5 and len(set(seen)) > 1


def test_a_wedged_loop_stops_touching_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _run(True, tmp_path / "alive", monkeypatch)
    assert seen == [0] * 6
