"""The node agent's shard store over real gRPC servers on free loopback ports (no mocks).

Node directories are plain temp folders laid out like ``<shm root>/<job>/<node>/``; slots are written
with the real ``SlotWriter``. Misbehaving peers (bad CRC, truncation) are real gRPC servers too. Every
node has a real certificate of the job's CA (``keel.infra.shard_ca``, in a temp credentials folder):
the stores speak mutual TLS only, and ``node-b`` accepts ranks 0-7's backups from ``node-a``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from keel.agent.shard_access import StoreLimits
from keel.agent.shard_store import (
    CHUNK_BYTES,
    PeerUnavailable,
    ShardIntegrityError,
    ShardSender,
    ShardStoreServer,
    TlsMaterial,
    TransferOutcome,
    TransferRejected,
    TransferResult,
    fetch_shard,
)
from keel.checkpoint.slots import SlotWriter, backup_path, sha256_hex, slot_path
from keel.infra.shard_ca import SERVER_NAME
from keel.protocol import shard_store_pb2 as pb
from keel.protocol import shard_store_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
JOB = "job-s"
TIMEOUT = timedelta(seconds=10)
WORLD = 8
PKI: dict[str, TlsMaterial] = {}
"""Each node's certificate of the job's CA (``node-x``: a node of the job assigned nothing), and a node of
another job (``stranger``, another CA), issued once for the module."""


@pytest.fixture(scope="module", autouse=True)
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TlsMaterial]]:
    credentials = tmp_path_factory.mktemp("credentials")
    PKI.update({node: TlsMaterial.issue(credentials, JOB, node, ("127.0.0.1",))
                for node in ("node-a", "node-b", "node-c", "node-x")})
    PKI["stranger"] = TlsMaterial.issue(credentials, "other-job", "node-a", ("127.0.0.1",))
    yield PKI
    PKI.clear()


def store(node: str, node_dir: Path, *, senders: dict[int, str] | None = None, **kwargs: object) -> ShardStoreServer:
    """A store of ``node`` that accepts ranks 0-7's backups from node-a (unless ``senders`` says otherwise)."""
    server = ShardStoreServer(JOB, node, node_dir, tls=PKI[node], world_size=WORLD, **kwargs)  # type: ignore[arg-type]
    server.assign_senders({r: "node-a" for r in range(WORLD)} if senders is None else dict(senders))
    return server


def fetch(address: str, job: str, owner: str, rank: int, step: int, dest: Path, sha256: str, timeout: timedelta,
          *, kind: str = "", tls: str = "node-a") -> Any:
    return fetch_shard(address, job, owner, rank, step, dest, sha256, timeout, kind=kind, tls=PKI[tls])


def channel(address: str, node: str = "node-a") -> aio.Channel:
    return PKI[node].channel(address)


def make_payload(size: int, seed: int) -> bytes:
    block = bytes((seed * 131 + i * 7) % 256 for i in range(4096))
    return (block * (size // 4096 + 1))[:size]


def write_slot(node_dir: Path, rank: int, index: int, step: int, payload: bytes, generation: int = 0) -> None:
    writer = SlotWriter(slot_path(node_dir, rank, index), len(payload))
    writer.begin(step, generation)
    writer.payload_view()[: len(payload)] = payload
    writer.complete(step, len(payload), sha256_hex(payload), generation)
    writer.close()


def chunks_for(payload: bytes, *, step: int, rank: int = 0, sha256: str | None = None, generation: int = 0,
               job: str = JOB, total: int | None = None, owner: str = "node-a") -> list[pb.ShardChunk]:
    header = pb.ShardHeader(job_id=job, owner_node_id=owner, rank=rank, step=step,
                            total_bytes=len(payload) if total is None else total,
                            sha256=sha256 or sha256_hex(payload), generation=generation)
    spans = [(o, payload[o:o + CHUNK_BYTES]) for o in range(0, len(payload), CHUNK_BYTES)] or [(0, b"")]
    return [pb.ShardChunk(header=header if o == 0 else None, offset=o, data=d, crc32=zlib.crc32(d)) for o, d in spans]


async def put_raw(address: str, chunks: list[pb.ShardChunk], node: str = "node-a") -> pb.PutShardReply:
    async def stream() -> AsyncIterator[pb.ShardChunk]:
        for chunk in chunks:
            yield chunk

    async with channel(address, node) as ch:
        return await pb_grpc.ShardStoreStub(ch).PutShard(stream(), timeout=10)


def temp_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob(".*") if ".tmp-" in p.name]


@pytest.fixture
def nodes(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "shm" / JOB / "node-a", tmp_path / "shm" / JOB / "node-b"


@pytest.fixture
async def store_b(nodes: tuple[Path, Path]) -> AsyncIterator[ShardStoreServer]:
    server = store("node-b", nodes[1], max_shard_bytes=80 * 1024 * 1024)
    await server.start("127.0.0.1")
    yield server
    await server.stop(timedelta(0))


@pytest.fixture
async def sender(nodes: tuple[Path, Path]) -> AsyncIterator[ShardSender]:
    sender = ShardSender(JOB, "node-a", nodes[0], tls=PKI["node-a"], timeout=TIMEOUT)
    yield sender
    await sender.close()


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iproto/keel/checkpoint/v1", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", "proto/keel/checkpoint/v1/shard_store.proto"], cwd=ROOT, check=True)
    grpc_code = (tmp_path / "shard_store_pb2_grpc.py").read_text().replace(
        "\nimport shard_store_pb2 as", "\nfrom keel.protocol import shard_store_pb2 as")
    generated = ROOT / "libs/protocol/keel/protocol"
    assert (tmp_path / "shard_store_pb2.py").read_text() == (generated / "shard_store_pb2.py").read_text(), "run `make proto`"
    assert grpc_code == (generated / "shard_store_pb2_grpc.py").read_text(), "run `make proto`"


