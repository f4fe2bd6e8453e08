"""`keel run` against torch 2.13's own torchrun (``python -m torch.distributed.run``), flag set by flag set.

Each case launches ``tests/fixtures/torchrun_probe.py`` under both launchers with the same torchrun flags
and the same parent environment (no NATS: ``keel run`` is unsupervised, torchrun-like) and compares
what the ranks saw (their environment, ranks, world sizes, a gloo group's view), their exit codes and
the launcher's, the restart counts, the log files under ``--log-dir`` (names and contents) and the
probe's lines on each console stream (``[default0]:`` prefixes included). Every difference must be on
``ALLOWED_DIFFERENCES``, which mirrors the list in docs/torchrun.md; each entry must be documented
there and seen here (a stale entry fails too). Keel's own variables are ``KEEL_*`` and not compared.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "fixtures" / "torchrun_probe.py"
DOC = ROOT / "docs" / "torchrun.md"

ALLOWED_DIFFERENCES = {
    "TORCHELASTIC_USE_AGENT_STORE": "torchrun's agent hosts the ranks' TCPStore (True); under Keel rank 0 "
                                    "hosts it (False)",
    "MASTER_ADDR": "a local rendezvous (--standalone, or one node without a master port): torchrun says "
                   "localhost, Keel 127.0.0.1",
    "MASTER_PORT": "after a restart Keel's ranks rendezvous on master port + restart count (a fence against "
                   "stale store keys and stale ranks); torchrun keeps one port",
    "TORCHELASTIC_ERROR_FILE": "without --log-dir, torchrun's run folder is under a fresh /tmp/torchelastic_*, "
                               "Keel's under <agent dir>/logs; the layout below it is the same",
}
LOCAL_RENDEZVOUS = "local rendezvous"
RESTART_PORT = "restart port"
DEFAULT_LOG_BASE = "default log base"


@dataclass(frozen=True)
class Case:
    name: str
    flags: tuple[str, ...]
    """torchrun flags; ``{log_dir}`` and ``{port}`` are filled per launch."""
    probe_args: tuple[str, ...] = ()
    mode: str = "script"
    """How the probe is named: ``script`` (probe.py), ``no-python`` (the interpreter, then probe.py),
    ``run-path`` (probe.py with --run-path)."""
    env: dict[str, str] = field(default_factory=dict)
    keel_flags: tuple[str, ...] = ("--keel-no-checkpoint",)
    """Keel's own flags (the default checkpointing where a case keeps it)."""


CASES = [
    Case("standalone", ("--standalone", "--nproc-per-node", "2"), ("--gloo",), keel_flags=()),
    Case("redirects", ("--standalone", "--redirects", "3", "--log-dir", "{log_dir}"),
         env={"PET_NPROC_PER_NODE": "2"}),
    Case("tee", ("--standalone", "--nproc-per-node", "2", "--tee", "3", "--log-dir", "{log_dir}")),
    Case("local-ranks-filter", ("--standalone", "--nproc-per-node", "2", "-t", "0:3", "--local-ranks-filter", "1",
                                "--log-dir", "{log_dir}")),
    Case("restart", ("--standalone", "--nproc-per-node", "2", "--max-restarts", "1"),
         ("--fail-rank", "1", "--fail-attempt", "0", "--exit-code", "3"), keel_flags=()),
    Case("failure-no-python", ("--nproc-per-node", "1", "--max_restarts", "0", "--role", "trainer", "--no-python"),
         ("--fail-rank", "0", "--exit-code", "7"), mode="no-python"),
    Case("run-path", ("--nproc-per-node", "1", "--run-path"), mode="run-path"),
    Case("static", ("--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "{port}",
                    "--nproc-per-node", "2", "--rdzv-id", "compat")),
]


