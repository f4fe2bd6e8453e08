"""The one service host (keel.infra.service) with real processes: signals, start-up, configuration errors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_while_waiting_for_an_absent_server_exits_at_once(tmp_path: Path) -> None:
    # Nothing listens on the port: the service is still connecting. A supervisor's SIGTERM (a rolling
    # restart, `keel down`) must end it now, not after the client's reconnect attempts run out.
    env = {**os.environ, "KEEL_NATS_URL": f"nats://127.0.0.1:{_unused_port()}", "KEEL_HOME": str(tmp_path / "home")}
    process = subprocess.Popen([sys.executable, "-m", "keel.actuator.main"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    time.sleep(3)
    assert process.poll() is None, process.stdout.read() if process.stdout else ""
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=20)
    assert time.monotonic() - sent < 5, output
    assert process.returncode == 0, output
    assert "stopped while starting" in output


def test_a_service_without_its_servers_says_which_setting_is_missing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env["KEEL_HOME"] = str(tmp_path / "nohome")
    result = subprocess.run([sys.executable, "-m", "keel.controller.main"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "KEEL_NATS_URL and KEEL_DATABASE_URL" in result.stderr and "Traceback" not in result.stderr
