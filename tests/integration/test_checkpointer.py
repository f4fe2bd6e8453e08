"""keel.sdk.Checkpointer for real: every-step snapshots into shared-memory slots, exact resume (in-process and
across SIGKILLed torch.distributed ranks), refusal of torn, corrupt and mismatched checkpoints, and the
optimizer pre-hook that keeps the copy consistent. No mocks: real torch, real files, real processes."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from keel.checkpoint import slots as ckpt_slots
from keel.infra.embedded import free_port
from keel.protocol import node_local_pb2 as pb
from keel.sdk import Checkpointer, CheckpointMismatchError, Session, SessionConfig
from keel.sdk.checkpoint import CheckpointCorruptError, CheckpointError
from keel.sdk.shard import decode_shard
from keel.workload.data import ShardedSampler
from tests.factories import finish_ranks, flip_byte, kill_ranks, step_losses

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _no_agent_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KEEL_CKPT_DIR", "KEEL_RESTORE_PLAN", "KEEL_RESTORE_TIMEOUT", "KEEL_AGENT_SOCKET", "KEEL_FAULT_FILE",
                 "RANK", "WORLD_SIZE", "KEEL_GENERATION"):
        monkeypatch.delenv(name, raising=False)


# -- a tiny model whose training depends on every RNG and on BatchNorm buffers ----------------------------------


class Net(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, hidden)
        self.bn = nn.BatchNorm1d(hidden)  # running stats: buffers the forward pass updates
        self.drop = nn.Dropout(0.3)  # draws from the torch RNG every step
        self.l2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(torch.relu(self.bn(self.l1(x)))))


class Counter:
    """An ``extra`` stateful object that is not torch."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


@dataclass
class Parts:
    model: Net
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: ShardedSampler
    counter: Counter

    def checkpointer(self, **kwargs: object) -> Checkpointer:
        return Checkpointer(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, sampler=self.sampler,
                            extra={"counter": self.counter}, **kwargs)  # type: ignore[arg-type]


_DATA = torch.randn(256, 9, generator=torch.Generator().manual_seed(1234))


