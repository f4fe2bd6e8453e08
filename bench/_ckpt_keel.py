"""The rank side of the checkpoint benchmark's Keel variants: ``keel.sdk.checkpoint.Checkpointer``.

Blocking time per step = the ``snapshot(step)`` call (it captures the small state and hands the copy to
Keel's copy thread) + the time Keel's ``optimizer.step`` pre-hook waits for that copy to finish (measured
by two pre-hooks of this benchmark registered just before and just after the Checkpointer's own, so
it does not rely on Keel's self-reported ``stats()``; those are reported beside it as a cross-check).

Restore timings, each into a fresh model and optimizer through a fresh Checkpointer:

- memory: ``restore()`` from a plan naming the newest slot, the rank verifying it (the slot's XXH3-128
  beside the load into the live tensors); the trusted variant (``verified_by: agent``) and the agent's hash alone
  beside it, for comparison;
- peer (``keel`` only): ``fetch_shard`` of the backup from the peer's ``ShardStore`` over gRPC (CRC32 per
  chunk, SHA-256 of the whole) into the node's restore folder, then ``restore(path)``;
- disk (``keel`` only): the newest persisted shard (manifest read, file evicted from the page cache,
  then ``load_file`` with the manifest's SHA-256, checked beside the load).

Every restore figure includes its verification, and each is the median of ``--restore-repeats`` restores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def _alive(pid: int | None) -> bool:
    if not pid:
        return True  # not known: the deadline decides
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RankSide:
    def __init__(self, job: Any, args: argparse.Namespace) -> None:
        from keel.sdk.checkpoint import Checkpointer

        self.job, self.args = job, args
        self.node_dir = Path(args.shm_dir)
        self.node_dir.mkdir(parents=True, exist_ok=True)
        self.agent: dict[str, Any] = {}
        if args.agent_ready is not None:
            self.agent = json.loads(Path(args.agent_ready).read_text())
        self._t_before = 0.0
        self._wait = 0.0
        self._before = job.optimizer.register_step_pre_hook(self._hook_before)
        self.ck = Checkpointer(model=job.module, optimizer=job.optimizer, ckpt_dir=self.node_dir)
        self._after = job.optimizer.register_step_pre_hook(self._hook_after)
        self.last_step = -1
        self.ack: dict[str, Any] = {}

    def _hook_before(self, *_: Any) -> None:
        self._t_before = time.perf_counter()

    def _hook_after(self, *_: Any) -> None:
        self._wait += time.perf_counter() - self._t_before

    def snapshot(self, step: int) -> float:
        t0 = time.perf_counter()
        self.ck.snapshot(step)
        self.last_step = step
        return time.perf_counter() - t0

    def take_prehook_wait(self) -> float:
        wait, self._wait = self._wait, 0.0
        return wait

    def drain(self) -> None:
        self.ck.wait()

    def _handshake(self, path: Path, document: dict[str, Any], ack: Path, check: Any = None) -> dict[str, Any]:
        from bench._ckpt_agent import write_json

        write_json(path, document)
        deadline = time.monotonic() + 300
        while True:
            if ack.exists():
                answer = json.loads(ack.read_text())
                if check is None or check(answer):
                    return answer
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node agent's checkpoint process did not answer {path.name}")
            if not _alive(self.agent.get("pid")):
                raise RuntimeError(f"the node agent's checkpoint process exited before answering {path.name} "
                                   "(its log: <tag>.agent.log in the bench's scratch folder)")
            time.sleep(0.005)

    def sync_agent(self) -> None:
        """Wait until the agent has sent the newest step to the peer and no persist is running."""
        if self.args.agent_done is None:
            return
        self._sync_seq = getattr(self, "_sync_seq", 0) + 1
        seq = self._sync_seq
        sync = Path(str(self.args.agent_done) + ".sync")
        self._handshake(sync, {"seq": seq, "step": self.last_step}, Path(str(sync) + ".ack"),
                        lambda answer: answer.get("seq") == seq)

    def finish_agent(self) -> None:
        if self.args.agent_done is None or self.ack:
            return
        done = Path(self.args.agent_done)
        self.ack = self._handshake(done, {"last_step": self.last_step}, Path(str(done) + ".ack"))

    def shm_paths(self) -> list[Path]:
        return [self.node_dir]

    def _fresh_checkpointer(self) -> tuple[Any, Any]:
        from keel.sdk.checkpoint import Checkpointer

        fresh = self.job.fresh()
        return fresh, Checkpointer(model=fresh.module, optimizer=fresh.optimizer, ckpt_dir=self.node_dir)

    def restore(self) -> dict[str, Any]:
        from bench._ckpt_worker import evict_from_page_cache, timed_restores

        self.finish_agent()
        stats = self.ck.stats().summary()
        out: dict[str, Any] = {"keel_stats": stats}
        if self.ack:
            out["agent"] = self.ack
        self.ck.close()  # the rank is gone; the slots stay (the node agent owns the folder)
        repeats = self.args.restore_repeats

        # Memory tier, verification included: the plan points at the newest slot, as the agent writes it,
        # but without ``verified_by: agent``, so the rank hashes the slot (XXH3-128 on a second thread)
        # while it copies it into the live tensors, and only a match makes the restore succeed.
        from keel.agent.checkpointing import complete_slots
        from keel.checkpoint import slots as ckpt_slots

        slot, header = complete_slots(self.node_dir, 0)[0]
        plan = self.node_dir.parent / "restore-plan.json"
        entry = {"path": str(slot), "format": "slot", "digest": header.digest, "tier": "memory"}

        def memory_once(verified_by_agent: bool) -> tuple[float, bool]:
            plan.write_text(json.dumps({"generation": 1, "step": header.step, "shards": {
                "0": {**entry, **({"verified_by": "agent"} if verified_by_agent else {})}}}))
            fresh, ck = self._fresh_checkpointer()
            os.environ["KEEL_RESTORE_PLAN"] = str(plan)
            try:
                t0 = time.perf_counter()
                step = ck.restore()
                seconds = time.perf_counter() - t0
            finally:
                del os.environ["KEEL_RESTORE_PLAN"]
                ck.close()
            return seconds, step == self.last_step and fresh.same_weights(self.job)

        out["restore_s_memory"], out["restore_memory_ok"], out["restore_s_memory_runs"] = timed_restores(
            repeats, lambda: memory_once(False))
        out["restore_memory_verified"] = "rank: XXH3-128 of the slot, beside the load"
        # For comparison only (not a headline figure): the rank trusting the agent's inventory hash, and
        # that hash alone (the agent's, run while the new processes start).
        out["restore_s_memory_agent_verified"], _, _ = timed_restores(repeats, lambda: memory_once(True))

        def agent_hash_once() -> tuple[float, bool]:
            t0 = time.perf_counter()
            ckpt_slots.read_payload(slot, verify=True)
            return time.perf_counter() - t0, True

        out["restore_verify_s_memory"], _, _ = timed_restores(repeats, agent_hash_once)

        # The safety side of the copy (DLRover's variant measures the same): after a restore and one
        # training step, the slot still holds the restored step's bytes (its digest still verifies).
        fresh, ck = self._fresh_checkpointer()
        os.environ["KEEL_RESTORE_PLAN"] = str(plan)
        try:
            ck.restore()
            fresh.step()
        finally:
            del os.environ["KEEL_RESTORE_PLAN"]
            ck.close()
        try:
            after, _ = ckpt_slots.read_payload(slot, verify=True)
            out["restore_slot_changed_by_next_step"] = after.digest != header.digest
        except ckpt_slots.SlotError:
            out["restore_slot_changed_by_next_step"] = True

        if self.agent.get("address"):
            from keel.agent.shard_store import TlsMaterial, fetch_shard
            from keel.checkpoint.slots import restore_path

            dest = restore_path(self.node_dir, 0)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tls = TlsMaterial.issue(self.node_dir.parent / "credentials", self.args.job, "node", ("127.0.0.1",))
            fetch_s: list[float] = []

            def peer_once() -> tuple[float, bool]:
                fresh, ck = self._fresh_checkpointer()
                t0 = time.perf_counter()
                # fetch_shard verifies: CRC32 per chunk, SHA-256 of the whole before the file is renamed in.
                fetched = asyncio.run(fetch_shard(self.agent["address"], self.args.job, "node", 0, -1, dest, "",
                                                  timedelta(seconds=60), kind="backup", tls=tls))
                t1 = time.perf_counter()
                step = ck.restore(dest)
                seconds = time.perf_counter() - t0
                fetch_s.append(t1 - t0)
                ck.close()
                dest.unlink(missing_ok=True)
                return seconds, step == fetched.step and step == self.last_step and fresh.same_weights(self.job)

            out["restore_s_peer"], out["restore_peer_ok"], out["restore_s_peer_runs"] = timed_restores(repeats, peer_once)
            out["restore_peer_fetch_s"] = statistics.median(fetch_s)

        persists = (self.ack or {}).get("persists") or []
        if persists and self.args.persist_root is not None:
            from keel.checkpoint import disk as ckpt_disk

            newest = max(persists, key=lambda p: p["step"])
            path = Path(newest["path"])
            evicted: list[bool] = []

            def disk_once() -> tuple[float, bool]:
                evicted.append(evict_from_page_cache(path))
                fresh, ck = self._fresh_checkpointer()
                t0 = time.perf_counter()
                manifest = ckpt_disk.read_manifest(self.args.persist_root, self.args.job, newest["step"])
                shard_entry = manifest.shard(0)
                # The manifest's SHA-256 is checked beside the load, as for the memory tier.
                step = ck.load_file(manifest.path.parent / shard_entry.file, digest=shard_entry.sha256)
                seconds = time.perf_counter() - t0
                ck.close()
                return seconds, step == newest["step"]

            out["restore_s_disk"], out["restore_disk_ok"], out["restore_s_disk_runs"] = timed_restores(repeats, disk_once)
            out["restore_disk_step"] = newest["step"]
            out["restore_disk_evicted"] = all(evicted)
        return out

    def close(self) -> None:
        self.ck.close()
        self._before.remove()
        self._after.remove()