async def test_put_get_round_trip_in_chunks(nodes: tuple[Path, Path], store_b: ShardStoreServer,
                                            sender: ShardSender, tmp_path: Path) -> None:
    node_a, node_b = nodes
    payload = make_payload(5 * CHUNK_BYTES + 12345, seed=1)
    write_slot(node_a, rank=3, index=1, step=40, payload=payload, generation=2)

    result = await sender.send(store_b.address, rank=3, step=40)
    assert (result.rank, result.step, result.bytes, result.sha256) == (3, 40, len(payload), sha256_hex(payload))
    assert result.seconds > 0 and result.bytes_per_s > 0
    assert backup_path(node_b, 3).read_bytes() == payload
    sidecar = json.loads((node_b / "backup" / "rank3.json").read_text())
    assert (sidecar["owner_node_id"], sidecar["step"], sidecar["generation"]) == ("node-a", 40, 2)
    assert not temp_files(node_b)

    # The backup, chunk by chunk: at most 1 MiB each, each with its CRC32, the header first only.
    async with channel(store_b.address) as ch:
        stub = pb_grpc.ShardStoreStub(ch)
        chunks = [c async for c in stub.GetShard(pb.GetShardRequest(job_id=JOB, rank=3, step=40))]
        listed = await stub.ListShards(pb.ListShardsRequest(job_id=JOB, verify=True))
    assert len(chunks) == 6 and all(len(c.data) <= CHUNK_BYTES for c in chunks)
    assert all(zlib.crc32(c.data) == c.crc32 for c in chunks)
    assert chunks[0].header.kind == "backup" and not any(c.HasField("header") for c in chunks[1:])
    assert b"".join(c.data for c in chunks) == payload
    assert [(s.rank, s.step, s.bytes, s.kind, s.owner_node_id) for s in listed.shards] == [
        (3, 40, len(payload), "backup", "node-a")]
    assert listed.node_id == "node-b" and not listed.rejected

    # fetch_shard from the backup holder and from the owner's own slot (a second store over node A).
    dest = tmp_path / "restore" / "rank3.shard"
    fetched = await fetch(store_b.address, JOB, "node-a", 3, 40, dest, sha256_hex(payload), TIMEOUT)
    assert dest.read_bytes() == payload and fetched.bytes == len(payload)
    store_a = store("node-a", node_a)
    address_a = await store_a.start()
    try:
        dest.unlink()
        await fetch(address_a, JOB, "node-a", 3, -1, dest, sha256_hex(payload), TIMEOUT, kind="slot")
        assert dest.read_bytes() == payload
    finally:
        await store_a.stop()
    assert not temp_files(tmp_path)