def build(seed: int, hidden: int = 16) -> Parts:
    """Fresh objects; ``seed`` also seeds every global RNG, so a resumed run must overwrite all of them."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = Net(hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return Parts(model, optimizer, scheduler, ShardedSampler(256, batch_size=16, seed=seed), Counter())


def train(parts: Parts, start: int, stop: int, ckpt: Checkpointer | None = None) -> list[float]:
    losses = []
    for step in range(start, stop):
        idx = parts.sampler.next_indices()
        noise = torch.randn(16, 8) * 0.1 + torch.from_numpy(np.random.randn(16, 8)).float() * 0.1
        x, y = _DATA[idx, :8] + noise, _DATA[idx, 8:] * (1 + 0.1 * random.random())
        parts.optimizer.zero_grad()
        loss = nn.functional.mse_loss(parts.model(x), y)
        loss.backward()
        parts.optimizer.step()
        parts.scheduler.step()
        parts.counter.seen += len(idx)
        if ckpt is not None:
            ckpt.snapshot(step)
        losses.append(loss.item())
    return losses


def scramble_rngs() -> None:
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)


# -- (a) exact resume in one process ----------------------------------------------------------------------------


def test_resume_from_slots_is_bitwise_equal_to_an_uninterrupted_run(shm: Path) -> None:
    steps, interrupted_at = 12, 7
    reference = build(0)
    ref_losses = train(reference, 0, steps)
    ref_ckpt = reference.checkpointer()  # no ckpt_dir: snapshots off, files still work
    assert not ref_ckpt.enabled
    ref_ckpt.save_file(shm / "reference.shard", step=steps - 1)

    first = build(0)
    ckpt = first.checkpointer(ckpt_dir=shm / "slots")
    assert ckpt.restore() == -1  # empty folder: fresh
    assert train(first, 0, interrupted_at, ckpt) == ref_losses[:interrupted_at]
    ckpt.close()
    del first, ckpt

    scramble_rngs()
    second = build(5)  # other initial weights, sampler seed and RNG streams: all must be overwritten
    ckpt = second.checkpointer(ckpt_dir=shm / "slots")
    restored = ckpt.restore()
    assert restored == interrupted_at - 1 and "slot" in (ckpt.restored_from or "")
    assert train(second, restored + 1, steps, ckpt) == ref_losses[interrupted_at:]
    ckpt.close()
    ckpt.save_file(shm / "resumed.shard", step=steps - 1)
    # Every byte: parameters, BatchNorm buffers, AdamW moments and step counts, scheduler, sampler, the
    # counter and all three RNGs.
    assert (shm / "resumed.shard").read_bytes() == (shm / "reference.shard").read_bytes()
    stats = ckpt.stats()
    assert stats.snapshots == steps - interrupted_at and stats.nbytes[-1] > 0
    assert all(c > 0 for c in stats.copy_s) and stats.mean("blocking_s") >= stats.mean("capture_s")


# -- (b) SIGKILL every rank of a real torch.distributed job, relaunch, compare ----------------------------------

_STEPS = 16
_TRAIN = ["-m", "keel.workload.train", "--pp", "2", "--steps", str(_STEPS), "--batch", "4", "--micro-batches", "2",
          "--lr", "1e-2", "--seed", "3"]


def _launch(world: int, args: list[str], env_extra: dict[str, str], log_dir: Path) -> list[subprocess.Popen[str]]:
    """``world`` ranks of ``python -m keel.workload.train`` with the env:// variables set by hand."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", **env_extra})
        stdout = subprocess.PIPE if rank == 0 else open(log_dir / f"rank{rank}.out", "w")  # noqa: SIM115
        procs.append(subprocess.Popen([sys.executable, *_TRAIN, *args], env=env, stdout=stdout,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return procs








def test_sigkilled_ranks_resume_bitwise_from_their_slots(shm: Path) -> None:
    world, kill_after, hang_at = 2, 5, 12
    fault = shm / "fault.json"  # a backstop: the job can never finish before the kill
    fault.write_text(json.dumps({"id": "stop", "kind": "hang", "rank": 1, "params": {"at_step": hang_at}}))
    reference = _launch(world, ["--save-final", str(shm / "ref")], {}, shm)
    victim = _launch(world, [], {"KEEL_CKPT_DIR": str(shm / "node"), "KEEL_FAULT_FILE": str(fault)}, shm)
    watchdog = threading.Timer(90, kill_ranks, [victim])
    watchdog.start()
    killed_output = []
    try:
        assert victim[0].stdout is not None
        for line in victim[0].stdout:
            killed_output.append(line)
            if line.startswith(f"step {kill_after} "):
                kill_ranks(victim)  # mid-run: copies may be in flight, ranks may be a step apart
                break
    finally:
        watchdog.cancel()
        kill_ranks(victim)
    killed = "".join(killed_output)
    assert f"step {kill_after} " in killed and "done steps" not in killed, killed[-2000:]
    slots = ckpt_slots.list_slots(shm / "node")
    assert sorted(slots) == [0, 1], slots

    resumed = finish_ranks(_launch(world, ["--save-final", str(shm / "resumed")], {"KEEL_CKPT_DIR": str(shm / "node")}, shm))
    reference_out = finish_ranks(reference)
    match = re.search(r"restored step (\d+)", resumed)
    assert match and kill_after - 2 <= int(match.group(1)) < hang_at, resumed[-2000:]
    assert int(match.group(1)) + 1 == min(step_losses(resumed))  # continues at the next step
    ref_losses = step_losses(reference_out)
    assert sorted(ref_losses) == list(range(_STEPS))
    assert step_losses(killed, resumed) == ref_losses
    for rank in range(world):
        final, ref = Path(f"{shm / 'resumed'}.rank{rank}"), Path(f"{shm / 'ref'}.rank{rank}")
        assert final.read_bytes() == ref.read_bytes(), f"rank {rank}'s final state differs"


# -- (c) torn and corrupt slots --------------------------------------------------------------------------------


def _run_with_slots(directory: Path, steps: int, **kwargs: object) -> Parts:
    parts = build(0)
    ckpt = parts.checkpointer(ckpt_dir=directory, **kwargs)
    train(parts, 0, steps, ckpt)
    ckpt.close()
    return parts


def test_corrupt_newest_slot_falls_back_to_the_older_one(shm: Path, caplog: pytest.LogCaptureFixture) -> None:
    _run_with_slots(shm, 4)  # slot0 holds step 2, slot1 step 3
    assert ckpt_slots.read_header(ckpt_slots.slot_path(shm, 0, 1)).step == 3
    reference = build(0)
    train(reference, 0, 3)
    reference.checkpointer().save_file(shm / "step2.shard", step=2)

    flip_byte(ckpt_slots.slot_path(shm, 0, 1), ckpt_slots.HEADER_BYTES + 5000)
    parts = build(1)
    ckpt = parts.checkpointer(ckpt_dir=shm)
    with caplog.at_level(logging.WARNING, logger="keel.sdk"):
        assert ckpt.restore() == 2
    assert "digest mismatch for step 3" in caplog.text
    ckpt.save_file(shm / "restored.shard", step=2)
    assert (shm / "restored.shard").read_bytes() == (shm / "step2.shard").read_bytes()
    # The explicit path to the corrupt slot is an error, not a silent fallback.
    with pytest.raises(CheckpointError, match="digest mismatch"):
        ckpt.load_file(ckpt_slots.slot_path(shm, 0, 1))
    ckpt.close()


def test_torn_and_truncated_slots_mean_a_fresh_start(shm: Path, caplog: pytest.LogCaptureFixture) -> None:
    _run_with_slots(shm, 4)
    # A crash in the middle of a copy: the header says WRITING.
    torn = ckpt_slots.SlotWriter(ckpt_slots.slot_path(shm, 0, 1), 1 << 20)
    torn.begin(4, 0)
    torn.close()
    os.truncate(ckpt_slots.slot_path(shm, 0, 0), ckpt_slots.HEADER_BYTES + 100)
    parts = build(1)
    before = [p.detach().clone() for p in parts.model.parameters()]
    ckpt = parts.checkpointer(ckpt_dir=shm)
    with caplog.at_level(logging.WARNING, logger="keel.sdk"):
        assert ckpt.restore() == -1
    assert "not complete" in caplog.text and "truncated payload" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, parts.model.parameters()))
    ckpt.close()


