"""docker-compose.yml, for real: Keel's images are built here (``infra/images/build.sh --local-base``: a Debian
bookworm made with debootstrap, the control plane without torch, the node agent with it, NATS and PostgreSQL of
their own since Docker Hub cannot be reached), and the compose file is brought up with podman (runc, a bridge
network, named volumes, file secrets: ``tests/compose_podman.py``). Every service ``keel up`` starts runs in its
container, as its own NATS identity and PostgreSQL role, over TLS.

Then a job runs against it as it would on two machines: each node a container of the agent image, its NATS
identity and shard-store certificate issued by ``keel-credentials issue-agent`` in a one-shot container of the
control-plane image (the NATS server reloads to learn them), ``keel run`` with two ranks per node. A rank
crashes; the containerised controller restarts the ranks from the in-memory checkpoints, the job finishes
bitwise equal to an uninterrupted run, and ``keel replay --verify`` on the host is clean against the
containerised store (as the auditor role, through the loopback-published port). The API, in its container,
lists the incident as recovered to a token made with ``keel-api --new-token`` and refuses a request without one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.cluster.local import FaultSpec, NodeInfo, apply_fault, seed_overlay_root
from keel.events.envelope import Event
from keel.infra.embedded import free_port
from keel.infra.store import EventStore, create_engine
from tests.compose_podman import ComposeProject
from tests.scenarios.test_checkpoint_resume import TRAIN, assert_equal_to_reference, reference_run
from tests.scenarios.test_ladder import Stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]  # the images build first: minutes

REPO = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = REPO / "infra/images/podman-containers.conf"
PODMAN_ENV = {"CONTAINERS_CONF": str(CONTAINERS_CONF)}
JOB = "composejob"
NODES = ["node-0", "node-1"]
SERVICES = ["recorder", "controller", "checkpoint-broker", "actuator", "analyzer", "hot-update", "notifier"]
UID = 10001
"""The images' user: a folder the node containers write must be theirs."""


def podman(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s,
                            env={**os.environ, **PODMAN_ENV})
    assert result.returncode == 0, f"podman {' '.join(args)}: {result.stderr[-2000:]}"
    return result


@pytest.fixture(scope="module")
def images() -> None:
    if os.geteuid() != 0:
        print("SKIPPED: podman runs rootful containers here, as root only")
        pytest.skip("podman runs rootful containers here, as root only")  # CI runs as root
    started = time.monotonic()
    built = subprocess.run([str(REPO / "infra/images/build.sh"), "--local-base"], capture_output=True, text=True,
                           timeout=1200, env={**os.environ, **PODMAN_ENV, "PYTHON": sys.executable})
    assert built.returncode == 0, built.stderr[-4000:]
    print(f"images built in {time.monotonic() - started:.0f} s")
    size = podman("image", "inspect", "--format", "{{.Size}}", "keel:local").stdout.strip()
    # The control-plane image carries no torch (the agent's does): torch alone is larger than 500 MB installed.
    assert podman("run", "--rm", "keel:local", "python3", "-c",
                  "import importlib.util as u; print(u.find_spec('torch') is None)").stdout.strip() == "True"
    print(f"keel:local is {int(size) / 1e6:.0f} MB")


@pytest.fixture
def project(images: None, scratch_dir: Path) -> Iterator[ComposeProject]:
    secrets = scratch_dir / "secrets"
    subprocess.run(["sh", str(REPO / "infra/postgres/make-secrets.sh"), str(secrets / "postgres")], check=True,
                   capture_output=True)
    # A read token for the API, made as docker-compose.yml says (keel-api --new-token in the image): the token to
    # the caller, its entry (name, scope, SHA-256) into KEEL_API__TOKENS.
    token, entry = podman("run", "--rm", "--network", "none", "keel:local", "keel-api", "--new-token",
                          "compose-test").stdout.strip().splitlines()
    (scratch_dir / "api.token").write_text(token)
    variables = {"KEEL_IMAGE": "keel:local", "KEEL_NATS_IMAGE": "keel-nats:local",
                 "KEEL_POSTGRES_IMAGE": "keel-postgres:local", "KEEL_SECRETS_DIR": str(secrets),
                 "KEEL_NATS_PORT": str(free_port()), "KEEL_NATS_MONITOR_PORT": str(free_port()),
                 "KEEL_POSTGRES_PORT": str(free_port()), "KEEL_BUS__MAX_BYTES": "256MiB",
                 "KEEL_API_PORT": str(free_port()), "KEEL_API__TOKENS": f"[{entry}]"}
    compose = ComposeProject(REPO / "docker-compose.yml", f"keel{uuid.uuid4().hex[:6]}", variables, PODMAN_ENV)
    try:
        yield compose
    finally:
        for name in [*compose.spec["services"], *NODES]:
            log = compose.logs(name, tail=400)
            (scratch_dir / f"{name}.container.log").write_text(log)
        compose.down()