async def test_bad_crc_or_wrong_sha256_is_rejected_and_the_backup_stays(nodes: tuple[Path, Path],
                                                                         store_b: ShardStoreServer) -> None:
    node_b = nodes[1]
    old = make_payload(2 * CHUNK_BYTES, seed=2)
    await put_raw(store_b.address, chunks_for(old, step=10))
    new = make_payload(3 * CHUNK_BYTES + 7, seed=3)

    corrupted = chunks_for(new, step=11)
    corrupted[1].data = corrupted[1].data[:-1] + b"\x00"  # flipped on the wire: its CRC32 no longer matches
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await put_raw(store_b.address, corrupted)
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS and "CRC32 mismatch" in caught.value.details()

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await put_raw(store_b.address, chunks_for(new, step=11, sha256="ab" * 32))
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS and "SHA-256 mismatch" in caught.value.details()

    # A stream that ends early (fewer bytes than declared) is just as refused.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await put_raw(store_b.address, chunks_for(new, step=11)[:2])
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS and "truncated" in caught.value.details()

    assert backup_path(node_b, 0).read_bytes() == old
    assert json.loads((node_b / "backup" / "rank0.json").read_text())["step"] == 10
    assert not temp_files(node_b)


async def test_cancelled_stream_replaces_nothing(nodes: tuple[Path, Path], store_b: ShardStoreServer) -> None:
    node_b = nodes[1]
    old = make_payload(CHUNK_BYTES, seed=4)
    await put_raw(store_b.address, chunks_for(old, step=1))
    new_chunks = chunks_for(make_payload(4 * CHUNK_BYTES, seed=5), step=2)
    hold = asyncio.Event()

    async def stream() -> AsyncIterator[pb.ShardChunk]:
        for chunk in new_chunks[:2]:
            yield chunk
        await hold.wait()  # the sender dies here, half-way

    async with channel(store_b.address) as ch:
        call = pb_grpc.ShardStoreStub(ch).PutShard(stream(), timeout=10)
        deadline = time.monotonic() + 5
        while not temp_files(node_b) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert temp_files(node_b), "the server never started writing"
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    deadline = time.monotonic() + 5
    while temp_files(node_b) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not temp_files(node_b)
    assert backup_path(node_b, 0).read_bytes() == old
    assert json.loads((node_b / "backup" / "rank0.json").read_text())["step"] == 1


async def test_stale_oversize_and_foreign_job_are_refused(nodes: tuple[Path, Path], store_b: ShardStoreServer,
                                                         sender: ShardSender) -> None:
    node_a, node_b = nodes
    newer = make_payload(1000, seed=6)
    await put_raw(store_b.address, chunks_for(newer, step=10, generation=1))
    write_slot(node_a, rank=0, index=0, step=8, payload=make_payload(900, seed=7), generation=1)
    with pytest.raises(TransferRejected) as caught:
        await sender.send(store_b.address, rank=0, step=8)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale" in caught.value.reason and "step 10" in caught.value.reason
    assert backup_path(node_b, 0).read_bytes() == newer

    # After a restore to an older step the next generation's shards supersede the failed generation's.
    write_slot(node_a, rank=0, index=1, step=9, payload=make_payload(800, seed=8), generation=2)
    assert (await sender.send(store_b.address, rank=0, step=9)).step == 9
    assert backup_path(node_b, 0).read_bytes() == make_payload(800, seed=8)

    small = store("node-c", node_b.parent / "node-c", max_shard_bytes=CHUNK_BYTES)
    address_c = await small.start()
    try:
        write_slot(node_a, rank=1, index=0, step=3, payload=make_payload(CHUNK_BYTES + 1, seed=9))
        with pytest.raises(TransferRejected) as caught:
            await sender.send(address_c, rank=1, step=3)
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in caught.value.reason
    finally:
        await small.stop()
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await put_raw(store_b.address, chunks_for(make_payload(3000, seed=10), step=4, rank=5, total=2000))
    assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "longer than the declared" in raw.value.details()

    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await put_raw(store_b.address, chunks_for(newer, step=20, job="other-job"))
    assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "other-job" in raw.value.details()
    with pytest.raises(TransferRejected) as caught:
        await fetch(store_b.address, "other-job", "", 0, -1, node_a / "x.shard", "", TIMEOUT)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not (node_b / "backup" / "rank1.shard").exists() and not temp_files(node_b)


