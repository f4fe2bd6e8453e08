"""``keel run``'s torchrun flags: spellings, defaults, ``PET_*`` environment defaults, bad values; where
the ranks' output goes (``keel.agent.rank_output``); the ranks' environment (``RankSupervisor.rank_env``)."""

from __future__ import annotations

import io
import time
from datetime import timedelta
from pathlib import Path

import pytest

from keel.agent.launch_spec import LaunchError, LaunchHelp, LaunchSpec, parse_launch_args, resolve_nproc_per_node
from keel.agent.rank_output import ConsoleTail, StdSpecError, parse_std, plan_outputs

TORCHRUN_FLAGS = [
    "--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--standalone",
    "--max-restarts", "--monitor-interval", "--start-method", "--event-log-handler", "--role", "--module",
    "--no-python", "--run-path", "--log-dir", "--redirects", "--tee", "--local-ranks-filter",
    "--duplicate-stdout-filters", "--duplicate-stderr-filters", "--node-rank", "--master-addr", "--master-port",
    "--local-addr", "--logs-specs", "--numa-binding", "--signals-to-handle", "--shutdown-timeout",
    "--virtual-local-rank",
]


def parse(argv: list[str], **environ: str) -> LaunchSpec:
    return parse_launch_args(argv, environ=environ)


def test_every_torchrun_flag_is_accepted_in_both_spellings() -> None:
    from keel.agent.launch_spec import build_parser

    known = {s for action in build_parser({})._actions for s in action.option_strings}
    for flag in TORCHRUN_FLAGS:
        assert flag in known, flag
        if "-" in flag[2:]:
            assert "--" + flag[2:].replace("-", "_") in known, flag
    assert {"-m", "-r", "-t"} <= known


def test_defaults_are_torchruns() -> None:
    spec = parse(["--nnodes", "2", "train.py"])
    assert (spec.min_nodes, spec.nnodes, spec.nproc_per_node, spec.node_rank) == (2, 2, 1, 0)
    assert (spec.rdzv_backend, spec.run_id, spec.role, spec.max_restarts) == ("static", "none", "default", 0)
    assert spec.monitor_interval == timedelta(seconds=0.1) and spec.start_method == "spawn"
    assert (spec.redirects, spec.tee, spec.local_ranks_filter, spec.log_dir) == ("0", "0", None, None)
    assert (spec.master_addr, spec.master_port) == ("127.0.0.1", 29500)
    assert spec.signals_to_handle == ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    assert spec.command == ("train.py",) and not spec.no_python


def test_a_local_rendezvous_gets_a_fresh_run_id_and_a_free_port() -> None:
    for argv in (["--standalone", "--rdzv-id", "mine", "t.py"], ["t.py"]):
        spec = parse(argv)
        assert spec.master_port == 0 and len(spec.run_id) == 36 and spec.run_id != parse(argv).run_id
    assert parse(["--standalone", "--rdzv-id", "mine", "t.py"]).job_id == "mine"  # Keel's job id
    static = parse(["--master-port", "29600", "--rdzv-id", "r1", "t.py"])
    assert (static.master_port, static.run_id) == (29600, "r1")


def test_pet_environment_variables_are_defaults_and_flags_win() -> None:
    spec = parse(["t.py"], PET_NPROC_PER_NODE="3", PET_MAX_RESTARTS="2", PET_STANDALONE="1", PET_TEE="3",
                 PET_ROLE="trainer", PET_LOG_DIR="/tmp/x", PET_RDZV_CONF="join_timeout=5")
    assert (spec.nproc_per_node, spec.max_restarts, spec.tee, spec.role) == (3, 2, "3", "trainer")
    assert spec.master_port == 0 and spec.log_dir == Path("/tmp/x") and spec.rdzv_conf.join_timeout == timedelta(seconds=5)
    assert parse(["--nproc_per_node", "4", "t.py"], PET_NPROC_PER_NODE="3").nproc_per_node == 4
    assert not parse(["t.py"], PET_NO_PYTHON="0").no_python
    with pytest.raises(LaunchError, match="PET_STANDALONE must be an integer"):
        parse(["t.py"], PET_STANDALONE="yes")
    with pytest.raises(LaunchError):
        parse(["t.py"], PET_MAX_RESTARTS="many")