class ComposeJob:
    """The job's side: events read from the containerised store, its nodes as containers."""

    def __init__(self, compose: ComposeProject, scratch: Path) -> None:
        self.compose, self.scratch = compose, scratch
        password = (scratch / "secrets/postgres/auditor.password").read_text().strip()
        port = compose.variables["KEEL_POSTGRES_PORT"]
        self.database_url = f"postgresql://keel_auditor@127.0.0.1:{port}/keel"
        self.engine = create_engine(f"postgresql://keel_auditor:{password}@127.0.0.1:{port}/keel")
        self.store = EventStore(self.engine)

    async def events(self, types: list[str] | None = None) -> list[Event]:
        return [r.event async for r in self.store.read(job_id=JOB, types=types)]

    wait_for = Stack.wait_for  # it reads only ``events`` and ``scratch``

    def node_dir(self, node: str) -> Path:
        return self.scratch / "nodes" / node

    def issue_agent(self, node: str) -> None:
        """What an operator runs once per node: the agent's NATS identity and shard-store certificate, exported
        into the node's credentials volume by the control-plane image; the NATS server then reloads its
        authorization (SIGHUP)."""
        c = self.compose
        env = [arg for key, value in c.spec["x-keel-environment"].items() for arg in ("-e", f"{key}={value}")]
        podman("volume", "create", c.volume(f"agent-{node}"))
        podman("run", "--rm", "--network", "none", *env,
               "-v", f"{c.volume('keel-credentials')}:/var/lib/keel/credentials",
               "-v", f"{c.volume('nats-credentials')}:/var/lib/keel/export/nats",
               "-v", f"{c.volume(f'agent-{node}')}:/var/lib/keel/export/agent",
               "keel:local", "keel-credentials", "issue-agent", "--job", JOB, "--node", node,
               "--export", "/var/lib/keel/export/agent", "--store-host", node,
               "--export-server", "/var/lib/keel/export/nats")

    def start_node(self, node: str, rank: int, train: list[str]) -> None:
        """One machine of the job: the agent image's ``keel run``, two ranks, on the compose network."""
        c = self.compose
        folder = self.node_dir(node)
        seed_overlay_root(folder / "root", gpus=2)
        shutil.chown(folder.parent, UID)
        for path in [folder, *folder.rglob("*")]:
            os.chown(path, UID, 0)
        podman("run", "-d", "--name", c.container(node), "--network", c.network, "--network-alias", node,
               "--shm-size", "1g",
               "-v", f"{c.volume(f'agent-{node}')}:/var/lib/keel/credentials",
               "-v", f"{c.volume('checkpoints')}:/var/lib/keel/checkpoints",
               "-v", f"{folder}:/var/lib/keel/node", "-v", f"{self.scratch / 'out'}:/var/lib/keel/out",
               "-e", "KEEL_NATS_URL=tls://nats:4222", "-e", "KEEL_CREDENTIALS_DIR=/var/lib/keel/credentials",
               "-e", "OMP_NUM_THREADS=1",
               "keel-agent:local", "keel", "run", "--nnodes", str(len(NODES)), "--node-rank", str(rank),
               "--nproc-per-node", "2", "--master-addr", NODES[0], "--master-port", "29500",
               "--keel-job-id", JOB, "--keel-node-id", node, "--keel-fault-domain", f"domain-{node}",
               "--keel-agent-dir", "/var/lib/keel/node", "--keel-root", "/var/lib/keel/node/root",
               "--keel-ckpt-dir", "/dev/shm/keel", "--keel-heartbeat-interval", "2s",
               "--keel-store-address", "0.0.0.0:29600", "--keel-store-advertise", node,
               "--keel-tls-cert", "/var/lib/keel/credentials/store/cert.pem",
               "--keel-tls-key", "/var/lib/keel/credentials/store/key.pem",
               "--keel-tls-ca", "/var/lib/keel/credentials/store/ca.pem",
               "--keel-persist-root", "/var/lib/keel/checkpoints", "--keel-fault-injection", *train)

    def operator_credentials(self) -> Path:
        """The operator's bundle copied out of the credentials container, as docker-compose.yml's header says:
        the signing keyring ``keel replay --verify`` checks every recorded signature against."""
        folder = self.scratch / "keel-operator"
        folder.mkdir(mode=0o700)
        podman("cp", f"{self.compose.container('credentials')}:/var/lib/keel/export/operator/.", str(folder))
        assert (folder / "signing/keyring.json").is_file(), sorted(str(p) for p in folder.rglob("*"))
        return folder

    def replay_verify(self) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KEEL_DATABASE_URL": self.database_url, "KEEL_HOME": str(self.scratch / "cli"),
               "KEEL_CREDENTIALS_DIR": str(self.operator_credentials()),
               "KEEL_DATABASE_PASSWORD_FILE": str(self.scratch / "secrets/postgres/auditor.password"),
               "KEEL_DB_SCHEMA": "public"}
        env["KEEL_NATS_URL"] = f"tls://127.0.0.1:{self.compose.variables['KEEL_NATS_PORT']}"  # named, never dialled
        services = [arg for name in ("controller", "checkpoint-broker", "analyzer", "hot-update")
                    for arg in ("--service", name)]
        return subprocess.run([sys.executable, "-m", "keel.cli.main", "replay", "--job", JOB, "--verify", *services],
                              env=env, capture_output=True, text=True, timeout=300)