def test_truncated_shard_file_is_refused(shm: Path) -> None:
    parts = build(0)
    ckpt = parts.checkpointer()
    ckpt.save_file(shm / "full.shard", step=0)
    data = (shm / "full.shard").read_bytes()
    (shm / "cut.shard").write_bytes(data[: len(data) - 64])
    with pytest.raises(CheckpointError, match="truncated"):
        ckpt.restore(shm / "cut.shard")
    with pytest.raises(CheckpointError, match="digest mismatch"):
        ckpt.load_file(shm / "full.shard", digest="0" * 64)
    assert ckpt.restore(shm / "full.shard") == 0


# -- (d) a checkpoint of another topology or model is refused -------------------------------------------------


def test_mismatched_topology_rank_and_model_are_refused(shm: Path) -> None:
    saved = build(0)
    train(saved, 0, 2)
    groups = {"dp": [0, 1], "pp": [0], "tp": [0]}
    saved.checkpointer(rank=0, world_size=2, groups=groups).save_file(shm / "r0.shard", step=1)
    saved.checkpointer(rank=1, world_size=2, groups={"dp": [0, 1], "pp": [1], "tp": [1]}).save_file(
        shm / "r1.shard", step=1)

    parts = build(1)
    before = [p.detach().clone() for p in parts.model.parameters()]
    cases = [
        (parts.checkpointer(rank=0, world_size=1), "r0.shard", "world size 2 in the checkpoint, 1 now"),
        (parts.checkpointer(rank=0, world_size=2, groups={"dp": [0], "pp": [0, 1], "tp": [0]}), "r0.shard",
         r"parallel groups differ .*dp \[0, 1\] -> \[0\], pp \[0\] -> \[0, 1\]"),
        (parts.checkpointer(rank=0, world_size=2, groups=groups), "r1.shard", "rank 1's shard, this is rank 0"),
    ]
    for ckpt, name, message in cases:
        with pytest.raises(CheckpointMismatchError, match=message):
            ckpt.restore(shm / name)
    other = build(1, hidden=24)
    with pytest.raises(CheckpointMismatchError, match=r"model differs: l1\.weight: float32\[16, 8\] in checkpoint, "
                                                       r"float32\[24, 8\] now"):
        other.checkpointer(rank=0, world_size=2, groups=groups).restore(shm / "r0.shard")
    fewer = Checkpointer(model=parts.model, optimizer=parts.optimizer, rank=0, world_size=2, groups=groups)
    with pytest.raises(CheckpointMismatchError, match="components differ"):
        fewer.restore(shm / "r0.shard")
    # Nothing was loaded by a refused restore.
    assert all(torch.equal(a, b) for a, b in zip(before, parts.model.parameters()))
    assert parts.checkpointer(rank=0, world_size=2, groups=groups).restore(shm / "r0.shard") == 1


