"""keel.sdk against a real Unix datagram socket bound by the test, and its injected-fault hooks."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import keel.sdk.session as session_mod
from keel.protocol import node_local_pb2 as pb
from keel.sdk import FaultFileError, Session, SessionConfig, init, parse_fault

QUIET = timedelta(minutes=10)  # a heartbeat interval that never fires during a test


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="keel-sdk-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agent(short_dir: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(short_dir / "agent.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    yield path, sock
    sock.close()


def _drain(sock: socket.socket) -> list[pb.RankReport]:
    reports = []
    sock.settimeout(0.05)
    try:
        while True:
            reports.append(pb.RankReport.FromString(sock.recv(65536)))
    except TimeoutError:
        return reports


def _config(**overrides: object) -> SessionConfig:
    base: dict[str, object] = dict(job_id="job-1", node_id="n07", rank=3, local_rank=1, world_size=4, generation=2,
                                   heartbeat_interval=QUIET)
    base.update(overrides)
    return SessionConfig(**base)  # type: ignore[arg-type]


def test_reports_carry_fields_phases_and_sequence(agent: tuple[str, socket.socket]) -> None:
    path, sock = agent
    session = Session(_config(agent_socket=path))
    with session.phase("step"):
        time.sleep(0.02)
        session.step_done(0, loss=2.5, grad_norm=0.75, tokens=1000)
        with session.phase("eval"):
            pass
    session.done()
    reports = _drain(sock)
    phases = [pb.Phase.Name(r.phase) for r in reports]
    assert phases == ["PHASE_SETUP", "PHASE_STEP", "PHASE_STEP", "PHASE_EVAL", "PHASE_STEP", "PHASE_SETUP", "PHASE_DONE"]
    assert [r.seq for r in reports] == list(range(1, len(reports) + 1))
    first, stepped = reports[0], reports[2]
    assert (first.job_id, first.node_id, first.rank, first.local_rank, first.generation) == ("job-1", "n07", 3, 1, 2)
    assert first.pid == os.getpid() and first.step == -1 and abs(first.sent_at_unix_s - time.time()) < 5
    assert stepped.step == 0 and stepped.loss == 2.5 and stepped.grad_norm == 0.75
    assert 0.02 <= stepped.step_time_s < 1.0
    assert stepped.tokens_per_s == pytest.approx(1000 / stepped.step_time_s)
    assert reports[-1].step == 0 and session.reports_dropped == 0


def test_compute_time_is_the_step_outside_collective_waits(agent: tuple[str, socket.socket]) -> None:
    path, sock = agent
    session = Session(_config(agent_socket=path))
    with session.phase("step"):
        session.step_done(0)  # no collective marked: not measured
        time.sleep(0.03)  # this rank's own work
        with session.waiting():
            time.sleep(0.06)  # waiting for a slower peer in an all-reduce
        session.step_done(1)
    stepped = {r.step: r for r in _drain(sock) if r.phase == pb.PHASE_STEP}
    assert stepped[0].compute_time_s == 0.0
    assert 0.09 <= stepped[1].step_time_s < 0.5
    assert 0.03 <= stepped[1].compute_time_s < stepped[1].step_time_s - 0.05


def test_heartbeat_repeats_state_and_does_not_keep_the_process_alive(agent: tuple[str, socket.socket]) -> None:
    path, sock = agent
    session = Session(_config(agent_socket=path, heartbeat_interval=timedelta(milliseconds=20)))
    assert session._heartbeat is not None and session._heartbeat.daemon
    session.step_done(4)
    time.sleep(0.2)
    session.close()
    beats = [r for r in _drain(sock) if r.step == 4]
    assert len(beats) >= 4 and all(r.phase == pb.PHASE_SETUP for r in beats)


def test_an_injected_hang_stops_the_rank_inside_its_next_collective(agent: tuple[str, socket.socket], short_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``hang`` fault due at step 2 arms at the step boundary and takes effect when the rank enters its
    next collective: reports from then on say it is inside that collective, for longer and longer, while
    the heartbeat goes on (the process is alive, its training thread stopped)."""
    path, sock = agent
    stopped: list[str] = []
    inside: list[pb.RankReport] = []

    def block_and_listen(kind: str) -> None:  # the agent's side while the rank is blocked (0.3 s here)
        stopped.append(kind)
        deadline = time.monotonic() + 0.3
        sock.settimeout(0.05)
        while time.monotonic() < deadline:  # read as they come: the socket queues only a few datagrams
            try:
                r = pb.RankReport.FromString(sock.recv(65536))
            except TimeoutError:
                continue
            if r.collective_wait_s > 0:
                inside.append(r)

    monkeypatch.setattr(session_mod, "_stop_or_block", block_and_listen)
    fault_file = short_dir / "fault.json"
    fault_file.write_text(json.dumps({"id": "h1", "kind": "hang", "rank": None, "params": {"at_step": 2}}))
    session = Session(_config(agent_socket=path, fault_file=str(fault_file), heartbeat_interval=timedelta(milliseconds=20)))
    with session.phase("step"):
        with session.waiting("dp_all_reduce"):
            pass
        session.step_done(0)
        session.step_done(1)  # step 2 is the first that does not complete: armed here, nothing blocks yet
        assert stopped == []
        with session.waiting("dp_all_reduce"):  # blocks (0.3 s here) at the collective's entrance
            assert stopped == ["hang"]
    session.close()
    assert len(inside) >= 5 and {r.collective for r in inside} == {"dp_all_reduce"} and {r.collective_seq for r in inside} == {2}
    assert max(r.collective_wait_s for r in inside) >= 0.2