async def test_latest_wins_while_a_slow_transfer_runs(nodes: tuple[Path, Path], store_b: ShardStoreServer) -> None:
    node_a, node_b = nodes
    outcomes: list[TransferOutcome] = []
    # 2 MiB at 4 MiB/s: the first transfer takes about half a second.
    sender = ShardSender(JOB, "node-a", node_a, tls=PKI["node-a"], timeout=TIMEOUT, max_bytes_per_s=4 * 1024 * 1024,
                         on_outcome=outcomes.append)
    try:
        payloads = {step: make_payload(2 * CHUNK_BYTES, seed=20 + step) for step in range(1, 5)}
        write_slot(node_a, rank=0, index=1, step=1, payload=payloads[1])
        started = time.monotonic()
        sender.submit(store_b.address, rank=0, step=1)
        deadline = time.monotonic() + 5
        while not temp_files(node_b) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert temp_files(node_b), "the first transfer never started"
        for step in (2, 3, 4):  # each completes while step 1 is still on the wire
            write_slot(node_a, rank=0, index=step, step=step, payload=payloads[step])
            sender.submit(store_b.address, rank=0, step=step)
        assert not outcomes, "the slow transfer finished too early for this test to mean anything"
        await sender.wait_idle()
    finally:
        await sender.close()
    assert [(o.requested_step, o.result.step if o.result else None, o.error) for o in outcomes] == [
        (1, 1, None), (4, 4, None)]
    assert sender.skipped_steps == 2
    assert time.monotonic() - started >= 0.9  # two rate-limited transfers, one after the other
    assert backup_path(node_b, 0).read_bytes() == payloads[4]
    # A step the peer already holds is not sent again.
    sender2 = ShardSender(JOB, "node-a", node_a, tls=PKI["node-a"], timeout=TIMEOUT, on_outcome=outcomes.append)
    try:
        await sender2.send(store_b.address, 0, 4)
        sender2.submit(store_b.address, 0, 4)
        await sender2.wait_idle()
    finally:
        await sender2.close()
    assert len(outcomes) == 2


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A TCP port that accepts connections and never speaks HTTP/2 (a hung peer)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


async def test_dead_or_hung_peer_is_unavailable_within_the_timeout(nodes: tuple[Path, Path], blackhole: str) -> None:
    node_a = nodes[0]
    write_slot(node_a, rank=0, index=0, step=5, payload=make_payload(3 * CHUNK_BYTES, seed=30))
    server = store("node-b", nodes[1])
    address = await server.start()
    await server.stop()  # the peer died

    sender = ShardSender(JOB, "node-a", node_a, tls=PKI["node-a"], timeout=timedelta(seconds=2))
    try:
        started = time.monotonic()
        with pytest.raises(PeerUnavailable) as caught:
            await sender.send(address, rank=0, step=5)
        assert time.monotonic() - started < 2.5 and caught.value.address == address

        started = time.monotonic()
        with pytest.raises(PeerUnavailable, match="within 2s"):
            await sender.send(blackhole, rank=0, step=5)
        assert 1.5 < time.monotonic() - started < 4.0

        # The peer comes back on the same port: the next send reaches it at once.
        server = store("node-b", nodes[1])
        host, port = address.rsplit(":", 1)
        assert await server.start(host, int(port)) == address
        try:
            assert (await sender.send(address, rank=0, step=5)).step == 5
        finally:
            await server.stop()
    finally:
        await sender.close()

    started = time.monotonic()
    with pytest.raises(PeerUnavailable):
        await fetch(address, JOB, "node-a", 0, 5, node_a / "x.shard", "", timedelta(seconds=2))
    assert time.monotonic() - started < 2.5


class _LyingStore(pb_grpc.ShardStoreServicer):
    """A peer that serves a shard wrongly: a chunk with a bad CRC32, or a stream cut short."""

    def __init__(self, payload: bytes, mode: str) -> None:
        self.payload = payload
        self.mode = mode

    async def GetShard(self, request: pb.GetShardRequest, context: aio.ServicerContext) -> AsyncIterator[pb.ShardChunk]:  # noqa: N802
        chunks = chunks_for(self.payload, step=request.step, rank=request.rank)
        if self.mode == "bad-crc":
            chunks[1].crc32 ^= 1
        elif self.mode == "truncated":
            chunks = chunks[:-1]
        elif self.mode == "wrong-sha":
            chunks[0].header.sha256 = "cd" * 32
        for chunk in chunks:
            yield chunk