def api_get(url: str, token: str | None, timeout_s: float = 60) -> dict:
    """GET ``url`` as JSON with ``token`` as the bearer (None: none); the API may still be starting (its
    container starts with the others, and nothing waits for it): connection failures are retried until
    ``timeout_s``, HTTP errors are raised."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


async def test_compose_runs_the_whole_control_plane_in_containers_and_a_job_recovers_a_crash_bitwise(
        project: ComposeProject, scratch_dir: Path) -> None:
    reference = asyncio.create_task(asyncio.to_thread(reference_run, scratch_dir / "reference"))
    started = time.monotonic()
    await asyncio.to_thread(project.up)
    # Every service keel up starts, each in its container, consuming live.
    for service in SERVICES:
        deadline = time.monotonic() + 60
        while "consuming live" not in (log := project.logs(service)):
            assert time.monotonic() < deadline, f"{service} not consuming:\n{log}"
            await asyncio.sleep(0.5)
    print(f"control plane up in {time.monotonic() - started:.1f} s")

    job = ComposeJob(project, scratch_dir)
    (scratch_dir / "out").mkdir()
    os.chown(scratch_dir / "out", UID, 0)
    for node in NODES:
        await asyncio.to_thread(job.issue_agent, node)
    podman("kill", "--signal", "HUP", project.container("nats"))
    train = [*TRAIN, "--save-final", "/var/lib/keel/out/final"]
    for rank, node in enumerate(NODES):
        job.node_dir(node).mkdir(parents=True)
        await asyncio.to_thread(job.start_node, node, rank, train)

    await job.wait_for(["NodeHeartbeat"], lambda e: e.payload.last_step >= 8, 240, "a heartbeat past step 8")
    await job.wait_for(["CheckpointStepCommitted"], lambda e: e.payload.tier == "peer" and e.payload.step >= 5,
                       120, "a peer-tier commit past step 5")

    # Rank 2 (node-1's first) crashes: the fault file its rank reads, as `keel inject` writes it.
    seen = {e.id for e in await job.events(["IncidentOpened"])}
    node = NodeInfo("node-1", False, job.node_dir("node-1"), job.node_dir("node-1") / "root", 0)
    apply_fault(node, FaultSpec(kind="crash", node="node-1", rank=2), str(uuid.uuid4()))
    os.chown(node.fault_file, UID, 0)
    opened = await job.wait_for(["IncidentOpened"], lambda e: e.id not in seen, 90, "an incident")
    assert opened.payload.node_id == "node-1", opened.payload
    resolved = await job.wait_for(["IncidentResolved"], lambda e: e.payload.incident_id == str(opened.id), 180,
                                  "the incident's resolution")
    assert resolved.payload.outcome == "recovered", resolved.payload
    # The API in its container answers as `keel incidents` would, behind its token, on the host's loopback.
    api = f"http://127.0.0.1:{project.variables['KEEL_API_PORT']}"
    token = (scratch_dir / "api.token").read_text()
    listed = await asyncio.to_thread(api_get, f"{api}/v1/incidents?job={JOB}", token)
    assert [i["outcome"] for i in listed["incidents"] if i["id"] == str(opened.id)] == ["recovered"], listed
    with pytest.raises(urllib.error.HTTPError) as refused:
        await asyncio.to_thread(api_get, f"{api}/v1/incidents", None)
    assert refused.value.code == 401
    [restart] = [e for e in await job.events(["RestartDecided"]) if e.correlation_id == opened.id]
    assert restart.payload.evict == [], restart.payload  # a crash restarts in place: no machine changes
    plans = [e for e in await job.events(["CheckpointRestorePlanned"])
             if e.payload.generation == restart.payload.generation]
    assert plans and plans[-1].payload.step >= 5, plans  # resumed from a checkpoint, not from the start

    await job.wait_for(["RankExited"], lambda e: e.payload.generation == restart.payload.generation
                       and e.payload.rank == 0 and e.payload.classification == "success", 300, "the end of training")
    await reference
    for rank in range(4):  # assert_equal_to_reference reads <scratch>/final.rank<r>
        final = scratch_dir / "out" / f"final.rank{rank}"
        deadline = time.monotonic() + 60
        while not final.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        shutil.copy(final, scratch_dir / f"final.rank{rank}")
    await assert_equal_to_reference(scratch_dir, list(job.node_dir("node-0").glob("logs/rank0.g*.stdout")))

    # Nothing decides any more once the services stop: the log is complete, and replays to the same decisions.
    for name in [*NODES, *SERVICES, "api"]:
        podman("stop", "-t", "30", project.container(name), timeout_s=120)
    verified = await asyncio.to_thread(job.replay_verify)
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-2000:]
    await job.engine.dispose()
