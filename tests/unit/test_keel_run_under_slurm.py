"""``keel run`` inside a Slurm step (``srun --ntasks-per-node=1 keel run ...``): what it takes from the
variables srun sets, the way torchrun users pass them by hand; flags still win; a node past ``--nnodes``
is a warm standby."""

from __future__ import annotations

import pytest

from keel.agent.launch_spec import LaunchError, parse_launch_args
from keel.rules.slurm import slurm_step


def step_env(node_index: int, nodes: str = "gpu[01-03]", **extra: str) -> dict[str, str]:
    names = {"gpu[01-03]": ["gpu01", "gpu02", "gpu03"]}.get(nodes, [])
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NODEID": str(node_index), "SLURM_NNODES": "3",
           "SLURM_STEP_NODELIST": nodes, "SLURM_JOB_NODELIST": nodes, "SLURM_PROCID": str(node_index)}
    if node_index < len(names):
        env["SLURMD_NODENAME"] = names[node_index]
    return {**env, **extra}


def test_the_step_is_read_from_sruns_variables() -> None:
    step = slurm_step(step_env(1))
    assert step is not None
    assert (step.job_id, step.node_name, step.node_index, step.head) == ("4242", "gpu02", 1, "gpu01")
    assert step.nodes == ("gpu01", "gpu02", "gpu03")


def test_outside_a_step_nothing_is_taken() -> None:
    assert slurm_step({}) is None
    # What sbatch sets in the batch script's own shell (sbatch(1)): no step; keel run there is one node.
    batch_shell = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "0", "SLURMD_NODENAME": "gpu01",
                   "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_NNODES": "3"}
    assert slurm_step(batch_shell) is None
    spec = parse_launch_args(["train.py"], environ=batch_shell)
    assert (spec.nnodes, spec.node_rank, spec.master_addr, spec.job_id, spec.standby) == (1, 0, "127.0.0.1", "job", False)
    assert parse_launch_args(["--standalone", "train.py"], environ=batch_shell).nnodes == 1
    spec = parse_launch_args(["--nnodes", "2", "--node-rank", "1", "train.py"], environ={})
    assert (spec.node_rank, spec.master_addr, spec.job_id) == (1, "127.0.0.1", "job")


def test_node_rank_node_id_master_and_job_come_from_the_step() -> None:
    spec = parse_launch_args(["--nproc-per-node", "2", "train.py"], environ=step_env(2))
    assert (spec.nnodes, spec.node_rank, spec.node_id, spec.master_addr) == (3, 2, "gpu03", "gpu01")
    assert spec.job_id == "slurm-4242" and not spec.standby


def test_flags_win_over_the_step() -> None:
    spec = parse_launch_args(["--nnodes", "3", "--node-rank", "0", "--master-addr", "10.0.0.9", "--keel-node-id", "a",
                              "--keel-job-id", "llm", "train.py"], environ=step_env(2))
    assert (spec.node_rank, spec.master_addr, spec.node_id, spec.job_id) == (0, "10.0.0.9", "a", "llm")


def test_nodes_past_nnodes_start_as_warm_standbys() -> None:
    workers = [parse_launch_args(["--nnodes", "2", "train.py"], environ=step_env(i)) for i in (0, 1)]
    standby = parse_launch_args(["--nnodes", "2", "train.py"], environ=step_env(2))
    assert [(s.node_rank, s.standby) for s in workers] == [(0, False), (1, False)]
    assert standby.standby and standby.node_id == "gpu03" and standby.nnodes == 2
    assert standby.command == ("train.py",)  # what it runs once promoted


def test_a_c10d_rendezvous_defaults_to_the_first_node() -> None:
    spec = parse_launch_args(["--rdzv-backend", "c10d", "--nnodes", "3", "train.py"], environ=step_env(1))
    assert spec.master_addr == "gpu01" and spec.rendezvous


@pytest.mark.parametrize("env, message", [
    (step_env(5), "does not fit the step's nodes"),
    (step_env(0, SLURM_NODEID="x"), "must be a number"),
    (step_env(0, nodes="gpu[01-"), "unbalanced"),
])
def test_variables_slurm_would_not_set_are_a_clear_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        parse_launch_args(["train.py"], environ=env)