def test_a_hang_for_a_phase_passes_the_collectives_of_other_phases(agent: tuple[str, socket.socket], short_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``params.phase``: a hang that arrived late, with an eval between it and the next step, still stops in
    the step's collective (and one for ``eval`` passes the step's collectives and stops in the eval's)."""
    path, _ = agent
    for phase, stops_in in (("step", "dp_all_reduce"), ("eval", "eval_all_reduce")):
        stopped: list[str] = []
        monkeypatch.setattr(session_mod, "_stop_or_block", stopped.append)
        fault_file = short_dir / f"fault-{phase}.json"
        fault_file.write_text(json.dumps({"id": f"h-{phase}", "kind": "hang", "rank": None,
                                          "params": {"at_step": 1, "phase": phase}}))
        session = Session(_config(agent_socket=path, fault_file=str(fault_file)))
        entered: list[str] = []
        with session.phase("step"):
            with session.waiting("dp_all_reduce"):
                pass
            session.step_done(0)  # armed here
            for name, in_phase in (("eval_all_reduce", "eval"), ("dp_all_reduce", "step"), ("eval_all_reduce", "eval")):
                with session.phase(in_phase), session.waiting(name):
                    if stopped and not entered:
                        entered.append(name)
        session.close()
        assert stopped == ["hang"] and entered == [stops_in], (phase, entered)


def test_a_hang_in_a_loop_that_marks_no_collectives_stops_at_the_step_boundary(
        agent: tuple[str, socket.socket], short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = agent
    stopped: list[str] = []
    monkeypatch.setattr(session_mod, "_stop_or_block", stopped.append)
    fault_file = short_dir / "fault.json"
    fault_file.write_text(json.dumps({"id": "h2", "kind": "hang_stopped", "rank": None}))
    session = Session(_config(agent_socket=path, fault_file=str(fault_file)))
    session.step_done(0)
    session.close()
    assert stopped == ["hang_stopped"]


def test_reports_say_how_long_the_rank_has_been_inside_a_collective(agent: tuple[str, socket.socket]) -> None:
    path, sock = agent
    session = Session(_config(agent_socket=path, heartbeat_interval=timedelta(milliseconds=20)))
    with session.phase("step"):
        with session.waiting("pp_recv_activations"):
            time.sleep(0.01)
        with session.waiting("dp_all_reduce"):
            time.sleep(0.15)
        session.step_done(0)
        time.sleep(0.05)
    session.close()
    reports = _drain(sock)
    inside = [r for r in reports if r.collective_wait_s > 0]
    assert inside and all(r.collective == "dp_all_reduce" and r.collective_seq == 2 for r in inside)
    stepped = next(r for r in reports if r.step == 0)
    assert stepped.collective_wait_s == 0.0 and 0.15 <= stepped.collective_wait_max_s < 0.5


def test_env_is_read_and_a_bare_interval_is_rejected() -> None:
    env = {"KEEL_JOB_ID": "j", "KEEL_NODE_ID": "n1", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
           "KEEL_GENERATION": "3", "KEEL_HEARTBEAT_INTERVAL": "250ms"}
    session = init(env)
    cfg = session.config
    assert (cfg.job_id, cfg.node_id, cfg.rank, cfg.local_rank, cfg.world_size, cfg.generation) == ("j", "n1", 5, 1, 8, 3)
    assert cfg.heartbeat_interval == timedelta(milliseconds=250) and cfg.agent_socket is None
    assert session._heartbeat is None  # local session: no agent, no thread
    session.step_done(0, loss=1.0, tokens=10)
    session.done()
    with pytest.raises(ValueError, match="unit"):
        SessionConfig.from_env({"KEEL_HEARTBEAT_INTERVAL": "1"})


def _hammer(session: Session, steps: int) -> float:
    t0 = time.perf_counter()
    for step in range(steps):
        session.step_done(step, loss=1.0, tokens=100)
    return time.perf_counter() - t0


def test_missing_socket_drops_silently_and_fast(short_dir: Path) -> None:
    session = Session(_config(agent_socket=str(short_dir / "nobody.sock")))
    assert _hammer(session, 2000) < 0.5
    assert session.reports_dropped >= 2000 and session.reports_sent == 0
    session.done()


def test_socket_removed_mid_run(agent: tuple[str, socket.socket]) -> None:
    path, sock = agent
    session = Session(_config(agent_socket=path))
    _hammer(session, 5)
    assert session.reports_sent == 6
    sock.close()
    os.unlink(path)
    assert _hammer(session, 500) < 0.5
    assert session.reports_dropped == 500
    session.done()


def test_agent_that_never_reads_fills_its_buffer_without_slowing_training(agent: tuple[str, socket.socket]) -> None:
    path, _sock = agent  # bound, never read
    session = Session(_config(agent_socket=path))
    assert _hammer(session, 5000) < 1.0
    assert session.reports_dropped > 0 and session.reports_sent > 0
    session.done()


# -- fault file ------------------------------------------------------------------------------------


def test_parse_fault_accepts_the_documented_shape() -> None:
    fault = parse_fault('{"id": "f1", "kind": "slow", "rank": null, "params": {"fraction": 0.5, "at_step": 4}}')
    assert (fault.id, fault.kind, fault.rank, fault.at_step, fault.params["fraction"]) == ("f1", "slow", None, 4, 0.5)
    assert fault.targets(rank=7, generation=0)
    assert not parse_fault('{"id": "f2", "kind": "crash", "rank": 1}').targets(rank=0, generation=0)
    assert not parse_fault('{"id": "f3", "kind": "crash", "generation": 1}').targets(rank=0, generation=2)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"kind": "crash"}', "'id'"),
        ('{"id": "x", "kind": "explode"}', "unknown kind 'explode'"),
        ('{"id": "x", "kind": "crash", "rank": "3"}', "'rank'"),
        ('{"id": "x", "kind": "slow", "params": {"fraction": -1}}', "fraction"),
        ('{"id": "x", "kind": "hang", "params": {"phase": "lunch"}}', "params.phase"),
        ('{"id": "x", "kind": "crash", "params": {"phase": "step"}}', "params.phase .* for crash"),
        ('{"id": "x", "kind": "nan", "params": {"at_step": "soon"}}', "at_step"),
    ],
)
def test_parse_fault_rejects_malformed_files(text: str, reason: str) -> None:
    with pytest.raises(FaultFileError, match=reason):
        parse_fault(text)