async def test_fetch_shard_verifies(nodes: tuple[Path, Path], store_b: ShardStoreServer, sender: ShardSender,
                                    tmp_path: Path) -> None:
    node_a, node_b = nodes
    payload = make_payload(2 * CHUNK_BYTES + 5, seed=40)
    write_slot(node_a, rank=2, index=0, step=12, payload=payload)
    await sender.send(store_b.address, rank=2, step=12)
    dest = tmp_path / "restore" / "rank2.shard"

    with pytest.raises(ShardIntegrityError, match="another shard"):
        await fetch(store_b.address, JOB, "node-a", 2, 12, dest, "ef" * 32, TIMEOUT)
    with pytest.raises(TransferRejected) as caught:
        await fetch(store_b.address, JOB, "node-a", 2, 13, dest, "", TIMEOUT)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND

    # The holder verifies before serving: a backup corrupted in its memory is not sent.
    held = backup_path(node_b, 2)
    data = bytearray(held.read_bytes())
    data[CHUNK_BYTES + 1] ^= 0x55
    held.write_bytes(bytes(data))
    with pytest.raises(TransferRejected, match="SHA-256 does not match") as caught:
        await fetch(store_b.address, JOB, "node-a", 2, 12, dest, sha256_hex(payload), TIMEOUT)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    async with channel(store_b.address) as ch:
        listed = await pb_grpc.ShardStoreStub(ch).ListShards(pb.ListShardsRequest(job_id=JOB, verify=True))
    assert not listed.shards and [(r.rank, r.step, r.kind) for r in listed.rejected] == [(2, 12, "backup")]

    # A peer that sends bad bytes is caught by the fetcher.
    for mode, message in (("bad-crc", "CRC32 mismatch"), ("truncated", "truncated"), ("wrong-sha", "SHA-256 mismatch")):
        server = aio.server()
        pb_grpc.add_ShardStoreServicer_to_server(_LyingStore(payload, mode), server)
        port = server.add_secure_port("127.0.0.1:0", PKI["node-c"].server_credentials())
        await server.start()
        try:
            with pytest.raises(ShardIntegrityError, match=message):
                await fetch(f"127.0.0.1:{port}", JOB, "", 2, 12, dest, "", TIMEOUT)
        finally:
            await server.stop(0)
    assert not dest.exists() and not temp_files(tmp_path)


async def test_throughput_64mib_over_loopback(nodes: tuple[Path, Path], store_b: ShardStoreServer,
                                              sender: ShardSender, tmp_path: Path) -> None:
    """Not a benchmark gate: prints the rate of a 64 MiB shard (both ends in this one process)."""
    size = 64 * 1024 * 1024
    payload = os.urandom(size)
    write_slot(nodes[0], rank=0, index=0, step=1, payload=payload)
    put = await sender.send(store_b.address, rank=0, step=1)
    got = await fetch(store_b.address, JOB, "node-a", 0, 1, tmp_path / "r.shard", put.sha256, TIMEOUT * 3)
    print(f"\n64 MiB put {put.bytes_per_s / 2**20:.0f} MiB/s, get {got.bytes_per_s / 2**20:.0f} MiB/s")
    assert put.bytes == got.bytes == size


async def test_the_previous_backup_of_the_same_history_is_kept_and_served(nodes: tuple[Path, Path],
                                                                         store_b: ShardStoreServer,
                                                                         tmp_path: Path) -> None:
    """A group lost while a backup round is half delivered leaves some ranks' peers with the new round
    and others' with the old one: the previous backup keeps a step every rank still has."""
    _, node_b = nodes
    old, new, other = make_payload(CHUNK_BYTES + 3, seed=50), make_payload(CHUNK_BYTES + 9, seed=51), \
        make_payload(100, seed=52)
    await put_raw(store_b.address, chunks_for(old, step=4, rank=1))
    await put_raw(store_b.address, chunks_for(new, step=6, rank=1))
    held, rejected = store_b.held_shards(verify=True)
    assert not rejected and [(h.rank, h.step, h.kind) for h in held] == [(1, 4, "backup"), (1, 6, "backup")]
    dest = tmp_path / "restore" / "rank1.shard"
    await fetch(store_b.address, JOB, "node-a", 1, 4, dest, sha256_hex(old), TIMEOUT)
    assert dest.read_bytes() == old
    await fetch(store_b.address, JOB, "node-a", 1, -1, dest, "", TIMEOUT)
    assert dest.read_bytes() == new  # the newest when no step is asked for
    # A backup of a newer generation starts another history: the old one's steps are not kept (their
    # numbers may come back with other contents).
    await put_raw(store_b.address, chunks_for(other, step=5, rank=1, generation=1))
    held, _ = store_b.held_shards(verify=True)
    assert [(h.rank, h.step, h.generation) for h in held] == [(1, 5, 1)]
    with pytest.raises(TransferRejected) as caught:
        await fetch(store_b.address, JOB, "node-a", 1, 6, dest, "", TIMEOUT)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    # Discarding a rank's backups removes both.
    await put_raw(store_b.address, chunks_for(other, step=7, rank=1, generation=1))
    assert len(store_b.held_shards()[0]) == 2
    store_b.discard_backup(1)
    assert store_b.held_shards()[0] == [] and not list(node_b.glob("backup/**/rank1.*"))


