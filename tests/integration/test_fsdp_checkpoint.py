"""Sharded model state (issue 19, item 1) for real: a sharded job (``python -m keel.workload.fsdp``, two gloo
ranks) SIGKILLed mid-run resumes from its shared-memory slots bitwise, sharded three ways: FSDP2 (ZeRO-3, every
parameter and AdamW moment a DTensor shard), ZeRO-2 (FSDP2 keeping parameters gathered between forward and
backward) and ZeRO-1 (DDP with ``ZeroRedundancyOptimizer``: each rank's slot holds its partition of the AdamW
state only). A shard of another layout is refused with a message naming the difference."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from keel.checkpoint import slots as ckpt_slots
from keel.infra.embedded import free_port
from keel.sdk.shard import ShardedTensor, decode_shard
from tests.factories import finish_ranks, kill_ranks, step_losses

pytestmark = pytest.mark.integration

_ROOT = Path(__file__).resolve().parents[2]
_STEPS = 14


def _launch(args: list[str], env_extra: dict[str, str], log_dir: Path, world: int = 2) -> list[subprocess.Popen[str]]:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_ROOT), **env_extra})
        stdout = subprocess.PIPE if rank == 0 else open(log_dir / f"rank{rank}.out", "w")  # noqa: SIM115
        procs.append(subprocess.Popen([sys.executable, *args], env=env, stdout=stdout, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    return procs


def _kill_after_step(victim: list[subprocess.Popen[str]], kill_after: int, timeout_s: float = 120) -> str:
    """Rank 0's output up to its line for step ``kill_after``, when every rank is SIGKILLed (mid-run: a copy may be
    in flight, the ranks may be a step apart); a watchdog kills them after ``timeout_s`` whatever happens."""
    watchdog = threading.Timer(timeout_s, kill_ranks, [victim])
    watchdog.start()
    lines = []
    try:
        assert victim[0].stdout is not None
        for line in victim[0].stdout:
            lines.append(line)
            if line.startswith(f"step {kill_after} "):
                kill_ranks(victim)
                break
    finally:
        watchdog.cancel()
        kill_ranks(victim)
    return "".join(lines)


def _newest_complete_payload(node_dir: Path, rank: int) -> bytes:
    """The verified payload of the rank's newest COMPLETE slot. A SIGKILL may land while one of the two slots is
    being rewritten (marked WRITING, payload length 0), so which slot holds the newest step depends on the kill."""
    complete = []
    for index in range(2):
        try:
            complete.append(ckpt_slots.read_payload(ckpt_slots.slot_path(node_dir, rank, index)))
        except ckpt_slots.SlotError:
            continue
    assert complete, f"rank {rank} has no complete slot under {node_dir}"
    return max(complete, key=lambda header_payload: header_payload[0].step)[1]


@pytest.mark.parametrize("sharding", ["fsdp2", "zero2", "zero1"])
def test_a_sharded_job_sigkilled_mid_run_resumes_bitwise_from_its_slots(shm: Path, sharding: str) -> None:
    kill_after = random.Random().randint(2, 8)  # a different step every run; printed on failure
    hang_at = 11  # a backstop: the victim can never finish before the kill
    fault = shm / "fault.json"
    fault.write_text(json.dumps({"id": "stop", "kind": "hang", "rank": 1, "params": {"at_step": hang_at}}))
    train = ["-m", "keel.workload.fsdp", "--steps", str(_STEPS), "--batch", "4", "--lr", "1e-2", "--seed", "5",
             "--sharding", sharding]
    reference = _launch([*train, "--save-final", str(shm / "ref")], {}, shm)
    victim = _launch(train, {"KEEL_CKPT_DIR": str(shm / "node"), "KEEL_FAULT_FILE": str(fault)}, shm)
    killed = _kill_after_step(victim, kill_after)
    zero1 = sharding == "zero1"
    assert f"sharding {sharding} sharded {not zero1} zero {zero1}" in killed, killed[-2000:]
    assert f"step {kill_after} " in killed and "done steps" not in killed, (kill_after, killed[-2000:])

    trees = [decode_shard(_newest_complete_payload(shm / "node", rank))[1] for rank in range(2)]
    if zero1:
        # Every rank holds the whole model, and the AdamW state of its own partition only.
        held = [len(tree["optimizer"]["state"]) for tree in trees]
        partitions = [len(tree["optimizer"]["param_groups"][0]["params"]) for tree in trees]
        assert held == partitions and all(held), (held, partitions)
        assert trees[0]["model"].keys() == trees[1]["model"].keys() and sum(held) <= len(trees[0]["model"])
        assert all(not isinstance(v, ShardedTensor) for v in trees[1]["model"].values())
    else:
        # Each rank's local shards with their global layout.
        wte = next(v for k, v in trees[1]["model"].items() if k.endswith("weight"))
        assert isinstance(wte, ShardedTensor) and wte.placements == ("S(0)",) and wte.mesh_shape == (2,)
        assert wte.local.shape[0] * 2 >= wte.shape[0] > wte.local.shape[0] - 1
        moments = next(iter(trees[1]["optimizer"]["state"].values()))
        assert isinstance(moments["exp_avg"], ShardedTensor), moments.keys()  # keyed by parameter name (DCP)

    resumed = finish_ranks(_launch([*train, "--save-final", str(shm / "resumed")], {"KEEL_CKPT_DIR": str(shm / "node")},
                              shm))
    reference_out = finish_ranks(reference)
    match = re.search(r"restored step (\d+)", resumed)
    assert match and kill_after - 2 <= int(match.group(1)) < hang_at, (kill_after, resumed[-2000:])
    assert int(match.group(1)) + 1 == min(step_losses(resumed))
    ref_losses = step_losses(reference_out)
    assert sorted(ref_losses) == list(range(_STEPS))
    assert step_losses(killed, resumed) == ref_losses, kill_after
    for rank in range(2):
        final, ref = Path(f"{shm / 'resumed'}.rank{rank}"), Path(f"{shm / 'ref'}.rank{rank}")
        assert final.read_bytes() == ref.read_bytes(), \
            f"rank {rank}'s final state differs ({sharding}, killed after {kill_after})"


def test_another_layout_is_refused_and_the_sharded_edge_cases_hold(shm: Path) -> None:
    procs = _launch([str(_ROOT / "tests" / "fixtures" / "fsdp_layouts.py"), str(shm)], {}, shm)
    out = finish_ranks(procs)
    results = {r["case"]: r["error"] for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    assert results["fsdp->fsdp"] is None  # the same layout loads, bitwise (other weights, moments, step count before)
    assert results["tied->tied"] is None  # a weight under two names, in two FSDP units
    assert results["before-first-step"] is None  # no zero-gradient optimizer.step() behind the user's back
    assert "laid out [S(0)] on mesh (2,)" in results["fsdp->hsdp"]
    assert "[R, S(0)] on mesh (1, 2) (local [16, 16]) now (another layout)" in results["fsdp->hsdp"]
    assert results["fsdp->hsdp"].endswith("...: load every saved rank's shard with Checkpointer.load_resharded to reshard")
    # ... which loads each of them bitwise: another mesh, sharded from replicated, replicated from sharded.
    assert results["fsdp=>hsdp resharded"] is None
    assert results["plain=>fsdp resharded"] is None
    assert results["fsdp=>plain resharded"] is None
    assert results["tied=>tied resharded"] is None
    assert "a checkpoint of 2 ranks was saved without its mesh coordinate" in results["hsdp without coordinates"]
    with_optimizer, without = results["plain=>plain float64 optimizer=True"], results["plain=>plain float64 optimizer=False"]
    assert "optimizer parameters differ" in with_optimizer and with_optimizer.endswith("untouched=True")
    assert "float32[32, 16] in the checkpoint, float64[32, 16] now" in without and without.endswith("untouched=True")
    assert "a plain tensor in the checkpoint, sharded (DTensor) now" in results["plain->fsdp"]
    assert "sharded ([S(0)] on mesh (2,)) in the checkpoint, a plain tensor now" in results["fsdp->plain"]


def test_the_shard_group_is_found_from_the_live_sharded_state_and_places_backups_off_it(tmp_path: Path) -> None:
    # Four gloo ranks: the shard group each Checkpointer sends the agent (``groups["shard"]``), from the model's
    # DTensor meshes (FSDP2, HSDP) or the ZeRO optimizer's process group; none for DDP; the user's word wins.
    procs = _launch([str(_ROOT / "tests" / "fixtures" / "fsdp_shard_groups.py")], {}, tmp_path, world=4)
    out = finish_ranks(procs)
    results = {r["case"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    assert all(r["keys"] == ["dp", "pp", "shard", "tp"] for r in results.values()), results
    assert results["fsdp"]["shard"] == [[0, 1, 2, 3]] * 4  # FSDP2 on one mesh dimension: the DP group
    assert results["hsdp 2x2"]["shard"] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # the shard dimension, not the replicas
    assert results["ddp"]["shard"] == [[], [], [], []]  # replicas: nothing sharded
    assert results["zero1"]["shard"] == [[0, 1, 2, 3]] * 4  # the optimizer state's partitions
    assert results["given"]["shard"] == [[0], [1], [2], [3]]
    # The broker places those HSDP ranks (one a node) on the other replica's nodes, never next to a shard peer.
    from keel.checkpoint_broker.placement import place_backups
    from keel.checkpoint_broker.state import RankSite

    sites = [RankSite(r, f"n{r}", dp=(0, 1, 2, 3), pp=(r,), tp=(r,), shard=tuple(shard))
             for r, shard in enumerate(results["hsdp 2x2"]["shard"])]
    placed = {a.rank: a.backup_node_id for a in place_backups(sites, {f"n{r}": f"n{r}:7301" for r in range(4)})}
    assert all(int(node[1:]) // 2 != r // 2 for r, node in placed.items()), placed


def test_zero1_state_loads_into_its_partition_and_other_shardings_are_refused(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(_ROOT)})
    done = subprocess.run([sys.executable, str(_ROOT / "tests" / "fixtures" / "zero_edges.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["case"]: r for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}
    loaded = results["zero->zero"]
    assert loaded["error"] is None and loaded["params_equal"] and loaded["moments_equal"], loaded
    # The lr a scheduler set on the wrapper's groups after the last step (the local optimizer gets it only at the
    # next one) is what is saved, and restored on both.
    assert loaded["wrapper_lr"] == loaded["local_lr"] == 3e-3
    assert ("optimizer state sharded as zero1 over 1 ranks in the checkpoint, as nothing (every rank holds all) now"
            in results["zero->plain"]["error"]), results["zero->plain"]
    assert "sharded as nothing (every rank holds all) in the checkpoint, as zero1 over 1 ranks now" in \
        results["plain->zero"]["error"], results["plain->zero"]
    assert "overlap_with_ddp=True" in results["overlap_with_ddp"]["error"], results["overlap_with_ddp"]


def _common_slots(node_dir: Path, world: int) -> tuple[int, list[Path]]:
    """The newest step every rank holds in a COMPLETE slot, and those slots (rank order)."""
    held: dict[int, dict[int, Path]] = {}
    for rank in range(world):
        for index in range(2):
            path = ckpt_slots.slot_path(node_dir, rank, index)
            try:
                header = ckpt_slots.read_header(path)
            except ckpt_slots.SlotError:
                continue
            if header.complete:
                held.setdefault(header.step, {})[rank] = path
    common = [step for step, ranks in held.items() if len(ranks) == world]
    assert common, f"no step held by all {world} ranks: {sorted(held)}"
    step = max(common)
    return step, [held[step][rank] for rank in range(world)]


def test_a_job_killed_on_4_ranks_resumes_on_2_resharded_from_its_slots_exactly_as_dcp_reshards(shm: Path) -> None:
    """Issue 19's resharding: an FSDP2 job on 4 ranks is SIGKILLed at a random step, as after an eviction with no
    standby; the job goes on with 2 ranks from the 4 ranks' shared-memory slots of the newest step they all hold
    (``--reshard-from``: ``Checkpointer.load_resharded``). The reference is PyTorch's own path: the same 4-rank job
    saves that step synchronously with ``torch.distributed.checkpoint`` and a 2-rank job loads it (DCP reshards).
    Both 2-rank continuations print the same loss at every step, bitwise, and end in the same state."""
    kill_after = random.Random().randint(3, 8)
    fault = shm / "fault.json"
    fault.write_text(json.dumps({"id": "stop", "kind": "hang", "rank": 1, "params": {"at_step": 11}}))
    train = ["-m", "keel.workload.fsdp", "--steps", str(_STEPS), "--batch", "2", "--lr", "1e-2", "--seed", "5"]
    victim = _launch(train, {"KEEL_CKPT_DIR": str(shm / "node"), "KEEL_FAULT_FILE": str(fault)}, shm, world=4)
    killed = _kill_after_step(victim, kill_after, timeout_s=150)
    assert "world 4 sharding fsdp2" in killed and f"step {kill_after} " in killed, killed[-2000:]
    step, slots = _common_slots(shm / "node", 4)
    assert kill_after - 2 <= step <= kill_after + 1, (kill_after, step)

    dcp_dir = shm / "dcp"
    saver = finish_ranks(_launch([*train, "--dcp-save-at", str(step), "--dcp-dir", str(dcp_dir)], {}, shm, world=4),
                         timeout_s=150)
    assert {s: loss for s, loss in step_losses(saver).items() if s <= kill_after} == step_losses(killed)  # same run
    # Users are not locked in: plain DCP reads the 4 ranks' slots (keel.sdk.dcp.KeelStorageReader) into the very
    # tensors it reads from its own synchronous save of the same step.
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from keel.sdk.dcp import KeelStorageReader

    tensors = {k: m for k, m in dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata)}
    assert any(k.startswith("optim.state.") for k in tensors) and any(k.startswith("model.") for k in tensors)
    theirs_full = {k: torch.full(tuple(m.size), float("nan"), dtype=m.properties.dtype) for k, m in tensors.items()}
    ours_full = {k: torch.full(tuple(m.size), float("nan"), dtype=m.properties.dtype) for k, m in tensors.items()}
    dcp.load(theirs_full, storage_reader=dcp.FileSystemReader(str(dcp_dir)))
    dcp.load(ours_full, storage_reader=KeelStorageReader(slots, names={"model": "model", "optimizer": "optim"}))
    assert [k for k in tensors if not torch.equal(ours_full[k], theirs_full[k])] == []

    keel = _launch([*train, "--reshard-from", *map(str, slots), "--save-final", str(shm / "keel")], {}, shm)
    keel_out = finish_ranks(keel, timeout_s=150)
    reference = finish_ranks(_launch([*train, "--dcp-load", "--dcp-dir", str(dcp_dir), "--save-final",
                                      str(shm / "dcp-ref")], {}, shm), timeout_s=150)
    assert f"restored step {step} from 4 shards of step {step}" in keel_out and "resharded from 4 ranks to 2" in keel_out
    assert "world 2 sharding fsdp2" in keel_out and f"restored step {step} from torch.distributed.checkpoint" in reference
    keel_losses, ref_losses = step_losses(keel_out), step_losses(reference)
    assert sorted(ref_losses) == list(range(step + 1, _STEPS))
    assert keel_losses == ref_losses, (kill_after, step)
    for rank in range(2):
        ours, theirs = decode_shard(Path(f"{shm / 'keel'}.rank{rank}").read_bytes())[1], \
            decode_shard(Path(f"{shm / 'dcp-ref'}.rank{rank}").read_bytes())[1]
        for part in ("model", "optimizer", "scheduler", "sampler"):
            assert _same(ours[part], theirs[part]), f"rank {rank}'s final {part} differs (killed after {kill_after})"


def _same(a: object, b: object) -> bool:
    from keel.sdk.reshard import equal_states

    if isinstance(a, ShardedTensor) and isinstance(b, ShardedTensor):
        return (a.shape, a.placements, a.mesh_shape) == (b.shape, b.placements, b.mesh_shape) and equal_states(a.local, b.local)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return equal_states(a, b)