# -- (e) the optimizer pre-hook waits for the copy ------------------------------------------------------------


def test_pre_hook_blocks_until_the_copy_is_complete(shm: Path) -> None:
    parts = build(0)
    ckpt = parts.checkpointer(ckpt_dir=shm)
    delay_s = 0.4
    copy_started = threading.Event()

    def slow_copy(step: int) -> None:  # runs in the copy thread before the tensors are copied
        copy_started.set()
        time.sleep(delay_s)

    ckpt.copy_hook = slow_copy
    train(parts, 0, 1, ckpt)
    expected = {k: v.detach().clone() for k, v in parts.model.state_dict().items()}
    assert copy_started.wait(5)
    t0 = time.perf_counter()
    train(parts, 1, 2)  # no snapshot: its optimizer.step must wait for the copy of step 0 first
    assert time.perf_counter() - t0 >= delay_s * 0.5
    ckpt.copy_hook = None
    wait_s = ckpt.stats().wait_s
    assert len(wait_s) == 1 and wait_s[0] >= delay_s * 0.5
    header, payload = ckpt_slots.read_payload(ckpt_slots.slot_path(shm, 0, 0))
    assert header.complete and header.step == 0
    _, tree = decode_shard(payload)
    for key, value in expected.items():  # the state of step 0, not the one step 1 wrote after it
        assert torch.equal(tree["model"][key], value), key
    assert not torch.equal(parts.model.l1.weight, expected["l1.weight"])
    ckpt.close()


# -- restore plans and the agent channel ---------------------------------------------------------------------


