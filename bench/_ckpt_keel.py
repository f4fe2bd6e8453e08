"""The rank side of the checkpoint benchmark's Keel variants: ``keel.sdk.checkpoint.Checkpointer``.

Blocking time per step = the ``snapshot(step)`` call (it captures the small state and hands the copy to
Keel's copy thread) + the time Keel's ``optimizer.step`` pre-hook waits for that copy to finish (measured
by two pre-hooks of this benchmark registered just before and just after the Checkpointer's own, so
it does not rely on Keel's self-reported ``stats()``; those are reported beside it as a cross-check).

Restore timings, each into a fresh model and optimizer through a fresh Checkpointer:

- memory: ``restore()`` from the slot folder (verifies the slots' SHA-256, loads the newest);
- peer (``keel`` only): ``fetch_shard`` of the backup from the peer's ``ShardStore`` over gRPC (CRC32 per
  chunk, SHA-256 of the whole) into the node's restore folder, then ``restore(path)``;
- disk (``keel`` only): the newest persisted shard (manifest read, file evicted from the page cache,
  then ``load_file`` with the manifest's SHA-256).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


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
                raise RuntimeError(f"the simulated node agent did not answer {path.name}")
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
        from bench._ckpt_worker import evict_from_page_cache

        self.finish_agent()
        stats = self.ck.stats().summary()
        out: dict[str, Any] = {"keel_stats": stats}
        if self.ack:
            out["agent"] = self.ack
        self.ck.close()  # the rank is gone; the slots stay (the node agent owns the folder)

        # Memory tier, as a restart does it: the node agent's inventory hashes the slots (while the new
        # processes start), the broker plans, the agent writes the plan; the rank loads its slot.
        from keel.agent.checkpointing import complete_slots
        from keel.checkpoint import slots as ckpt_slots

        t0 = time.perf_counter()
        slot, header = complete_slots(self.node_dir, 0)[0]
        ckpt_slots.read_payload(slot, verify=True)
        out["restore_verify_s_memory"] = time.perf_counter() - t0
        plan = self.node_dir.parent / "restore-plan.json"
        plan.write_text(json.dumps({"generation": 1, "step": header.step, "shards": {"0": {
            "path": str(slot), "format": "slot", "digest": header.digest, "tier": "memory", "verified_by": "agent"}}}))
        fresh, ck = self._fresh_checkpointer()
        os.environ["KEEL_RESTORE_PLAN"] = str(plan)
        try:
            t0 = time.perf_counter()
            step = ck.restore()
            out["restore_s_memory"] = time.perf_counter() - t0
        finally:
            del os.environ["KEEL_RESTORE_PLAN"]
        out["restore_memory_step"] = step
        out["restore_memory_ok"] = step == self.last_step and fresh.same_weights(self.job)
        ck.close()
        # The same, with the rank hashing the slot itself (no plan; the slot folder's newest slot).
        fresh, ck = self._fresh_checkpointer()
        t0 = time.perf_counter()
        ck.restore()
        out["restore_s_memory_rank_verified"] = time.perf_counter() - t0
        ck.close()

        if self.agent.get("address"):
            from keel.agent.shard_store import TlsMaterial, fetch_shard
            from keel.checkpoint.slots import restore_path

            dest = restore_path(self.node_dir, 0)
            dest.parent.mkdir(parents=True, exist_ok=True)
            fresh, ck = self._fresh_checkpointer()
            t0 = time.perf_counter()
            tls = TlsMaterial.issue(self.node_dir.parent / "credentials", self.args.job, "node", ("127.0.0.1",))
            fetched = asyncio.run(fetch_shard(self.agent["address"], self.args.job, "node", 0, -1, dest, "",
                                              timedelta(seconds=60), kind="backup", tls=tls))
            t1 = time.perf_counter()
            step = ck.restore(dest)
            out["restore_s_peer"] = time.perf_counter() - t0
            out["restore_peer_fetch_s"] = t1 - t0
            out["restore_peer_step"] = step
            out["restore_peer_ok"] = step == fetched.step and step == self.last_step and fresh.same_weights(self.job)
            ck.close()
            dest.unlink(missing_ok=True)

        persists = (self.ack or {}).get("persists") or []
        if persists and self.args.persist_root is not None:
            from keel.checkpoint import disk as ckpt_disk

            newest = max(persists, key=lambda p: p["step"])
            path = Path(newest["path"])
            out["restore_disk_evicted"] = evict_from_page_cache(path)
            fresh, ck = self._fresh_checkpointer()
            t0 = time.perf_counter()
            manifest = ckpt_disk.read_manifest(self.args.persist_root, self.args.job, newest["step"])
            entry = manifest.shard(0)
            step = ck.load_file(manifest.path.parent / entry.file, digest=entry.sha256)
            out["restore_s_disk"] = time.perf_counter() - t0
            out["restore_disk_step"] = step
            out["restore_disk_ok"] = step == newest["step"]
            ck.close()
        return out

    def close(self) -> None:
        self.ck.close()
        self._before.remove()
        self._after.remove()