async def test_a_restore_drops_only_the_backups_above_its_step(store_b: ShardStoreServer, tmp_path: Path) -> None:
    """After a restore to step 12 a survivor drops what the abandoned history left above 12, but keeps the
    copy of 12: the lost ranks are about to fetch it."""
    older, newer = make_payload(300, seed=70), make_payload(301, seed=71)
    await put_raw(store_b.address, chunks_for(older, step=12, rank=2))
    await put_raw(store_b.address, chunks_for(newer, step=13, rank=2))
    steps = lambda: [h.step for h in store_b.held_shards(verify=True)[0] if h.rank == 2]  # noqa: E731
    assert steps() == [12, 13]
    store_b.discard_backup(2, newer_than=12)
    assert steps() == [12]
    dest = tmp_path / "rank2.shard"
    await fetch(store_b.address, JOB, "node-a", 2, -1, dest, "", TIMEOUT)  # now the newest
    assert dest.read_bytes() == older
    store_b.discard_backup(2, newer_than=12)
    assert steps() == [12]
    store_b.discard_backup(2)
    assert steps() == []


async def test_the_committed_step_stays_pinned_when_two_newer_rounds_push_it_out(store_b: ShardStoreServer,
                                                                              tmp_path: Path) -> None:
    """A fast rank's rounds 8 and 16 reach its peer before a slow rank's round 8 commits: without the pin
    the committed step 4 would leave with round 16 (newest and previous only). Pinned, it stays until the
    next commit, and is served by step."""
    payloads = {step: make_payload(200 + step, seed=80 + step) for step in (4, 8, 16, 24)}
    steps = lambda: [h.step for h in store_b.held_shards(verify=True)[0] if h.rank == 3]  # noqa: E731
    await put_raw(store_b.address, chunks_for(payloads[4], step=4, rank=3))
    store_b.pin(4)  # the broker committed step 4 on the peer tier
    await put_raw(store_b.address, chunks_for(payloads[8], step=8, rank=3))
    await put_raw(store_b.address, chunks_for(payloads[16], step=16, rank=3))
    assert steps() == [4, 8, 16]  # newest 16, previous 8, pinned 4
    dest = tmp_path / "rank3.shard"
    await fetch(store_b.address, JOB, "node-a", 3, 4, dest, sha256_hex(payloads[4]), TIMEOUT)
    assert dest.read_bytes() == payloads[4]
    # A restart pins nothing new and drops nothing (its inventory may need the pinned copy)...
    store_b.pin(-1)
    assert steps() == [4, 8, 16]
    # ...the next commit replaces it: only one pinned copy, of the newest committed step.
    store_b.pin(8)
    assert steps() == [8, 16]
    await put_raw(store_b.address, chunks_for(payloads[24], step=24, rank=3))
    assert steps() == [8, 16, 24]
    # A restore below drops the pinned copy above it too; one at or below stays and is served as the newest.
    store_b.discard_backup(3, newer_than=8)
    assert steps() == [8]
    await fetch(store_b.address, JOB, "node-a", 3, -1, dest, "", TIMEOUT)
    assert dest.read_bytes() == payloads[8]


async def test_a_pinned_copy_of_an_abandoned_history_is_dropped(store_b: ShardStoreServer) -> None:
    old = {step: make_payload(150 + step, seed=90 + step) for step in (2, 4, 6)}
    for step in (2, 4):
        await put_raw(store_b.address, chunks_for(old[step], step=step, rank=5))
    store_b.pin(2)
    await put_raw(store_b.address, chunks_for(old[6], step=6, rank=5))
    assert [h.step for h in store_b.held_shards()[0] if h.rank == 5] == [2, 4, 6]
    # Generation 1 resumed from step 3: its backups are another history, and every older copy goes.
    await put_raw(store_b.address, chunks_for(make_payload(99, seed=99), step=3, rank=5, generation=1))
    assert [(h.step, h.generation) for h in store_b.held_shards()[0] if h.rank == 5] == [(3, 1)]


# -- who may call: mTLS and the store's authorization --------------------------------------------------