def test_program_forms_module_no_python_run_path() -> None:
    assert parse(["-m", "pkg.train", "--lr", "1"]).command == ("-m", "pkg.train", "--lr", "1")
    spec = parse(["--no-python", "/bin/echo", "hi"])
    assert spec.no_python and spec.command == ("/bin/echo", "hi")
    run_path = parse(["--run-path", "--no-python", "/abs/t.py"])  # --run-path wins, as in torchrun
    assert run_path.run_path and not run_path.no_python and run_path.command == ("/abs/t.py",)
    with pytest.raises(LaunchError, match="--no-python and -m"):
        parse(["--no-python", "-m", "pkg"])


def test_nproc_per_node_names(tmp_path: Path) -> None:
    assert resolve_nproc_per_node("cpu", {}, tmp_path) >= 1
    assert resolve_nproc_per_node("auto", {}, tmp_path) == resolve_nproc_per_node("cpu", {}, tmp_path)  # no GPU
    with pytest.raises(LaunchError, match="CUDA is not available"):
        resolve_nproc_per_node("gpu", {}, tmp_path)
    for index in range(4):
        (tmp_path / f"proc/driver/nvidia/gpus/0000:0{index}:00.0").mkdir(parents=True)
    assert resolve_nproc_per_node("gpu", {}, tmp_path) == 4
    assert resolve_nproc_per_node("gpu", {"CUDA_VISIBLE_DEVICES": "2,0"}, tmp_path) == 2
    assert resolve_nproc_per_node("auto", {"CUDA_VISIBLE_DEVICES": "1,-1,0"}, tmp_path) == 1
    for bad, message in (("0", ">= 1"), ("many", "integer or auto"), ("xpu", "XPU")):
        with pytest.raises(LaunchError, match=message):
            resolve_nproc_per_node(bad, {}, tmp_path)


