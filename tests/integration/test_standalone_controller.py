"""The controller's distribution stands alone: installed (not editable) into a fresh virtual environment
with only the libraries it declares, without torch or numpy, its console script ``keel-controller`` runs
against real NATS and PostgreSQL and decides.

This is the layout's promise made executable: a distribution that imported another service, reached out
of its package for migrations, or pulled torch in would fail here.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import venv
from pathlib import Path

import pytest

from keel.events.envelope import Event, decode_event
from keel.events.types import NodeEvictionDecided
from keel.infra.bus import fetch_batch
from tests.factories import T0, health_event
from tests.integration.test_crashes import service_env
from tests.integration.test_replay_cli import registrations

ROOT = Path(__file__).resolve().parents[2]
# The controller and exactly the libraries its pyproject.toml (and theirs) declare.
CONTROLLER_CLOSURE = ["libs/events", "libs/kernel", "libs/rules", "migrations", "libs/infra", "services/controller"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _fresh_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin" / "python"


def _install(python: Path, folders: list[str], scratch: Path, log: Path) -> subprocess.CompletedProcess:
    # From a copy of each folder (without the editable install's metadata or an earlier build), so pip's
    # in-tree build writes nothing into this checkout. One pip call with every folder: each keel-*
    # requirement is satisfied by a folder given here, never by the index (some keel-* names on PyPI
    # belong to unrelated projects).
    copies = []
    for folder in folders:
        copy = scratch / folder
        shutil.copytree(ROOT / folder, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        copies.append(str(copy))
    with open(log, "w") as out:
        return subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *copies],
                              stdout=out, stderr=subprocess.STDOUT, timeout=600)


async def test_the_controller_distribution_installs_alone_and_decides_without_torch(keel_env, tmp_path) -> None:
    python = await asyncio.to_thread(_fresh_venv, tmp_path / "venv")
    installed = await asyncio.to_thread(_install, python, CONTROLLER_CLOSURE, tmp_path / "src", tmp_path / "pip.log")
    assert installed.returncode == 0, (tmp_path / "pip.log").read_text()[-4000:]

    # No torch, no numpy, no other service, and no editable path back into this checkout.
    probe = subprocess.run([str(python), "-c", (
        "import importlib.util, json, keel.controller, keel.infra.store as s;"
        "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in "
        "['torch', 'numpy', 'keel.agent', 'keel.analyzer', 'keel.cli', 'keel.sdk']}));"
        "print(keel.controller.__file__); print(s.MIGRATIONS_DIR)")], capture_output=True, text=True, timeout=60,
        cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    found, controller_file, migrations_dir = probe.stdout.strip().splitlines()
    assert found == '{"torch": false, "numpy": false, "keel.agent": false, "keel.analyzer": false, "keel.cli": false, "keel.sdk": false}'
    assert "site-packages" in controller_file and str(ROOT) not in controller_file
    assert "site-packages" in migrations_dir and (Path(migrations_dir) / "versions").is_dir()

    # Run the console script against this test's servers, prefix and schema.
    ready = tmp_path / "controller.ready"
    env = {**service_env(keel_env.settings), "KEEL_SERVICE_READY_FILE": str(ready), "KEEL_HOME": str(tmp_path / "home")}
    env.pop("PYTHONPATH", None)
    log_path = tmp_path / "controller.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([str(python.parent / "keel-controller")], env=env, stdout=log_file,
                                   stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        for _ in range(600):
            if ready.exists() or process.poll() is not None:
                break
            await asyncio.sleep(0.1)
        assert ready.exists(), f"keel-controller never became ready (exit {process.poll()}):\n{log_path.read_text()[-3000:]}"

        # A fatal GPU fault on a registered node: rung 1 evicts it.
        prefix = keel_env.settings.bus.subject_prefix
        sub = await keel_env.bus.pull_consumer("standalone-observer", filter_subject=f"{prefix}.job1.>")
        fault = health_event("n2", status="failed", fatal=True, confidence="high", component="gpu", detail="XID 79", at=T0)
        await keel_env.bus.publish_many([*registrations(), fault])
        decisions: list[Event] = []
        for _ in range(150):
            for msg in await fetch_batch(sub, 256, 0.1):
                event = decode_event(msg.data, max_bytes=keel_env.settings.bus.max_event_bytes)
                await msg.ack()
                if isinstance(event.payload, NodeEvictionDecided):
                    decisions.append(event)
            if decisions:
                break
        assert decisions, f"no eviction decided:\n{log_path.read_text()[-3000:]}"
        [decision] = decisions
        assert decision.producer == "controller" and decision.payload.node_id == "n2"
        assert decision.causation_id == fault.id and "rung 1" in decision.payload.reason
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(process.wait, 30)
            except subprocess.TimeoutExpired:
                process.kill()
    assert process.returncode == 0, log_path.read_text()[-3000:]


def test_the_closure_above_is_what_the_pyprojects_declare() -> None:
    """CONTROLLER_CLOSURE is the transitive keel-* closure of keel-controller's declared dependencies."""
    import tomllib

    folders = {tomllib.loads((ROOT / f / "pyproject.toml").read_text())["project"]["name"]: f
               for f in [*map(str, (p.relative_to(ROOT) for p in ROOT.glob("libs/*"))),
                         *map(str, (p.relative_to(ROOT) for p in ROOT.glob("services/*"))), "migrations"]
               if (ROOT / f / "pyproject.toml").exists()}
    closure, todo = set(), ["keel-controller"]
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        deps = tomllib.loads((ROOT / folders[name] / "pyproject.toml").read_text())["project"]["dependencies"]
        todo += [d.split("==")[0] for d in deps if d.startswith("keel-")]
    assert sorted(folders[n] for n in closure) == sorted(CONTROLLER_CLOSURE)
