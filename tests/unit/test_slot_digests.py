"""The slot header's two digests: the SHA-256 (the shard's identity beyond the node) and the XXH3-128 (what a
local restore checks). Real slot files in a temporary folder; a layout-version-1 slot (no XXH3) still reads
and verifies with its SHA-256."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from keel.checkpoint import slots as ckpt_slots
from tests.factories import flip_byte as flip

PAYLOAD = bytes(range(256)) * 1000


def write_slot(path: Path, payload: bytes, *, fast: bool = True) -> None:
    writer = ckpt_slots.SlotWriter(path, len(payload))
    writer.begin(7, generation=2)
    writer.payload_view()[: len(payload)] = payload
    writer.complete(7, len(payload), ckpt_slots.sha256_hex(payload), 2,
                    ckpt_slots.xxh3_128_hex(payload) if fast else "")
    writer.close()


def write_v1_slot(path: Path, payload: bytes) -> None:
    """A slot as Keel wrote it before the XXH3-128 (layout version 1)."""
    header = ckpt_slots.HEADER_V1.pack(ckpt_slots.MAGIC, 1, ckpt_slots.SLOT_COMPLETE, 7, len(payload),
                                       bytes.fromhex(ckpt_slots.sha256_hex(payload)), 2, 1.0)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(header.ljust(ckpt_slots.HEADER_BYTES, b"\0") + payload)


def test_a_slot_carries_both_digests_of_its_payload(tmp_path: Path) -> None:
    path = tmp_path / "rank0.slot0"
    write_slot(path, PAYLOAD)
    header, payload = ckpt_slots.read_payload(path, verify=True)
    assert payload == PAYLOAD
    assert header.digest == ckpt_slots.sha256_hex(PAYLOAD) and len(header.digest) == 64
    assert header.fast_digest == ckpt_slots.xxh3_128_hex(PAYLOAD) and len(header.fast_digest) == 32
    assert (header.step, header.generation, header.complete) == (7, 2, True)


def test_a_flipped_payload_byte_fails_the_xxh3_check(tmp_path: Path) -> None:
    path = tmp_path / "rank0.slot0"
    write_slot(path, PAYLOAD)
    flip(path, ckpt_slots.HEADER_BYTES + 1234)
    with pytest.raises(ckpt_slots.SlotError, match=r"digest mismatch for step 7 \(XXH3-128 stored"):
        ckpt_slots.read_payload(path, verify=True)
    # Unverified reads still hand the bytes over (senders whose receiver checks the SHA-256 end to end).
    _, payload = ckpt_slots.read_payload(path, verify=False)
    assert payload != PAYLOAD and len(payload) == len(PAYLOAD)


@pytest.mark.parametrize("writer", [write_v1_slot, lambda p, b: write_slot(p, b, fast=False)],
                         ids=["layout-v1", "v2-without-xxh3"])
def test_a_slot_without_xxh3_is_verified_with_its_sha256(tmp_path: Path, writer) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "rank0.slot0"
    writer(path, PAYLOAD)
    header, payload = ckpt_slots.read_payload(path, verify=True)
    assert header.fast_digest == "" and header.digest == ckpt_slots.sha256_hex(PAYLOAD) and payload == PAYLOAD
    flip(path, ckpt_slots.HEADER_BYTES + 99)
    with pytest.raises(ckpt_slots.SlotError, match=r"\(SHA-256 stored"):
        ckpt_slots.read_payload(path, verify=True)


def test_an_unknown_layout_version_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "rank0.slot0"
    write_slot(path, PAYLOAD)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write((9).to_bytes(4, "little"))
    with pytest.raises(ckpt_slots.SlotError, match=r"slot layout version 9, this Keel reads \(1, 2\)"):
        ckpt_slots.read_header(path)


def test_an_incomplete_slot_reports_no_digest(tmp_path: Path) -> None:
    path = tmp_path / "rank0.slot0"
    writer = ckpt_slots.SlotWriter(path, 1024)
    writer.begin(3, generation=0)
    header = writer.header()
    writer.close()
    assert (header.complete, header.digest, header.fast_digest) == (False, "", "")
