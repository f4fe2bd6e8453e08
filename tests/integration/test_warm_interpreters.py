"""The warm zygote with real processes: a launch behaves like ``python ARGV`` (argv, environment,
stdout and stderr, exit code, tracebacks, fresh random seeds), bad launches are rejected with a reason
and leave the zygote serving, and the supervisor forks ranks from it, keeps each rank's stderr tail,
and starts fresh interpreters when the zygote is gone."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from keel.agent.launch_spec import LaunchSpec
from keel.agent.supervisor import RankSupervisor
from keel.agent.warm import Zygote, ZygoteError

pytestmark = pytest.mark.integration

SCRIPT = """\
import os, random, sys
print("argv", sys.argv[1:], "name", __name__, "env", os.environ.get("WARM_TEST"), "torch" in sys.modules, flush=True)
print("random", random.random(), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if os.environ.get("WARM_FAIL"):
    raise ValueError("boom from the script")
if os.environ.get("WARM_SLEEP"):
    import time
    time.sleep(float(os.environ["WARM_SLEEP"]))
sys.exit(int(os.environ.get("WARM_CODE", "0")))
"""


def _ready(zygote: Zygote, timeout_s: float = 60.0) -> Zygote:
    deadline = time.monotonic() + timeout_s
    while not zygote.ready():
        assert zygote.alive(), f"the zygote exited with {zygote.popen.returncode}"
        assert time.monotonic() < deadline, "the zygote was not ready in time"
        time.sleep(0.05)
    return zygote


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path), **extra}


@pytest.fixture
def zygote(scratch_dir: Path):  # type: ignore[no-untyped-def]
    started = Zygote.start({**os.environ, "KEEL_WARM_PRELOAD": "torch"}, scratch_dir / "z.ready",
                           stderr_log=scratch_dir / "z.stderr")
    try:
        yield _ready(started)
    finally:
        started.close()


def test_launches_run_scripts_and_modules_as_python_would(zygote: Zygote, scratch_dir: Path) -> None:
    script = scratch_dir / "prog.py"
    script.write_text(SCRIPT)
    first = zygote.launch("a", [str(script), "a", "--b"], _env(WARM_TEST="yes", WARM_CODE="7"),
                          stdout=scratch_dir / "a.out", stderr=scratch_dir / "a.err")
    assert first.wait(30) == 7 and first.returncode == 7
    out = (scratch_dir / "a.out").read_text().splitlines()
    assert out[0] == "argv ['a', '--b'] name __main__ env yes True"  # torch came preloaded
    assert "to stderr" in (scratch_dir / "a.err").read_text()

    package = scratch_dir / "pkg_warm_test"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "prog.py").write_text(SCRIPT)
    second = zygote.launch("b", ["-m", "pkg_warm_test.prog", "x"], _env(WARM_FAIL="1"), stdout=scratch_dir / "b.out",
                           stderr=scratch_dir / "b.err", cwd=str(scratch_dir))
    assert second.wait(30) == 1
    assert (scratch_dir / "b.out").read_text().startswith("argv ['x'] name __main__ env None True")
    err = (scratch_dir / "b.err").read_text()
    assert "Traceback (most recent call last)" in err and "ValueError: boom from the script" in err
    # Each child is seeded afresh, as a new interpreter would be, not with the zygote's state.
    assert out[1] != (scratch_dir / "b.out").read_text().splitlines()[1]


def test_a_child_runs_in_its_own_session_and_its_signal_is_its_returncode(zygote: Zygote, scratch_dir: Path) -> None:
    script = scratch_dir / "prog.py"
    script.write_text(SCRIPT)
    child = zygote.launch("s", [str(script)], _env(WARM_SLEEP="60"), stdout=scratch_dir / "s.out",
                          stderr=scratch_dir / "s.err")
    assert child.poll() is None
    assert os.getpgid(child.pid) == child.pid != os.getpgid(zygote.pid)
    os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM


@pytest.mark.parametrize("argv, env, stdout, reason", [
    ([], {}, "out", "'argv' must be a non-empty list"),
    (["x.py"], {"A": 1}, "out", "'env' must be an object of strings"),
    (["x.py"], {}, "/nonexistent-dir/out", "cannot set up the launch"),
])
def test_a_bad_launch_is_rejected_and_the_zygote_keeps_serving(zygote: Zygote, scratch_dir: Path, argv: list,
                                                                env: dict, stdout: str, reason: str) -> None:
    target = stdout if stdout.startswith("/") else str(scratch_dir / stdout)
    with pytest.raises(ZygoteError, match="rejected the launch"):
        zygote.launch("bad", argv, env, stdout=Path(target), stderr=scratch_dir / "bad.err")
    assert reason in (scratch_dir / "z.stderr").read_text()
    script = scratch_dir / "prog.py"
    script.write_text(SCRIPT)
    assert zygote.launch("good", [str(script)], _env(), stdout=scratch_dir / "g.out",
                         stderr=scratch_dir / "g.err").wait(30) == 0


def test_a_zygote_whose_agent_is_gone_exits_and_its_children_live_on(scratch_dir: Path) -> None:
    zygote = _ready(Zygote.start({**os.environ, "KEEL_WARM_PRELOAD": ""}, scratch_dir / "z.ready",
                                 stderr_log=scratch_dir / "z.stderr"))
    script = scratch_dir / "prog.py"
    script.write_text(SCRIPT)
    child = zygote.launch("c", [str(script)], _env(WARM_SLEEP="2"), stdout=scratch_dir / "c.out",
                          stderr=scratch_dir / "c.err")
    assert zygote.popen.stdin is not None
    zygote.popen.stdin.close()  # as when the agent dies
    assert zygote.popen.wait(30) == 0
    assert child.poll() is None, "the child must outlive its zygote"
    assert child.wait(30) == -signal.SIGKILL  # its status is unknown once nobody can report it
    with pytest.raises(ZygoteError, match="exited"):
        zygote.launch("d", [str(script)], _env(), stdout=scratch_dir / "d.out", stderr=scratch_dir / "d.err")
    zygote.close()


def _spec(scratch_dir: Path, script: Path, nproc: int = 2) -> LaunchSpec:
    return LaunchSpec(nnodes=1, nproc_per_node=nproc, node_rank=0, master_addr="127.0.0.1", master_port=29999,
                      command=(str(script),), job_id="warm", node_id="n0", agent_dir=scratch_dir / "agent")


def _wait_exits(supervisor: RankSupervisor, count: int, timeout_s: float = 60.0) -> list:  # type: ignore[type-arg]
    exits = []
    deadline = time.monotonic() + timeout_s
    while len(exits) < count:
        assert time.monotonic() < deadline, f"only {len(exits)} of {count} ranks exited"
        exits += supervisor.poll()
        time.sleep(0.05)
    return sorted(exits, key=lambda e: e.rank)


def test_the_supervisor_forks_ranks_keeps_their_stderr_and_falls_back_to_fresh_ones(scratch_dir: Path) -> None:
    script = scratch_dir / "prog.py"
    script.write_text(SCRIPT)
    supervisor = RankSupervisor(_spec(scratch_dir, script), scratch_dir / "agent.sock", scratch_dir / "fault.json",
                                warm=True)
    try:
        assert supervisor.zygote_needed()
        supervisor.start_zygote()
        assert supervisor.zygote is not None and not supervisor.zygote_needed()
        _ready(supervisor.zygote)
        supervisor.extra_env = {"WARM_FAIL": "1"}
        supervisor.start_all(1)
        assert supervisor.cold_starts == 0
        exits = _wait_exits(supervisor, 2)
        assert [e.exit_code for e in exits] == [1, 1]
        assert all("ValueError: boom from the script" in e.stderr_tail for e in exits), exits
        assert (supervisor.logs_dir / "rank1.g1.stdout").read_text().startswith("argv [] name __main__ env None True")
        # The zygote is never used up: the next generation forks again.
        supervisor.extra_env = {"WARM_CODE": "0"}
        supervisor.start_all(2)
        assert supervisor.cold_starts == 0
        assert [e.exit_code for e in _wait_exits(supervisor, 2)] == [0, 0]
        # A dead zygote: fresh interpreters, which behave the same.
        supervisor.zygote.close()
        assert supervisor.zygote_needed()
        supervisor.extra_env = {"WARM_FAIL": "1"}
        supervisor.start_all(3)
        assert supervisor.cold_starts == 2
        exits = _wait_exits(supervisor, 2)
        assert [e.exit_code for e in exits] == [1, 1] and all("boom from the script" in e.stderr_tail for e in exits)
    finally:
        supervisor.stop_all()
        supervisor.close_zygote()


APP = """\
import os, sys
import helper_k7
print("app", {version!r}, "helper", helper_k7.VALUE, "argv", sys.argv[1:], "cwd", os.getcwd(),
      "code", os.environ.get("KEEL_CODE_VERSION"), flush=True)
"""


def _version(root: Path, version: str, helper: str = "helper_k7") -> Path:
    root.mkdir(parents=True)
    (root / "appmod.py").write_text(APP.format(version=version).replace("helper_k7", helper))
    (root / f"{helper}.py").write_text(f"VALUE = {version!r}\n")
    return root


def test_ranks_run_the_commanded_code_version_never_a_stale_module_of_the_zygote(scratch_dir: Path) -> None:
    from keel.events.types import CodeRef

    # The zygote imported a module named like one a version ships (here via its preload list).
    old = scratch_dir / "old"
    old.mkdir()
    (old / "helper_stale_k7.py").write_text("VALUE = 'STALE'\n")
    spec = LaunchSpec(nnodes=1, nproc_per_node=2, node_rank=0, master_addr="127.0.0.1", master_port=29999,
                      command=("-m", "appmod", "--lr", "3e-4"), job_id="warm", node_id="n0",
                      agent_dir=scratch_dir / "agent")
    supervisor = RankSupervisor(spec, scratch_dir / "agent.sock", scratch_dir / "fault.json", warm=True)
    try:
        supervisor.start_zygote({"KEEL_WARM_PRELOAD": "json,helper_stale_k7",
                                 "PYTHONPATH": os.pathsep.join([str(old), *sys.path])})
        assert supervisor.zygote is not None
        _ready(supervisor.zygote)
        assert "helper_stale_k7" in supervisor.zygote.imported()
        lines = []
        for generation, version in enumerate(["v1", "v2"], start=1):
            path = _version(scratch_dir / "versions" / version, version)
            supervisor.code = CodeRef(version_id=version, path=str(path), entry=["-m", "appmod"])
            supervisor.start_all(generation)
            assert supervisor.last_start_warm and supervisor.cold_starts == 0
            assert [e.exit_code for e in _wait_exits(supervisor, 2)] == [0, 0]
            lines.append((supervisor.logs_dir / f"rank1.g{generation}.stdout").read_text().strip())
        # Each generation runs its own version's modules (v1's helper, imported by v1's ranks only, is
        # not what v2's ranks see), with the launch's arguments, in the version's directory.
        assert lines == [f"app v1 helper v1 argv ['--lr', '3e-4'] cwd {scratch_dir / 'versions' / 'v1'} code v1",
                         f"app v2 helper v2 argv ['--lr', '3e-4'] cwd {scratch_dir / 'versions' / 'v2'} code v2"]
        # A version shipping a module the zygote imported: a forked rank would see the zygote's copy, so
        # its ranks start as fresh interpreters, and run the version's.
        path = _version(scratch_dir / "versions" / "v3", "v3", helper="helper_stale_k7")
        supervisor.code = CodeRef(version_id="v3", path=str(path), entry=["-m", "appmod"])
        assert supervisor.shadowed_by_code() == ["helper_stale_k7"]
        supervisor.start_all(3)
        assert not supervisor.last_start_warm and supervisor.cold_starts == 2
        assert [e.exit_code for e in _wait_exits(supervisor, 2)] == [0, 0]
        assert (supervisor.logs_dir / "rank0.g3.stdout").read_text().startswith("app v3 helper v3 ")
        # A script entry point resolves inside the version too.
        script_version = scratch_dir / "versions" / "v4"
        script_version.mkdir()
        (script_version / "helper_k7.py").write_text("VALUE = 'v4'\n")
        (script_version / "bin").mkdir()
        (script_version / "bin" / "train.py").write_text(APP.format(version="v4"))
        supervisor.code = CodeRef(version_id="v4", path=str(script_version), entry=["bin/train.py"])
        supervisor.start_all(4)
        assert supervisor.last_start_warm
        assert [e.exit_code for e in _wait_exits(supervisor, 2)] == [0, 0], (supervisor.logs_dir / "rank0.g4.stderr").read_text()
        assert (supervisor.logs_dir / "rank0.g4.stdout").read_text().startswith("app v4 helper v4 argv ['--lr', '3e-4']")
    finally:
        supervisor.stop_all()
        supervisor.close_zygote()