def files_under(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


async def test_a_strangers_put_get_and_list_are_refused(nodes: tuple[Path, Path], store_b: ShardStoreServer,
                                                        sender: ShardSender, tmp_path: Path) -> None:
    node_a, node_b = nodes
    payload = make_payload(CHUNK_BYTES + 77, seed=100)
    write_slot(node_a, rank=0, index=0, step=3, payload=payload)
    await sender.send(store_b.address, rank=0, step=3)  # node-a's own backup, as assigned
    before = files_under(node_b)
    planted = make_payload(500, seed=101)

    async def chunks() -> AsyncIterator[pb.ShardChunk]:
        for chunk in chunks_for(planted, step=99, rank=0):
            yield chunk

    options = [("grpc.ssl_target_name_override", SERVER_NAME)]
    a, other = PKI["node-a"], PKI["stranger"]
    strangers = {
        "plaintext": lambda: aio.insecure_channel(store_b.address),
        "TLS without a client certificate": lambda: aio.secure_channel(
            store_b.address, grpc.ssl_channel_credentials(a.root_ca), options=options),
        "a certificate of another job's CA": lambda: aio.secure_channel(
            store_b.address, grpc.ssl_channel_credentials(a.root_ca, other.private_key, other.cert_chain), options=options),
        "another job's node, trusting only its own CA": lambda: other.channel(store_b.address),
    }
    for what, make in strangers.items():
        async with make() as ch:
            stub = pb_grpc.ShardStoreStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as listed:
                await stub.ListShards(pb.ListShardsRequest(job_id=JOB), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as got:
                _ = [c async for c in stub.GetShard(pb.GetShardRequest(job_id=JOB, rank=0, step=3), timeout=5)]
            with pytest.raises(grpc.aio.AioRpcError) as put:
                await stub.PutShard(chunks(), timeout=5)
        # The handshake fails: the stranger never reaches the service, so it learns nothing of it.
        assert {e.value.code() for e in (listed, got, put)} == {grpc.StatusCode.UNAVAILABLE}, what
    # The same through the client API: a sender or a fetcher with another job's certificate.
    stranger_sender = ShardSender(JOB, "node-a", node_a, tls=other, timeout=timedelta(seconds=3))
    try:
        with pytest.raises(PeerUnavailable):
            await stranger_sender.send(store_b.address, rank=0, step=3)
    finally:
        await stranger_sender.close()
    with pytest.raises(PeerUnavailable):
        await fetch(store_b.address, JOB, "node-a", 0, 3, tmp_path / "stolen.shard", "", TIMEOUT, tls="stranger")
    assert not (tmp_path / "stolen.shard").exists()

    # A node of the job that is not the one assigned to back rank 0 up here: refused by the store, saying why.
    with pytest.raises(grpc.aio.AioRpcError) as spoofed:
        await put_raw(store_b.address, chunks_for(planted, step=99, rank=0), node="node-x")  # claims node-a's shard
    assert spoofed.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "claiming to be node 'node-a'" in spoofed.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as unassigned:
        await put_raw(store_b.address, chunks_for(planted, step=99, rank=0, owner="node-x"), node="node-x")
    assert unassigned.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "come from 'node-a', not from 'node-x'" in unassigned.value.details()
    # Ranks past the world size are refused, to the assigned sender too, for writing and for reading.
    with pytest.raises(grpc.aio.AioRpcError) as outside:
        await put_raw(store_b.address, chunks_for(planted, step=99, rank=WORLD))
    assert outside.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside this job's ranks 0..7" in outside.value.details()
    with pytest.raises(TransferRejected) as read_outside:
        await fetch(store_b.address, JOB, "", WORLD + 100, -1, tmp_path / "x.shard", "", TIMEOUT)
    assert read_outside.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # Nothing was written, nothing replaced; a node of the job may still read what the store holds.
    assert files_under(node_b) == before and not temp_files(node_b)
    assert store_b.refusals == 4
    dest = tmp_path / "by-node-x.shard"
    await fetch(store_b.address, JOB, "node-a", 0, 3, dest, sha256_hex(payload), TIMEOUT, tls="node-x")
    assert dest.read_bytes() == payload


async def test_per_peer_and_total_quotas_and_the_stream_limit(nodes: tuple[Path, Path], tmp_path: Path) -> None:
    node_b = nodes[1]
    mib = CHUNK_BYTES
    limits = StoreLimits(max_shard_bytes=4 * mib, peer_quota_bytes=4 * mib, total_quota_bytes=5 * mib, max_streams=4,
                         max_streams_per_peer=1)
    server = store("node-b", node_b, senders={0: "node-a", 1: "node-a", 2: "node-c"}, limits=limits)
    address = await server.start()
    try:
        await put_raw(address, chunks_for(make_payload(2 * mib, seed=110), step=1, rank=0))
        # One stream at a time per peer: node-a's backup in flight keeps its second stream out, not node-c's.
        held_open = chunks_for(make_payload(2 * mib, seed=114), step=5, rank=0)
        release = asyncio.Event()

        async def slow() -> AsyncIterator[pb.ShardChunk]:
            yield held_open[0]
            await release.wait()
            for chunk in held_open[1:]:
                yield chunk

        async with channel(address) as ch:
            call = pb_grpc.ShardStoreStub(ch).PutShard(slow(), timeout=10)
            deadline = time.monotonic() + 5
            while not temp_files(node_b) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert temp_files(node_b), "the held-open backup was never admitted"
            with pytest.raises(TransferRejected) as busy:
                await fetch(address, JOB, "", 0, 1, tmp_path / "r0.shard", "", TIMEOUT)
            assert busy.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "per-peer limit of 1" in busy.value.reason
            got = await fetch(address, JOB, "", 0, 1, tmp_path / "r0.shard", "", TIMEOUT, tls="node-c")
            assert isinstance(got, TransferResult) and got.bytes == 2 * mib
            release.set()
            assert (await call).step == 5
        # Its stream ended: node-a streams again.
        await fetch(address, JOB, "", 0, 5, tmp_path / "r0.shard", "", TIMEOUT)

        # node-a's backups now hold 4 MiB here (rank 0's newest and previous copies): its quota is full.
        with pytest.raises(grpc.aio.AioRpcError) as peer:
            await put_raw(address, chunks_for(make_payload(mib // 2, seed=111), step=1, rank=1))
        assert peer.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "per-peer quota" in peer.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as total:  # node-c's 1.5 MiB fit its own quota, not the store's
            await put_raw(address, chunks_for(make_payload(mib + mib // 2, seed=113), step=2, rank=2, owner="node-c"),
                          node="node-c")
        assert total.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "store's quota" in total.value.details()
        await put_raw(address, chunks_for(make_payload(mib, seed=112), step=2, rank=2, owner="node-c"), node="node-c")
        with pytest.raises(grpc.aio.AioRpcError) as too_big:
            await put_raw(address, chunks_for(make_payload(10, seed=115), step=9, rank=1, total=4 * mib + 1))
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in too_big.value.details()
        assert not temp_files(node_b)
    finally:
        await server.stop()


async def test_received_and_fetched_files_are_private(nodes: tuple[Path, Path], store_b: ShardStoreServer,
                                                      sender: ShardSender, tmp_path: Path) -> None:
    node_a, node_b = nodes
    payload = make_payload(3000, seed=120)
    for step in (2, 4):  # two rounds: the first becomes the previous copy
        write_slot(node_a, rank=1, index=step // 2, step=step, payload=payload)
        await sender.send(store_b.address, rank=1, step=step)
    dest = tmp_path / "restore" / "rank1.shard"
    await fetch(store_b.address, JOB, "node-a", 1, 4, dest, sha256_hex(payload), TIMEOUT)
    written = [p for p in node_b.rglob("*") if p.is_file()] + [dest]
    assert len(written) >= 5  # newest and previous backups with their sidecars, senders.json, the fetched copy
    assert {str(p): oct(p.stat().st_mode & 0o777) for p in written} == {str(p): "0o600" for p in written}
    assert all(d.stat().st_mode & 0o077 == 0 for d in (node_b / "backup", node_b / "backup" / "prev"))


async def test_assignments_are_kept_across_a_restart_and_a_moved_rank_is_refused(nodes: tuple[Path, Path]) -> None:
    node_b = nodes[1]
    server = store("node-b", node_b, senders={0: "node-a"})
    address = await server.start()
    try:
        await put_raw(address, chunks_for(make_payload(100, seed=130), step=1, rank=0))
        server.assign_senders({0: None})  # the broker moved rank 0's backups elsewhere
        with pytest.raises(grpc.aio.AioRpcError) as moved:
            await put_raw(address, chunks_for(make_payload(100, seed=131), step=2, rank=0))
        assert moved.value.code() == grpc.StatusCode.PERMISSION_DENIED and "no node is assigned" in moved.value.details()
        server.assign_senders({0: "node-c"})  # rank 0 now runs on node-c, still backed up here
    finally:
        await server.stop()
    # A restarted agent's store knows its assignments before the broker says anything again.
    again = ShardStoreServer(JOB, "node-b", node_b, tls=PKI["node-b"], world_size=WORLD)
    address = await again.start()
    try:
        assert again.senders == {0: "node-c"}
        await put_raw(address, chunks_for(make_payload(100, seed=132), step=3, rank=0, owner="node-c"), node="node-c")
        with pytest.raises(grpc.aio.AioRpcError) as old_owner:
            await put_raw(address, chunks_for(make_payload(100, seed=133), step=4, rank=0))
        assert old_owner.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await again.stop()