def test_restore_plan_is_waited_for_verified_and_followed(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = build(0)
    train(saved, 0, 3)
    saved.checkpointer().save_file(shm / "restore" / "rank0.shard", step=2)
    expected = train(saved, 3, 5)  # the global RNGs continue from the saved point here
    digest = ckpt_slots.sha256_hex((shm / "restore" / "rank0.shard").read_bytes())
    plan = shm / "g1.json"
    monkeypatch.setenv("KEEL_RESTORE_PLAN", str(plan))
    document = {"generation": 1, "step": 2, "shards": {"0": {"path": str(shm / "restore" / "rank0.shard"),
                                                              "format": "shard", "digest": digest, "tier": "peer"}}}

    def write_later() -> None:
        time.sleep(0.3)
        ckpt_slots.write_file_atomic(plan, json.dumps(document).encode())

    writer = threading.Thread(target=write_later)
    writer.start()
    parts = build(1)
    ckpt = parts.checkpointer(ckpt_dir=shm / "slots")
    t0 = time.monotonic()
    assert ckpt.restore() == 2 and time.monotonic() - t0 >= 0.25
    writer.join()
    assert "tier peer" in (ckpt.restored_from or "")
    assert train(parts, 3, 5) == expected

    document["shards"]["0"]["digest"] = "f" * 64
    ckpt_slots.write_file_atomic(plan, json.dumps(document).encode())
    with pytest.raises(CheckpointError, match="digest mismatch"):
        ckpt.restore()
    ckpt_slots.write_file_atomic(plan, json.dumps({"generation": 1, "step": -1, "shards": {}}).encode())
    assert ckpt.restore() == -1
    monkeypatch.setenv("KEEL_RESTORE_PLAN", str(shm / "never.json"))
    with pytest.raises(CheckpointError, match="did not appear"):
        ckpt.restore(timeout=timedelta(milliseconds=200))
    ckpt.close()


def test_under_an_agent_a_snapshot_before_restore_is_refused(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The slots may hold what the plan points at: snapshotting first could overwrite it.
    monkeypatch.setenv("KEEL_RESTORE_PLAN", str(shm / "g1.json"))
    parts = build(0)
    ckpt = parts.checkpointer(ckpt_dir=shm / "slots")
    with pytest.raises(CheckpointError, match="before restore"):
        ckpt.snapshot(0)
    ckpt_slots.write_file_atomic(shm / "g1.json", json.dumps({"generation": 1, "step": -1, "shards": {}}).encode())
    assert ckpt.restore() == -1
    ckpt.snapshot(0)
    ckpt.close()
    assert ckpt_slots.read_header(ckpt_slots.slot_path(shm / "slots", 0, 0)).step == 0


def test_session_step_done_snapshots_and_reports_the_complete_step(shm: Path) -> None:
    sock_path = str(shm / "agent.sock")
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(sock_path)
    try:
        session = Session(SessionConfig(rank=0, world_size=1, agent_socket=sock_path,
                                        heartbeat_interval=timedelta(minutes=10)))
        parts = build(0)
        ckpt = parts.checkpointer(session=session, ckpt_dir=shm / "slots", groups={"dp": [0], "pp": [0], "tp": [0]})
        with session.phase("step"):
            for step in range(3):
                train(parts, step, step + 1)  # no explicit snapshot: step_done takes it
                session.step_done(step, loss=1.0)
        ckpt.close()
        session.done()
        assert ckpt.last_complete_step == 2 and ckpt.stats().snapshots == 3
        reports = []
        agent.settimeout(0.2)
        try:
            while True:
                reports.append(pb.RankReport.FromString(agent.recv(65536)))
        except TimeoutError:
            pass
        steps = [r.checkpoint_step for r in reports if r.HasField("checkpoint_step")]
        assert steps and steps[-1] == 2 and sorted(set(steps)) == [0, 1, 2]
        # Nothing sharded (a plain model): no shard group.
        assert json.loads(reports[-1].checkpoint_groups_json) == {"dp": [0], "pp": [0], "tp": [0], "shard": []}
        assert not reports[0].HasField("checkpoint_step")
    finally:
        agent.close()


def test_stats_report_blocking_and_copy_times(shm: Path) -> None:
    parts = build(0)
    ckpt = parts.checkpointer(ckpt_dir=shm)
    train(parts, 0, 20, ckpt)
    ckpt.close()
    stats = ckpt.stats()
    summary = stats.summary()
    assert stats.snapshots == 20 and summary["snapshots"] == 20
    assert summary["bytes"] == stats.nbytes[-1] > 0
    for name in ("capture", "wait", "blocking", "copy", "hash"):
        assert 0 <= summary[f"{name}_mean_s"] <= summary[f"{name}_p99_s"] < 5, name
    assert all(math.isclose(b, c + w) for b, c, w in zip(stats.blocking_s, stats.capture_s, stats.wait_s))
    # The running total the agent reports for ETTR: every snapshot's blocking, not only the stats' window.
    assert math.isclose(ckpt.blocking_total_s, sum(stats.blocking_s)) and ckpt.blocking_total_s > 0


# -- (d) the fast restore path: straight into the live tensors, verified in the same pass ----------------------


def _plan_for_slot(shm: Path, monkeypatch: pytest.MonkeyPatch, slot: Path, **extra: object) -> None:
    header = ckpt_slots.read_header(slot)
    plan = shm / "plan.json"
    ckpt_slots.write_file_atomic(plan, json.dumps({"generation": 1, "step": header.step, "shards": {"0": {
        "path": str(slot), "format": "slot", "digest": header.digest, "tier": "memory", **extra}}}).encode())
    monkeypatch.setenv("KEEL_RESTORE_PLAN", str(plan))


def test_fast_restore_loads_in_place_bitwise_and_owns_its_optimizer_state(shm: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _run_with_slots(shm / "slots", 4)  # slot1 holds step 3
    slot = ckpt_slots.slot_path(shm / "slots", 0, 1)
    reference = build(0)
    train(reference, 0, 4)
    reference.checkpointer().save_file(shm / "step3.shard", step=3)
    expected = train(reference, 4, 8)

    _plan_for_slot(shm, monkeypatch, slot)  # no verified_by: the rank hashes the slot while it loads
    scramble_rngs()
    parts = build(7)
    params_before = {name: (p, p.data_ptr()) for name, p in parts.model.named_parameters()}
    ckpt = parts.checkpointer()
    assert ckpt.restore() == 3
    # In place: the same parameter tensors, same storage (no intermediate tensors swapped in).
    for name, p in parts.model.named_parameters():
        assert p is params_before[name][0] and p.data_ptr() == params_before[name][1]
    ckpt.save_file(shm / "restored.shard", step=3)
    assert (shm / "restored.shard").read_bytes() == (shm / "step3.shard").read_bytes()
    # The optimizer's state is its own memory, not the mapped slot: rewriting the slot changes nothing.
    moments = [s["exp_avg"].clone() for s in parts.optimizer.state.values()]
    with open(slot, "r+b") as f:
        f.seek(ckpt_slots.HEADER_BYTES)
        f.write(b"\0" * (slot.stat().st_size - ckpt_slots.HEADER_BYTES))
    assert all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, parts.optimizer.state.values()))
    assert train(parts, 4, 8) == expected
    ckpt.close()


def test_fast_restore_refuses_a_flipped_byte_clearly_and_blocks_snapshots(shm: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _run_with_slots(shm / "slots", 4)
    slot = ckpt_slots.slot_path(shm / "slots", 0, 1)
    header = ckpt_slots.read_header(slot)
    pristine = slot.read_bytes()
    # A byte deep in the tensor region (the header stays valid and COMPLETE: only the hash can tell).
    flip_byte(slot, ckpt_slots.HEADER_BYTES + header.payload_len - 7)
    _plan_for_slot(shm, monkeypatch, slot)
    parts = build(1)
    ckpt = parts.checkpointer(ckpt_dir=shm / "new-slots")
    # The local restore checks the slot's XXH3-128 (the fast digest), not its SHA-256.
    with pytest.raises(CheckpointCorruptError, match=r"digest mismatch for step 3 \(expected XXH3-128 .*corrupt.*"
                                                     r"must not be used"):
        ckpt.restore()
    assert ckpt.restored_from is None
    # Whatever reached the model cannot be mistaken for a checkpoint: snapshots are refused ...
    with pytest.raises(CheckpointError, match="refused: the last restore failed verification"):
        ckpt.snapshot(4)
    assert ckpt_slots.list_slots(shm / "new-slots") == {}
    # ... until a restore verifies (here the same slot, repaired).
    slot.write_bytes(pristine)
    assert ckpt.restore() == 3
    ckpt.snapshot(4)
    ckpt.close()


def test_slot_restore_without_a_plan_raises_when_a_corrupt_slot_was_loaded_and_none_verifies(shm: Path) -> None:
    from keel.sdk.checkpoint import CheckpointCorruptError

    _run_with_slots(shm, 4)
    for index in (0, 1):
        path = ckpt_slots.slot_path(shm, 0, index)
        flip_byte(path, ckpt_slots.HEADER_BYTES + ckpt_slots.read_header(path).payload_len - 3)
    ckpt = build(1).checkpointer(ckpt_dir=shm)
    # Not "start fresh": the model already holds bytes of a corrupt slot.
    with pytest.raises(CheckpointCorruptError, match="no slot .* verified"):
        ckpt.restore()
    ckpt.close()


def test_a_step_taken_again_rewrites_its_own_slot_and_only_the_newest_step_can_be(tmp_path: Path) -> None:
    """``snapshot(step, again=True)``: the state after ``step`` changed without a new step (an evaluation drew from
    the RNGs): the slot of ``step`` holds the new state; a plain second call does nothing; an older step is refused."""
    model = nn.Linear(4, 2)
    with Checkpointer(model=model, rank=0, world_size=1, ckpt_dir=tmp_path) as ckpt:
        ckpt.snapshot(0)
        torch.manual_seed(7)
        ckpt.snapshot(1)
        ckpt.wait()
        slot1 = ckpt_slots.slot_path(tmp_path, 0, 1)
        before = ckpt_slots.read_payload(slot1, verify=True)[0].digest
        torch.rand(3)  # an evaluation's draw
        ckpt.snapshot(1)  # the same step: nothing
        ckpt.wait()
        assert ckpt_slots.read_payload(slot1, verify=True)[0].digest == before
        ckpt.snapshot(1, again=True)
        ckpt.wait()
        header, payload = ckpt_slots.read_payload(slot1, verify=True)
        assert header.step == 1 and header.digest != before
        _, tree = decode_shard(payload)
        assert torch.equal(tree["rng"]["torch"], torch.get_rng_state())
        assert ckpt_slots.read_payload(ckpt_slots.slot_path(tmp_path, 0, 0), verify=True)[0].step == 0
        with pytest.raises(CheckpointError, match="only the newest step can be taken again"):
            ckpt.snapshot(0, again=True)


# -- (f) a persistent-tier step of another world size ----------------------------------------------------------


def test_a_persistent_step_of_two_ranks_restores_into_one_and_trains_on_exactly(shm: Path) -> None:
    """``restore(step_dir)``: every rank's shard of a committed step (each verified against the manifest), fitted to
    this run's world size: a replicated model and optimizer come from rank 0, the sampler deals the epoch's rest,
    and the run goes on bitwise as the saving one would have; a shard that fails its digest loads nothing."""
    from keel.checkpoint import disk

    saved = build(0)
    train(saved, 0, 2)
    root = shm / "persist"
    written = []
    for rank in range(2):
        groups = {"dp": [0, 1], "pp": [rank], "tp": [rank]}
        payload = (shm / f"r{rank}.shard")
        saved.checkpointer(rank=rank, world_size=2, groups=groups).save_file(payload, step=1)
        written.append(disk.write_shard(root, "job", 1, rank, payload.read_bytes()))
    disk.write_manifest(root, "job", 1, 2, [{"rank": r, "bytes": w.bytes, "sha256": w.sha256} for r, w in enumerate(written)])
    step_dir = disk.step_dir(root, "job", 1)
    reference = train(saved, 2, 5)

    resumed = build(7)
    ckpt = resumed.checkpointer(rank=0, world_size=1)
    with pytest.raises(CheckpointMismatchError, match="world size 2 in the checkpoint, 1 now: load every saved rank"):
        ckpt.restore(step_dir / "rank-00000.shard")
    assert ckpt.restore(step_dir) == 1 and "resharded from 2 ranks to 1" in str(ckpt.restored_from)
    assert train(resumed, 2, 5) == reference

    shard = step_dir / "rank-00001.shard"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    fresh = build(8)
    before = [p.detach().clone() for p in fresh.model.parameters()]
    with pytest.raises(CheckpointCorruptError, match="SHA-256 mismatch .*the checkpoint is corrupt"):
        fresh.checkpointer(rank=0, world_size=1).restore(step_dir)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.model.parameters(), strict=True))