@dataclass
class Launch:
    rc: int
    stdout: str
    stderr: str
    records: dict[tuple[int, int], dict]
    """(attempt, rank) -> what the probe recorded."""
    logs: dict[str, str]
    """Files under --log-dir, by path relative to it with the run folder's random suffix removed."""
    log_dir: Path
    port: int
    work: Path
    wall_s: float


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def parent_env(home: Path) -> dict[str, str]:
    """The environment both launchers start from: no Keel settings, no torchrun defaults, no NATS."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KEEL_", "PET_", "TORCHELASTIC_")) and k != "OMP_NUM_THREADS"}
    env["KEEL_HOME"] = str(home)  # a Keel home without `keel up`: no NATS, so `keel run` is unsupervised
    env["KEEL_WARM_PRELOAD"] = "json"  # the zygote still forks the ranks, without importing torch first
    return env


def launch(launcher: str, case: Case, root: Path) -> Launch:
    work = root / case.name / launcher
    out, log_dir, port = work / "out", work / "logs", free_port()
    work.mkdir(parents=True)
    flags = [f.format(log_dir=log_dir, port=port) for f in case.flags]
    target = {"script": [str(PROBE)], "run-path": [str(PROBE)], "no-python": [sys.executable, str(PROBE)]}[case.mode]
    program = [*target, "--out", str(out), *case.probe_args]
    if launcher == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *flags, *program]
    else:
        argv = [sys.executable, "-m", "keel.cli.main", "run", *flags, "--keel-agent-dir", str(work / "agent"),
                *case.keel_flags, *program]
    env = {**parent_env(root / "home"), **case.env}
    started = time.monotonic()
    done = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=120)
    records = {}
    for path in out.glob("attempt*-rank*.json"):
        attempt, rank = map(int, re.findall(r"\d+", path.stem))
        records[(attempt, rank)] = json.loads(path.read_text())
    run_id = next(iter(records.values()))["env"]["TORCHELASTIC_RUN_ID"] if records else "?"
    logs = {}
    if log_dir.exists():
        for path in sorted(p for p in log_dir.rglob("*") if p.is_file()):
            run_dir, _, below = path.relative_to(log_dir).as_posix().partition("/")
            # torchrun's run folder is <run id>_<random>: the run id varies with --standalone, the rest always.
            logs[f"<run id>_*/{below}" if run_dir.startswith(f"{run_id}_") else f"{run_dir}/{below}"] = path.read_text()
    return Launch(done.returncode, done.stdout, done.stderr, records, logs, log_dir, port, work,
                  time.monotonic() - started)


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Launch]]:
    root = tmp_path_factory.mktemp("torchrun-compat")
    jobs = [(launcher, case) for case in CASES for launcher in ("torchrun", "keel")]
    with ThreadPoolExecutor(max_workers=2) as pool:  # a torchrun launch mostly waits (rendezvous polls)
        results = list(pool.map(lambda job: launch(job[0], job[1], root), jobs))
    table: dict[str, dict[str, Launch]] = {}
    for (launcher, case), result in zip(jobs, results, strict=True):
        table.setdefault(case.name, {})[launcher] = result
    print("launch wall times:", ", ".join(f"{c}/{name} {launch.wall_s:.1f}s" for c, row in table.items()
                                          for name, launch in row.items()))
    return table


def console_lines(text: str) -> list[str]:
    """The probe's lines on one console stream, with any ``[<role><n>]:`` prefix, sorted."""
    return sorted(line for line in text.splitlines() if re.match(r"^(\[[a-z]+\d+\]:)?PROBE-", line))


def rank_env(record: dict, parent: dict[str, str]) -> dict[str, str]:
    """What the launcher changed of the rank's environment, Keel's ``KEEL_*`` left out."""
    env = record["env"]
    changed = {k: v for k, v in env.items() if parent.get(k) != v and not k.startswith("KEEL_")}
    changed.update({k: "<removed>" for k in parent if k not in env and not k.startswith("KEEL_")})
    return changed


def normalise(env: dict[str, str], launch: Launch, case: Case, attempt: int, base_port: str | None) -> dict[str, tuple]:
    """Values that are per run by design (a fresh uuid, a free port, a random folder) become their shape."""
    shaped: dict[str, tuple] = {k: ("=", v) for k, v in env.items()}
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", run_id):
        shaped["TORCHELASTIC_RUN_ID"] = ("uuid",)
    if "{port}" in case.flags:
        assert env["MASTER_PORT"] == str(launch.port), "the given --master-port"
        shaped["MASTER_PORT"] = ("given port",)
    elif base_port is not None:
        shaped["MASTER_PORT"] = ("free port",) if env["MASTER_PORT"] == base_port else \
            (RESTART_PORT, int(env["MASTER_PORT"]) - int(base_port))
    if env.get("MASTER_ADDR") in ("localhost", "127.0.0.1") and "--master-addr" not in case.flags:
        shaped["MASTER_ADDR"] = (LOCAL_RENDEZVOUS, env["MASTER_ADDR"])
    error_file = Path(env["TORCHELASTIC_ERROR_FILE"])
    run_dir = error_file.parents[2]
    assert run_dir.name.startswith(f"{run_id}_"), f"the run folder is <run id>_*: {error_file}"
    base = "--log-dir" if run_dir.parent == launch.log_dir else (DEFAULT_LOG_BASE, str(run_dir.parent))
    shaped["TORCHELASTIC_ERROR_FILE"] = (base, *error_file.parts[-3:])
    return shaped


