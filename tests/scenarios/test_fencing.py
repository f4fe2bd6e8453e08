"""A host evicted while it could not be reached comes back with its old agent and ranks, and is fenced.

A local cluster of 4 nodes x 1 rank (the example GPT, DP 2 x PP 2) plus a warm standby, with the controller,
checkpoint broker, analyzer and local actuator as services. One node is frozen (every process SIGSTOPped,
unreachable to the actuator, as a host whose link is cut): past ``node_silence_timeout`` the controller
evicts it (the actuator cannot drain it: ``NodeEvicted`` failed), promotes the standby and the job resumes
as the next generation. Then the host comes back (SIGCONT): its stale agent learns it was evicted, stops its
ranks and leaves; none of its ranks appears in the new generation; whatever it reported as a member is
recorded by the controller as ignored (``NodeFenced``); a backup of its stale generation is refused by the
live shard stores; and the job finishes, resuming bitwise where it left off.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import grpc
import pytest

from keel.agent.checkpointing import SENT_DIR
from keel.agent.fencing import FENCE_FILE
from keel.agent.shard_store import ShardSender, TlsMaterial, TransferRejected
from keel.checkpoint.slots import SlotError, list_slots, read_header
from keel.cluster.local import alive, freeze_node, load_cluster, thaw_node
from keel.infra.config import credentials_path
from keel.infra.shard_ca import issue_node_certificate
from tests.scenarios.test_ladder import Stack

pytestmark = pytest.mark.integration

STEPS = 480
"""Below hot-update's 500-step stability window: no hot-update service runs here, so none may be due."""
TRAIN = ["-m", "keel.workload.train", "--size", "tiny", "--pp", "2", "--steps", str(STEPS), "--min-step-time", "80ms"]


@pytest.fixture
async def stack(keel_env, scratch_dir):  # type: ignore[no-untyped-def]
    await keel_env.start_recorder()
    running = Stack(keel_env, scratch_dir, "fence")
    try:
        yield running
    finally:
        await asyncio.to_thread(running.stop)


def logged_losses(path: Path) -> dict[int, str]:
    text = path.read_text() if path.exists() else ""
    return {int(m[0]): m[1] for m in re.findall(r"^step (\d+) loss (\S+) grad_norm (\S+)", text, re.M)}


async def put_stale_backup(stack: Stack, victim: str, rank: int, address: str) -> TransferRejected:
    """Offer ``address``'s store a backup of ``rank`` from ``victim``'s sent ring (its old generation's
    shard), as its stale agent would, with its own certificate of the job's CA."""
    node_dir = Path(next(n for n in load_cluster(stack.directory)["nodes"] if n["node_id"] == victim)["ckpt_dir"])
    steps = []
    for path in list_slots(node_dir / SENT_DIR).get(rank, []):
        try:
            header = read_header(path)
        except SlotError:
            continue
        if header.complete:
            steps.append(header.step)
    assert steps, f"{victim} holds no sent copy of rank {rank} under {node_dir / SENT_DIR}"
    tls = TlsMaterial.load(issue_node_certificate(credentials_path(stack.settings), stack.job, victim,
                                                  hosts=("127.0.0.1",)))
    sender = ShardSender(stack.job, victim, node_dir / SENT_DIR, tls=tls)
    try:
        await sender.send(address, rank, max(steps))
    except TransferRejected as exc:
        return exc
    finally:
        await sender.close()
    raise AssertionError(f"{address} accepted a backup of the fenced {victim}'s old generation")