@pytest.mark.parametrize(("argv", "message"), [
    (["--nnodes", "3:2", "t.py"], "MIN <= MAX"),
    (["--nnodes", "a:b", "t.py"], "N or MIN:MAX"),
    (["--redirects", "4", "t.py"], "--redirects"),
    (["--tee", "0:1,x", "t.py"], "--tee"),
    (["--local-ranks-filter", "0,a", "t.py"], "comma-separated integers"),
    (["--rdzv-conf", "timeout", "t.py"], "must be key=value"),
    (["--rdzv-conf", "=5", "t.py"], "must be key=value"),
    (["--rdzv-conf", "join_timeout=soon", "t.py"], "not a duration"),
    (["--max-restarts", "-1", "t.py"], ">= 0"),
    (["--monitor-interval", "0", "t.py"], "> 0"),
    (["--event-log-handler", "kafka", "t.py"], "one of null"),
    (["--signals-to-handle", "SIGTERM,SIGNOPE", "t.py"], "SIGNOPE"),
    (["--signals-to-handle", "SIGKILL", "t.py"], "SIGKILL"),
    (["--shutdown-timeout", "-3", "t.py"], ">= 0"),
    (["--logs-specs", "no-such-specs", "t.py"], "torchrun.logs_specs"),
    (["--start-method", "thread", "t.py"], "invalid arguments"),
    (["--numa-binding", "all", "t.py"], "invalid arguments"),
])
def test_bad_values_are_a_clear_launch_error(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(LaunchError, match=message):
        parse(argv)


def test_help_exits_like_torchrun(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(LaunchHelp):
        parse(["--help"])
    assert "--local-ranks-filter" in capsys.readouterr().out


def test_log_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(LaunchError, match="is a file"):
        parse(["--log-dir", str(tmp_path / "f"), "t.py"])


def test_shutdown_timeout_from_the_flag_or_torch_elastic_shutdown_timeout() -> None:
    assert parse(["t.py"]).shutdown_timeout == timedelta(seconds=5)
    assert parse(["t.py"], TORCH_ELASTIC_SHUTDOWN_TIMEOUT="12").shutdown_timeout == timedelta(seconds=12)
    assert parse(["--shutdown-timeout", "2", "t.py"], TORCH_ELASTIC_SHUTDOWN_TIMEOUT="12").shutdown_timeout == timedelta(seconds=2)


def test_std_values_as_torchrun_reads_them() -> None:
    assert parse_std("3") == 3 and parse_std("0:1,1:2") == {0: 1, 1: 2}
    for bad in ("4", "10:1", "0:1,", "all"):
        with pytest.raises(StdSpecError):
            parse_std(bad)


def test_output_plan_follows_redirects_tee_and_the_filter(tmp_path: Path) -> None:
    attempt = tmp_path / "run_x" / "attempt_1"
    plans = plan_outputs(nproc=3, global_ranks=[3, 4, 5], generation=1, role="trainer", redirects="0:1",
                         tee="1:3", local_ranks_filter=frozenset({0, 1}), attempt_dir=attempt, keel_logs=tmp_path)
    # local rank 0: stdout redirected (file only), stderr to the console through Keel's own file.
    assert plans[0].stdout.path == attempt / "0/stdout.log" and plans[0].stdout.console is None
    assert plans[0].stderr.path == tmp_path / "rank3.g1.stderr" and plans[0].stderr.console == ""
    # local rank 1: both tee'd: torchrun's files, prefixed on the console.
    assert plans[1].stdout.path == attempt / "1/stdout.log" and plans[1].stdout.console == "[trainer1]:"
    assert plans[1].stderr.torchrun_file and plans[1].stderr.console == "[trainer1]:"
    # local rank 2: filtered out: on no console, still in a file.
    assert plans[2].stdout.console is None and plans[2].stderr.console is None
    assert plans[2].error_file == str(attempt / "2/error.json")
    devnull = plan_outputs(nproc=1, global_ranks=[0], generation=0, role="default", redirects="3", tee="0",
                           local_ranks_filter=None, attempt_dir=None, keel_logs=tmp_path,
                           prefix_template="${role_name}-${rank}: ")
    assert devnull[0].error_file == "" and str(devnull[0].stdout.path) == "/dev/null"


def test_console_tail_copies_whole_lines_with_the_prefix_and_drains_at_the_end(tmp_path: Path) -> None:
    log, console, filtered = tmp_path / "stdout.log", io.BytesIO(), io.BytesIO()
    log.write_bytes(b"an earlier launch's line\n")  # Keel's own files are appended to: not shown again
    tail = ConsoleTail(interval_s=0.01)
    tail.follow(log, console, "[default0]:", filtered, ["loss"])
    with open(log, "ab") as writer:
        writer.write(b"step 1 loss 2.0\nhalf")
        writer.flush()
        deadline = time.monotonic() + 5
        while b"step 1" not in console.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert console.getvalue() == b"[default0]:step 1 loss 2.0\n"  # the partial line waits
        writer.write(b" a line\nlast")
    tail.finish([log])
    assert console.getvalue() == b"[default0]:step 1 loss 2.0\n[default0]:half a line\n[default0]:last\n"
    assert filtered.getvalue() == b"[default0]:step 1 loss 2.0\n"
    tail.close()


def test_rank_environment_is_torchruns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from keel.agent.supervisor import RankSupervisor

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    spec = parse(["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-port", "29600",
                  "--rdzv-id", "r7", "--max-restarts", "3", "--role", "trainer", "--keel-agent-dir", str(tmp_path),
                  "--virtual-local-rank", "t.py"])
    supervisor = RankSupervisor(spec, tmp_path / "agent.sock", tmp_path / "fault.json")
    env = supervisor.rank_env(1, 2)
    expected = {"RANK": "3", "LOCAL_RANK": "0", "GROUP_RANK": "1", "ROLE_RANK": "3", "ROLE_NAME": "trainer",
                "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "4",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29602", "TORCHELASTIC_RESTART_COUNT": "2",
                "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "r7", "TORCHELASTIC_USE_AGENT_STORE": "False",
                "CUDA_VISIBLE_DEVICES": "5", "OMP_NUM_THREADS": "1"}
    assert {k: env.get(k) for k in expected} == expected
    assert env["TORCHELASTIC_ERROR_FILE"].endswith("/attempt_2/1/error.json")
    assert "NODE_RANK" not in env and "PYTHONUNBUFFERED" not in env
    single = RankSupervisor(parse(["--keel-agent-dir", str(tmp_path / "b"), "t.py"]), tmp_path / "s", tmp_path / "f")
    assert "OMP_NUM_THREADS" not in single.rank_env(0, 0)  # one rank per node: torchrun leaves it unset
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert supervisor.rank_env(0, 0)["OMP_NUM_THREADS"] == "4"