def allowed(name: str, torchrun: tuple | None, keel: tuple | None) -> bool:
    """Whether a difference in ``name`` is the documented one, exactly."""
    if torchrun is None or keel is None:
        return False
    if name == "TORCHELASTIC_USE_AGENT_STORE":
        return torchrun == ("=", "True") and keel == ("=", "False")
    if name == "MASTER_ADDR":
        return torchrun == (LOCAL_RENDEZVOUS, "localhost") and keel == (LOCAL_RENDEZVOUS, "127.0.0.1")
    if name == "MASTER_PORT":
        return torchrun == ("free port",) and keel[0] == RESTART_PORT and keel[1] > 0
    if name == "TORCHELASTIC_ERROR_FILE":
        return (torchrun[0][0] == keel[0][0] == DEFAULT_LOG_BASE and Path(torchrun[0][1]).name.startswith("torchelastic_")
                and keel[0][1].endswith("/agent/logs") and torchrun[1:] == keel[1:])
    return False


def env_differences(case: Case, torchrun: Launch, keel: Launch) -> tuple[list[str], set[str]]:
    """The ranks' environment variables that differ: (those not allowed, the allowed ones met)."""
    parent = {**parent_env(Path("/unused")), **case.env}
    shaped: dict[str, dict[tuple[int, int], dict[str, tuple]]] = {}
    for name, launch in (("torchrun", torchrun), ("keel", keel)):
        # A local rendezvous (no --master-port on one node): a free port, rank 0's of attempt 0 the base.
        local = "{port}" not in case.flags
        base = launch.records.get((0, 0), {}).get("env", {}).get("MASTER_PORT") if local else None
        shaped[name] = {key: normalise(rank_env(record, parent), launch, case, key[0], base)
                        for key, record in launch.records.items()}
    problems, seen = [], set()
    for key, theirs in shaped["torchrun"].items():
        ours = shaped["keel"].get(key, {})
        for name in sorted(set(ours) | set(theirs)):
            if ours.get(name) == theirs.get(name):
                continue
            if allowed(name, theirs.get(name), ours.get(name)):
                seen.add(name)
            else:
                problems.append(f"{key}: {name}: torchrun {theirs.get(name)} keel {ours.get(name)}")
    return problems, seen


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_keel_run_gives_the_ranks_what_torchrun_gives_them(case: Case, launches: dict[str, dict[str, Launch]]) -> None:
    torchrun, keel = launches[case.name]["torchrun"], launches[case.name]["keel"]
    context = f"\n--- torchrun stderr:\n{torchrun.stderr[-3000:]}\n--- keel stderr:\n{keel.stderr[-3000:]}"
    assert torchrun.records, f"torchrun's ranks recorded nothing{context}"
    # Who ran, how often, with what exit codes; and how each launcher ended.
    assert sorted(keel.records) == sorted(torchrun.records), context
    assert keel.rc == torchrun.rc, context
    for key in torchrun.records:
        assert keel.records[key]["exit_code"] == torchrun.records[key]["exit_code"]
        if "gloo" in torchrun.records[key]:
            assert keel.records[key]["gloo"] == torchrun.records[key]["gloo"]
            assert keel.records[key]["gloo"]["rank"] == int(keel.records[key]["env"]["RANK"])
    # The environment, variable by variable.
    problems, _ = env_differences(case, torchrun, keel)
    assert not problems, "\n".join(problems) + context
    # The output: each console stream's probe lines (prefixes included), and the log files.
    assert console_lines(keel.stdout) == console_lines(torchrun.stdout), context
    assert console_lines(keel.stderr) == console_lines(torchrun.stderr), context
    assert keel.logs == torchrun.logs, context


def test_the_allowed_differences_are_documented_and_each_one_occurs(launches: dict[str, dict[str, Launch]]) -> None:
    text = DOC.read_text()
    for name in ALLOWED_DIFFERENCES:
        assert f"`{name}`" in text, f"docs/torchrun.md does not list the difference in {name}"
    seen: set[str] = set()
    for case in CASES:
        seen |= env_differences(case, launches[case.name]["torchrun"], launches[case.name]["keel"])[1]
    assert seen == set(ALLOWED_DIFFERENCES), f"allowed but not seen (stale?): {set(ALLOWED_DIFFERENCES) - seen}"
