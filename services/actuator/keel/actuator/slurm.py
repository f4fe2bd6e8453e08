"""The ``slurm`` actuator: nodes are Slurm nodes; Keel's node id is the Slurm node name (``keel run`` under
``srun`` takes ``SLURMD_NODENAME``).

- **Evict**: drain the node (``scontrol update nodename=N state=drain reason="keel: ..."``), so Slurm
  starts nothing new there. The node's agent stops its ranks itself when it sees the eviction (its fence);
  the job's other nodes go on. A node drained already is left as it is: by Keel (a redelivered command does
  nothing twice) or by a human (whose reason Keel never writes over, and whose drain it never undoes:
  this actuator never resumes a node).
- **Standbys**: the nodes of the training job's allocation beyond its workers (``slurm.job_id``,
  ``slurm.workers``: ``keel run`` starts the nodes past ``--nnodes`` as standbys), plus the nodes of the
  standby jobs it submitted (job name ``keel-standby-<job>``; a pending one counts as the nodes it asked
  for, so a refill is never requested twice), less those promoted (in that job), drained or down.
- **Refill**: submit a standby job (``sbatch -J keel-standby-<job> -p <partition> -N <count> --wrap
  <slurm.standby_command>``): Slurm gives it idle nodes of the partition when it has them; each node's
  agent registers and self-checks as a standby, as on any cluster.

What Slurm says is parsed and decided on in ``keel.actuator.slurm_rules`` (pure); this module runs the
commands. Slurm has no compare-and-set: a human who drains a node in the instant between Keel's look and
Keel's drain sees Keel's reason written over theirs (the node stays drained either way).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from keel.actuator.core import ActuatorError
from keel.actuator.slurm_rules import SlurmNode, expand_hostlist, parse_show_node, plan_drain

STANDBY_JOB_PREFIX = "keel-standby-"


class SlurmCommands:
    """Runs Slurm's client commands (``scontrol``, ``squeue``, ``sbatch``) against one cluster: its
    ``slurm.conf`` (``SLURM_CONF``) when given, else Slurm's default. Never through a shell. A command that
    fails or times out raises ``ActuatorError`` with its stderr."""

    def __init__(self, conf: Path | None = None, *, timeout_s: float = 30.0, environ: Mapping[str, str] | None = None) -> None:
        self.conf, self.timeout_s = conf, timeout_s
        self.environ = dict(os.environ if environ is None else environ)
        if conf is not None:
            self.environ["SLURM_CONF"] = str(conf)

    def run(self, argv: Sequence[str], *, cwd: Path | None = None) -> str:
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, timeout=self.timeout_s, env=self.environ,
                                  check=False, cwd=cwd)
        except FileNotFoundError:
            raise ActuatorError(f"{argv[0]} is not installed (Slurm's client commands are needed on the "
                                "actuator's host)") from None
        except subprocess.TimeoutExpired:
            raise ActuatorError(f"{shlex.join(argv)} did not answer within {self.timeout_s:g} s "
                                "(is slurmctld reachable?)") from None
        if done.returncode != 0:
            raise ActuatorError(f"{shlex.join(argv)} failed (exit {done.returncode}): "
                                f"{(done.stderr or done.stdout).strip()[:500]}")
        return done.stdout

    def node(self, name: str) -> SlurmNode | None:
        try:
            text = self.run(["scontrol", "show", "node", "-o", name])
        except ActuatorError as exc:
            if "Invalid node name" in str(exc) or "not found" in str(exc):
                return None
            raise
        nodes = [n for n in parse_show_node(text) if n.name == name]
        return nodes[0] if nodes else None

    def nodes(self) -> dict[str, SlurmNode]:
        return {n.name: n for n in parse_show_node(self.run(["scontrol", "show", "node", "-o"]))}

    def jobs(self, *, job_id: str | None = None, name: str | None = None) -> list[dict[str, Any]]:
        """Jobs as ``{"id", "state", "nodes": count, "nodelist": [names]}`` (running jobs' nodes; none while pending)."""
        argv = ["squeue", "-h", "--me", "-o", "%i|%T|%D|%N"]  # this account's jobs: a name is not unique
        if job_id is not None:
            argv += ["-j", str(job_id)]
        if name is not None:
            argv += ["-n", name]
        try:
            text = self.run(argv)
        except ActuatorError as exc:
            if job_id is not None and "Invalid job id" in str(exc):
                return []  # ended and forgotten
            raise
        found = []
        for line in text.splitlines():
            if not line.strip():
                continue
            ident, state, count, nodelist = (line.split("|") + ["", "", "", ""])[:4]
            try:
                names = expand_hostlist(nodelist) if nodelist and state == "RUNNING" else []
            except ValueError as exc:
                raise ActuatorError(f"squeue printed a node list Keel cannot read: {exc}") from None
            found.append({"id": ident.strip(), "state": state.strip(), "nodes": int(count or 0), "nodelist": names})
        return found


class SlurmActuator:
    name = "slurm"

    def __init__(self, commands: SlurmCommands, *, keel_job_id: str, state_dir: Path, partition: str | None = None,
                 allocation_job_id: str | None = None, workers: int | None = None,
                 standby_command: Sequence[str] = ()) -> None:
        self.commands = commands
        self.keel_job_id = keel_job_id
        self.partition = partition
        self.allocation_job_id = allocation_job_id
        self.workers = workers
        self.standby_command = list(standby_command)
        self.state_dir = Path(state_dir)
        self._lock = threading.Lock()

    # -- bookkeeping (what Slurm does not know: which standbys were promoted) ---------------------------------

    @property
    def _state_file(self) -> Path:
        return self.state_dir / f"slurm-actuator-{self.keel_job_id}.json"

    def _load(self) -> dict[str, Any]:
        try:
            state = json.loads(self._state_file.read_text())
        except FileNotFoundError:
            return {"promoted": [], "evicted": {}}
        except (OSError, ValueError) as exc:
            raise ActuatorError(f"cannot read the Slurm actuator's state {self._state_file}: {exc}") from exc
        if not isinstance(state, dict):
            raise ActuatorError(f"{self._state_file} is not a JSON object")
        state.setdefault("promoted", [])
        state.setdefault("evicted", {})
        return state

    def _save(self, state: dict[str, Any]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self._state_file.with_name(f".{self._state_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
        os.replace(tmp, self._state_file)

    # -- the Actuator protocol ----------------------------------------------------------------------------

    def evict(self, node_id: str, reason: str, incident: str = "") -> str:
        node = self.commands.node(node_id)
        if node is None:
            raise ActuatorError(f"{node_id!r} is not a node of this Slurm cluster (Keel's node id must be the Slurm "
                                "node name: keel run under srun takes SLURMD_NODENAME)")
        plan = plan_drain(node, f"{reason} (incident {incident[:8]})" if incident else reason)
        if plan.action == "drain":
            self.commands.run(["scontrol", "update", f"nodename={node.name}", "state=drain", f"reason={plan.reason}"])
            with self._lock:
                state = self._load()
                state["evicted"][node.name] = plan.reason
                self._save(state)
        return plan.detail

    def _sources(self) -> list[dict[str, Any]]:
        """Where standbys come from: the allocation (its nodes past the workers) and the standby jobs."""
        sources = []
        if self.allocation_job_id and self.workers is not None:
            for job in self.commands.jobs(job_id=self.allocation_job_id):
                if job["state"] == "RUNNING":
                    sources.append({**job, "nodelist": job["nodelist"][self.workers:]})
        sources += [j for j in self.commands.jobs(name=STANDBY_JOB_PREFIX + self.keel_job_id)
                    if j["state"] in ("RUNNING", "PENDING", "CONFIGURING")]
        return sources

    def standbys(self) -> list[str]:
        with self._lock:
            promoted = {tuple(p) for p in self._load()["promoted"] if isinstance(p, list)}
        names: list[str] = []
        pending: list[str] = []
        for job in self._sources():
            if job["state"] == "RUNNING" and job["nodelist"]:
                # A promotion is of a node in one job: the same node in a later standby job is a standby again.
                names += [n for n in job["nodelist"] if (n, job["id"]) not in promoted]
            elif job["state"] != "RUNNING":  # asked for, not yet given: counts, so a refill is not requested twice
                pending += [f"slurm-job-{job['id']}/{i}" for i in range(job["nodes"])]
        candidates = list(dict.fromkeys(names))
        if not candidates:
            return pending
        known = self.commands.nodes()
        return [n for n in candidates if n in known and known[n].usable] + pending

    def mark_promoted(self, node_id: str) -> None:
        jobs = [job["id"] for job in self._sources() if node_id in job["nodelist"]]
        with self._lock:
            state = self._load()
            recorded = [p for p in state["promoted"] if isinstance(p, list)]
            for job_id in jobs:
                if [node_id, job_id] not in recorded:
                    recorded.append([node_id, job_id])
            # Promotions in jobs that ended say nothing any more.
            live = {job["id"] for job in self._sources()}
            state["promoted"] = [p for p in recorded if p[1] in live]
            self._save(state)

    def provision_standbys(self, count: int) -> list[str]:
        if count <= 0:
            return []
        if not self.standby_command:
            raise ActuatorError("no standby command is configured (actuator.slurm.standby_command): Keel cannot "
                                "request standby nodes from Slurm")
        argv = ["sbatch", "--parsable", "-J", STANDBY_JOB_PREFIX + self.keel_job_id, "-N", str(count),
                "--ntasks-per-node=1"]
        if self.partition:
            argv += ["-p", self.partition]
        argv += ["--wrap", shlex.join(self.standby_command)]
        # Submitted from the actuator's own folder: the batch step's output (slurm-<id>.out) lands there on a
        # shared file system, and in the node's /tmp otherwise (Slurm's fallback), never in a random cwd.
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        job_id = self.commands.run(argv, cwd=self.state_dir).strip().split(";")[0]
        if not job_id.isdigit():
            raise ActuatorError(f"sbatch answered {job_id!r}, not a job id")
        return [f"slurm-job-{job_id}/{i}" for i in range(count)]