def test_malformed_and_unknown_faults_are_logged_and_training_continues(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fault_file = short_dir / "fault.json"
    session = Session(_config(fault_file=str(fault_file)))
    session.step_done(0)  # no file yet
    fault_file.write_text('{"id": "bad", "kind": ')
    with caplog.at_level(logging.ERROR, logger="keel.sdk"):
        session.step_done(1)
        session.step_done(2)  # unchanged file: not re-read, not logged again
        fault_file.write_text('{"id": "u1", "kind": "meltdown"}')
        session.step_done(3)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert "not valid JSON" in errors[0] and "unknown kind 'meltdown'" in errors[1]
    assert session.last_step == 3


def _write_fault(path: Path, **fault: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(fault))
    os.replace(tmp, path)  # as the agent does: the file is replaced whole


def test_crash_fires_at_its_step_once_and_only_on_its_rank(short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fault_file = short_dir / "fault.json"
    _write_fault(fault_file, id="c1", kind="crash", rank=3, params={"at_step": 2})
    other = Session(_config(rank=2, fault_file=str(fault_file)))
    mine = Session(_config(rank=3, fault_file=str(fault_file)))
    for s in (other, mine):
        s.step_done(0)
    with pytest.raises(RuntimeError, match="keel injected crash"):
        mine.step_done(1)
    other.step_done(1)
    assert "keel injected crash: fault c1 on rank 3 after step 1" in capsys.readouterr().err
    _write_fault(fault_file, id="c1", kind="crash", rank=3)  # rewritten, same id: applied once only
    mine.step_done(2)


def test_nan_fault_poisons_exactly_the_next_step(short_dir: Path) -> None:
    fault_file = short_dir / "fault.json"
    session = Session(_config(fault_file=str(fault_file)))
    session.step_done(0)
    _write_fault(fault_file, id="n1", kind="nan", rank=None)
    assert session.nan_factor() == 1.0
    session.step_done(1)
    assert math.isnan(session.nan_factor())  # during step 2
    session.step_done(2, loss=float("nan"))
    assert session.nan_factor() == 1.0


def test_slow_fault_sleeps_a_fraction_of_the_measured_step(short_dir: Path) -> None:
    fault_file = short_dir / "fault.json"
    _write_fault(fault_file, id="s1", kind="slow", rank=None, params={"fraction": 0.5})
    session = Session(_config(fault_file=str(fault_file)))
    durations = []
    for step in range(3):
        t0 = time.monotonic()
        time.sleep(0.04)  # the step's own work
        session.step_done(step)
        durations.append(time.monotonic() - t0)
    # step_done itself sleeps ~0.5 x 0.04 s, and the injected delay is not fed back into the measurement.
    assert all(d >= 0.06 for d in durations) and max(durations) < 0.2
    assert session._step_time_s == pytest.approx(0.04, abs=0.03)


def test_oom_fault_raises_memory_error_after_a_bounded_allocation(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_mod, "OOM_CAP_BYTES", 32 * 1024**2)
    fault_file = short_dir / "fault.json"
    _write_fault(fault_file, id="o1", kind="oom", rank=None)
    session = Session(_config(fault_file=str(fault_file)))
    with pytest.raises(MemoryError, match="keel injected oom"):
        session.step_done(0)