async def test_a_host_back_after_its_eviction_is_fenced_at_every_layer(stack: Stack) -> None:
    started = time.monotonic()
    await asyncio.to_thread(stack.start, nodes=4, standby=1, command=TRAIN,
                            extra={"KEEL_CONTROLLER__NODE_SILENCE_TIMEOUT": "10s"})
    await stack.wait_for(["StandbyChecked"], lambda e: e.payload.passed, 120, "the standby's self-check")
    await stack.wait_for(["CheckpointStepCommitted"], lambda e: e.payload.tier == "peer" and e.payload.step >= 5,
                         90, "a peer-tier commit past step 5")
    victim = stack.node_of_rank(1)
    agent_dir = Path(next(n for n in load_cluster(stack.directory)["nodes"] if n["node_id"] == victim)["agent_dir"])
    stale = json.loads((agent_dir / "agent.json").read_text())
    stale_pids = [ref[0] for ref in stale["ranks"].values()]
    agent_pid = stale["agent"][0]

    # The host freezes (its link cut): evicted on silence, not drained, replaced by the standby.
    frozen = await asyncio.to_thread(freeze_node, stack.directory, victim)
    assert agent_pid in frozen and set(stale_pids) <= set(frozen)
    # Two paths find it, whichever comes first: its silence past node_silence_timeout (a lost_node
    # incident on the victim), or its peers hanging in a collective for 5 s (a hang incident on a peer)
    # whose stack capture the victim never acknowledges. Either way the victim is evicted as lost.
    eviction = await stack.wait_for(["NodeEvictionDecided"], lambda e: e.payload.node_id == victim, 90, "the eviction")
    [opened] = [e for e in await stack.events(["IncidentOpened"]) if e.id == eviction.correlation_id]
    if opened.payload.kind == "lost_node":
        assert opened.payload.node_id == victim, opened.payload
    else:
        assert opened.payload.kind == "hang" and opened.payload.node_id != victim, opened.payload
    assert "lost" in eviction.payload.reason, eviction.payload.reason
    failed = await stack.wait_for(["NodeEvicted"], lambda e: e.payload.node_id == victim, 60, "the actuator's report")
    assert failed.payload.outcome == "failed" and "unreachable" in failed.payload.detail, failed.payload
    resolved = await stack.wait_for(["IncidentResolved"], lambda e: e.payload.incident_id == str(opened.id), 120,
                                    "the recovery")
    assert resolved.payload.outcome == "recovered", resolved.payload
    [restart] = [e for e in await stack.events(["RestartDecided"]) if e.correlation_id == opened.id]
    generation = restart.payload.generation
    assert [p.replaces_node_id for p in restart.payload.promotions] == [victim]
    plan = await stack.wait_for(["CheckpointRestorePlanned"], lambda e: e.payload.generation == generation, 30, "the plan")
    await stack.stepping(plan.payload.step + 20)
    thawed_at_step = max(e.payload.last_step for e in await stack.events(["NodeHeartbeat"]))

    # The host comes back with its old agent and ranks. A backup of its old generation is refused by the
    # live shard stores (offered at once, as its stale agent could before it hears of its eviction).
    await asyncio.to_thread(thaw_node, stack.directory, victim)
    registered = [e for e in await stack.events(["CheckpointRanksRegistered"]) if e.payload.generation == generation
                  and e.payload.node_id != victim]
    refused = await put_stale_backup(stack, victim, 1, registered[0].payload.store_address)
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and "stale history" in refused.reason, refused
    # Its agent fences itself and leaves.
    deadline = time.monotonic() + 60
    while (alive(agent_pid) or any(alive(pid) for pid in stale_pids)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not alive(agent_pid), f"the fenced agent of {victim} still runs; see {agent_dir}/logs"
    assert not any(alive(pid) for pid in stale_pids), "a stale rank survived its fenced agent"
    fence = json.loads((agent_dir / FENCE_FILE).read_text())
    assert (fence["job_id"], fence["node_id"], fence["generation"]) == (stack.job, victim, 0), fence
    assert fence["decision_id"] == str(eviction.id) or "fenced" in fence["reason"], fence

    # The controller: whatever the stale node sent as a member after its eviction is recorded as ignored.
    after = [e for e in await stack.events() if e.producer == "agent" and getattr(e.payload, "node_id", "") == victim
             and e.occurred_at > eviction.occurred_at]
    acted = [e for e in after if (e.type == "NodeHeartbeat" and e.payload.ranks_alive > 0)
             or (e.type == "RankExited" and e.payload.classification != "stopped_by_agent")]
    fenced = [e for e in await stack.events(["NodeFenced"]) if e.payload.node_id == victim]
    if acted:
        assert len(fenced) == 1, (acted, fenced)
        assert fenced[0].payload.evicted_by == str(eviction.id) and fenced[0].correlation_id == opened.id
        assert fenced[0].payload.generation >= generation and fenced[0].payload.fenced_generation == 0
    # Its ranks never appear in a newer generation; the standby runs its slice.
    started_events = await stack.events(["RankStarted"])
    assert not [e for e in started_events if e.payload.node_id == victim and e.payload.generation > 0]
    owners = {e.payload.rank: e.payload.node_id for e in started_events if e.payload.generation == generation}
    assert sorted(owners) == [0, 1, 2, 3] and victim not in owners.values(), owners

    # The job finishes from the new generation, its steps bitwise equal to the frozen generation's.
    for rank in range(4):
        done = await stack.wait_for(["RankExited"], lambda e, r=rank: e.payload.rank == r and e.payload.generation ==
                                    generation and e.payload.classification == "success", 240, f"rank {rank} finishing")
        assert done.payload.node_id != victim
    logs = stack.directory / "nodes" / stack.node_of_rank(0) / "logs"
    before, resumed = logged_losses(logs / "rank0.g0.stdout"), logged_losses(logs / f"rank0.g{generation}.stdout")
    overlap = sorted(set(before) & set(resumed))
    assert overlap and all(before[s] == resumed[s] for s in overlap), [(s, before[s], resumed[s]) for s in overlap][:5]
    assert max(resumed) == STEPS - 1 and thawed_at_step < STEPS
    progressed = [e for e in after if e.type == "NodeHeartbeat" and e.payload.last_step > thawed_at_step]
    assert not progressed, "the fenced node stepped on"
    print(f"fenced scenario: {time.monotonic() - started:.0f} s; {len(acted)} member report(s) after the eviction, "
          f"{len(fenced)} NodeFenced; overlap {overlap[0]}..{overlap[-1]}")
    await stack.stop_and_verify()


