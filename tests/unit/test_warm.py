"""Pure parts of the warm zygote: the launch line's validation and when the agent replaces a dead zygote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.agent.agent import ZYGOTE_RESTART_AFTER_S, zygote_restart_due
from keel.agent.launch_spec import parse_launch_args
from keel.agent.warm import LaunchMessageError, parse_launch


def test_a_valid_launch_line_parses() -> None:
    line = json.dumps({"op": "launch", "id": "r0", "argv": ["-m", "pkg.mod", "--x"], "env": {"A": "1"},
                       "stdout": "/tmp/o", "stderr": "/tmp/e"})
    message = parse_launch(line)
    assert message["argv"] == ["-m", "pkg.mod", "--x"] and message["env"] == {"A": "1"}


@pytest.mark.parametrize("message, reason", [
    ([1, 2], "must be a JSON object"),
    ({"op": "fork-bomb"}, "unknown op 'fork-bomb'"),
    ({"argv": "x.py", "env": {}, "stdout": "/o", "stderr": "/e"}, "'argv' must be a non-empty list"),
    ({"argv": ["-m"], "env": {}, "stdout": "/o", "stderr": "/e"}, "without a module"),
    ({"argv": ["x.py"], "env": [], "stdout": "/o", "stderr": "/e"}, "'env' must be an object of strings"),
    ({"argv": ["x.py"], "env": {}, "stderr": "/e"}, "'stdout' must be a path"),
    ({"argv": ["x.py"], "env": {}, "stdout": "/o", "stderr": None}, "'stderr' must be a path"),
    ({"argv": ["x.py"], "env": {}, "stdout": "/o", "stderr": "/e", "cwd": 3}, "'cwd' must be a path or null"),
])
def test_a_bad_launch_line_is_a_clear_error(message: object, reason: str) -> None:
    with pytest.raises(LaunchMessageError, match=reason.replace("(", r"\(")):
        parse_launch(json.dumps(message))


def due(**overrides: object) -> bool:
    args = {"standby": False, "held": False, "failed": False, "round_running": False, "ranks_running": 2,
            "ranks_stepping": False, "since_generation_start_s": 1.0, **overrides}
    return zygote_restart_due(**args)  # type: ignore[arg-type]


def test_a_dead_zygote_is_replaced_only_when_that_does_not_slow_a_recovery() -> None:
    assert not due()  # the ranks of a start are still setting up and restoring
    assert due(ranks_stepping=True)
    assert due(since_generation_start_s=ZYGOTE_RESTART_AFTER_S)  # a program that never reports
    assert due(standby=True, ranks_running=0)
    assert not due(ranks_running=0, ranks_stepping=True)  # every rank ended: the job is finishing
    for busy in ({"round_running": True}, {"held": True}, {"failed": True}):
        assert not due(ranks_stepping=True, **busy)
        assert not due(standby=True, ranks_running=0, **busy)


def test_warm_starts_are_on_by_default_and_keel_no_warm_ranks_turns_them_off() -> None:
    from keel.agent.launch_spec import parse_launch_args

    assert parse_launch_args(["--nproc-per-node", "2", "train.py"]).warm_ranks
    assert not parse_launch_args(["--keel-no-warm-ranks", "-m", "pkg.train"]).warm_ranks
    assert not parse_launch_args(["--keel_no_warm_ranks", "train.py", "--lr", "1"]).warm_ranks


def test_standalone_without_a_port_picks_a_free_one_below_the_ephemeral_range() -> None:
    # torchrun's --standalone rendezvous on localhost:0; a fixed 29500 made a second job on the host fail,
    # and a port inside the ephemeral range can be taken by any outgoing connection before rank 0 binds it.
    spec = parse_launch_args(["--standalone", "train.py"])
    assert spec.master_port == 0
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = {spec.with_free_master_port().master_port for _ in range(5)}
    assert all(10_000 <= port < low for port in picked), picked
    assert len(picked) > 1  # random within the range, so two jobs started together rarely race for one
    assert parse_launch_args(["--standalone", "--master-port", "1234", "train.py"]).with_free_master_port().master_port == 1234
    # torchrun: one node without a master port is a local rendezvous on a free port too; a static
    # multi-node one keeps 29500.
    assert parse_launch_args(["train.py"]).master_port == 0
    assert parse_launch_args(["--nnodes", "2", "train.py"]).master_port == 29500