def test_an_agents_reshard_plan_restores_two_saved_ranks_into_one_and_trains_on_exactly(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan for a job the controller shrank (``reshard``: every saved rank's staged shard): the rank loads its part
    resharded, bitwise as the saving run goes on; a saved rank the agent could not stage is named, nothing loaded."""
    saved = build(0)
    train(saved, 0, 2)
    shards = {}
    for rank in range(2):
        path = shm / "restore" / f"rank{rank}.shard"
        saved.checkpointer(rank=rank, world_size=2, groups={"dp": [0, 1], "pp": [rank], "tp": [rank]}).save_file(
            path, step=1)
        shards[str(rank)] = {"path": str(path), "format": "shard", "tier": "peer",
                             "digest": ckpt_slots.sha256_hex(path.read_bytes())}
    reference = train(saved, 2, 5)
    plan = shm / "g1.json"
    monkeypatch.setenv("KEEL_RESTORE_PLAN", str(plan))
    document = {"generation": 1, "step": 1, "shards": {}, "reshard": {"world_size": 2, "shards": shards}}
    ckpt_slots.write_file_atomic(plan, json.dumps(document).encode())
    resumed = build(7)
    ckpt = resumed.checkpointer(rank=0, world_size=1)
    assert ckpt.restore() == 1
    assert "resharded from 2 ranks to 1" in str(ckpt.restored_from) and "via plan g1.json" in str(ckpt.restored_from)
    assert train(resumed, 2, 5) == reference

    document["reshard"]["shards"]["1"] = {"error": "fetching rank 1 step 1 from its peer failed: unreachable"}
    ckpt_slots.write_file_atomic(plan, json.dumps(document).encode())
    fresh = build(8)
    before = [p.detach().clone() for p in fresh.model.parameters()]
    with pytest.raises(CheckpointError, match="saved rank 1: fetching rank 1 step 1 from its peer failed"):
        fresh.checkpointer(rank=0, world_size=1).restore()
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.model.parameters(), strict=True))
    document["reshard"] = {"world_size": "two", "shards": shards}
    ckpt_slots.write_file_atomic(plan, json.dumps(document).encode())
    with pytest.raises(CheckpointError, match="reshard part is not valid"):
        fresh.checkpointer(rank=0, world_size=1).restore()
