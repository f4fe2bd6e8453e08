"""py-spy evidence on real dumps (tests/fixtures/stacks, made by make_fixtures.py): parse, normalise,
sign, dedupe, chunk, and turn failed captures into missing evidence."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest

from keel.rules.stacks import (
    TRUNCATION_MARKER,
    Frame,
    MissingEvidence,
    ProcessStacks,
    StackParseError,
    ThreadStack,
    chunk,
    classify_role,
    dedupe,
    encoded_size,
    main_thread,
    normalise,
    normalise_frame,
    parse_pyspy_json,
    parse_threads,
    process_from_pyspy,
    scrub,
    signature,
    signature_hash,
)
from tests.fixtures.stacks.scenarios import FIXTURES, dump_text, manifest, real_processes


def test_parses_a_real_dump_innermost_first() -> None:
    threads = parse_pyspy_json(dump_text("hang", 0))
    main = main_thread(threads)
    assert main is not None and main.thread_name == "MainThread" and main.is_main
    assert main.frames[0].name == "all_reduce"
    assert main.frames[0].short_filename == "torch/distributed/distributed_c10d.py"
    assert main.frames[-1].name == "<module>"
    assert [t.thread_name for t in threads if not t.is_main] == ["QueueFeederThread"]
    assert {t.pid for t in threads} == {manifest()["dumps"][0]["pid"]}


def test_signature_is_outermost_first_and_its_hash_is_sha1_of_the_frames() -> None:
    sig = signature(main_thread(parse_pyspy_json(dump_text("hang", 0))))
    assert sig[0].startswith("<module> (make_fixtures.py:")
    assert sig[-1].startswith("all_reduce (torch/distributed/distributed_c10d.py:")
    assert "gradient_all_reduce (make_fixtures.py:" in "\n".join(sig)
    expected = hashlib.sha1("\n".join(sig).encode()).hexdigest()[:12]
    assert signature_hash(sig) == expected and len(expected) == 12


def test_the_same_code_in_other_processes_signs_the_same() -> None:
    sigs = {signature(main_thread(parse_pyspy_json(dump_text(s, r)))) for s, r in
            [("hang", 0), ("hang", 1), ("hang", 2), ("dataloader", 0), ("dataloader", 2)]}
    pids = {parse_pyspy_json(dump_text("hang", r))[0].pid for r in range(3)}
    assert len(pids) == 3  # really different processes
    assert len(sigs) == 1
    hung = signature(main_thread(parse_pyspy_json(dump_text("hang", 3))))
    assert hung not in sigs and hung[-1].startswith("pipeline_stage_forward (make_fixtures.py:")


def test_scrub_replaces_addresses_temp_dirs_and_pids() -> None:
    assert scrub("0x7f6d4924524a") == "0x?"
    assert scrub("ncclKernel + 0x1a0") == "ncclKernel + 0x?"
    assert scrub("/tmp/tmpab12cd/train.py") == "/tmp/*/train.py"
    assert scrub("/proc/4711/fd") == "/proc/*/fd"
    assert scrub("worker pid 1234 tid=99") == "worker pid N tid=N"
    assert scrub("stage_2_forward") == "stage_2_forward"  # digits that are code stay


def test_normalise_frames_with_and_without_lines() -> None:
    f = Frame("step", "/tmp/abc123/train.py", "/tmp/abc123/train.py", 42)
    assert normalise_frame(f) == "step (/tmp/*/train.py:42)"
    assert normalise_frame(f, keep_lines=False) == "step (/tmp/*/train.py)"
    native = Frame("clock_nanosleep", "/usr/lib/x86_64-linux-gnu/libc.so.6", "libc.so.6", 0)
    assert normalise_frame(native) == "clock_nanosleep (libc.so.6)"
    g = Frame("step", "/tmp/zz9/train.py", "/tmp/zz9/train.py", 43)
    assert normalise([f], keep_lines=False) == normalise([g], keep_lines=False)
    assert normalise([f]) != normalise([g])


def test_native_dump_addresses_are_stripped() -> None:
    text = dump_text("hang", 3, native=True)
    sig = signature(main_thread(parse_pyspy_json(text)))
    assert "clock_nanosleep (libc.so.6)" in sig and "time_sleep (libpython3.11.so.1.0)" in sig
    assert not any("0x7f" in f for f in sig)
    address = next(f["name"] for f in json.loads(text)[0]["frames"] if f["name"].startswith("0x"))
    other = text.replace(address, "0x7fffdeadbeef")  # another load address (ASLR)
    assert other != text
    assert signature(main_thread(parse_pyspy_json(other))) == sig


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (dump_text("hang", 0)[:500], "not JSON"),
        ("", "not JSON"),
        ('{"pid": 1}', "must be a list of threads"),
        ("[1, 2]", "thread 0: expected an object"),
        ('[{"pid": 1, "thread_id": 2}]', "thread 0: missing 'frames'"),
        ('[{"pid": "1", "thread_id": 2, "frames": []}]', "'pid' must be an integer"),
        ('[{"pid": true, "thread_id": 2, "frames": []}]', "'pid' must be an integer"),
        ('[{"pid": 1, "thread_id": 2, "frames": {}}]', "'frames' must be a list"),
        ('[{"pid": 1, "thread_id": 2, "frames": [{"name": "f", "filename": "a.py"}]}]', "frame 0: missing 'line'"),
        ('[{"pid": 1, "thread_id": 2, "frames": [{"name": "f", "filename": "a.py", "line": "3"}]}]',
         "'line' must be an integer"),
        ('[{"pid": 1, "thread_id": 2, "os_thread_id": "x", "frames": []}]', "'os_thread_id' must be an integer or null"),
        ('[{"pid": 1, "thread_id": 2, "frames": []}, {"pid": 2, "thread_id": 3, "frames": []}]', "one process"),
    ],
)
def test_malformed_pyspy_json_raises_stack_parse_error(text: str, message: str) -> None:
    with pytest.raises(StackParseError, match=message):
        parse_pyspy_json(text)


def test_an_empty_thread_list_is_valid_and_signs_empty() -> None:
    assert parse_pyspy_json("[]") == []
    assert signature(main_thread([])) == ()


def test_a_vanished_process_becomes_missing_evidence_with_pyspys_words() -> None:
    info = manifest()["errors"]["vanished"]
    stderr = (FIXTURES / info["file"]).read_text()
    stdout = (FIXTURES / info["stdout_file"]).read_text()
    assert info["returncode"] != 0
    ev = process_from_pyspy(7, "rank", info["pid"], info["returncode"], stdout, stderr)
    assert isinstance(ev, MissingEvidence)
    assert ev.rank == 7 and ev.pid == info["pid"] and ev.role == "rank"
    assert "py-spy failed" in ev.reason and "Failed to get process executable name" in ev.reason


def test_unreadable_output_is_missing_evidence_and_good_output_is_stacks() -> None:
    bad = process_from_pyspy(1, "dataloader", 10, 0, "Error: not json", "")
    assert isinstance(bad, MissingEvidence) and "unreadable" in bad.reason and bad.role == "dataloader"
    good = process_from_pyspy(1, "dataloader", 10, 0, dump_text("hang", 1, "dataloader"), "", parent_pid=9)
    assert isinstance(good, ProcessStacks) and good.parent_pid == 9 and len(good.threads) == 3


def test_dedupe_counts_identical_signatures_with_pids_and_ranks() -> None:
    procs = [p for p in real_processes("hang") if p.role == "rank"]
    counts = dedupe(procs)
    assert [c.count for c in counts] == [3, 1]
    assert counts[0].ranks == (0, 1, 2) and counts[1].ranks == (3,)
    pid_of = {p.rank: p.pid for p in procs}
    assert counts[1].pids == (pid_of[3],)
    assert counts[0].signature[-1].startswith("all_reduce")
    assert counts[0].hash == signature_hash(counts[0].signature)
    workers = dedupe([p for p in real_processes("dataloader") if p.role == "dataloader"])
    assert [(c.count, c.ranks) for c in workers] == [(3, (0, 1, 2)), (1, (3,))]
    assert "StepDataset.__getitem__ (make_fixtures.py:" in workers[1].signature[-1]


def test_classify_role_from_the_stacks() -> None:
    assert classify_role(parse_pyspy_json(dump_text("hang", 0, "dataloader"))) == "dataloader"
    assert classify_role(parse_pyspy_json(dump_text("hang", 0))) == "other"

    def thread(short: str) -> list[ThreadStack]:
        return [ThreadStack(1, 1, 1, None, False, False, (Frame("save", short, short, 3),))]

    assert classify_role(thread("torch/distributed/checkpoint/state_dict_saver.py")) == "checkpoint"
    assert classify_role(thread("keel/sdk/checkpoint.py")) == "checkpoint"
    assert classify_role(thread("torch/utils/checkpoint.py")) == "other"  # activation recomputation


def test_process_role_is_checked() -> None:
    with pytest.raises(ValueError, match="unknown role"):
        ProcessStacks(pid=1, role="gpu", threads=())  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ chunking


def real_thread_dicts() -> list[dict]:
    out = []
    for entry in manifest()["dumps"]:
        out += json.loads((FIXTURES / entry["file"]).read_text())
    return out


def test_chunk_splits_under_the_limit_and_keeps_every_item_in_order() -> None:
    items = real_thread_dicts() * 3
    limit = 16 * 1024
    parts = chunk(items, limit)
    assert len(parts) > 1
    assert all(len(json.dumps(p).encode()) < limit for p in parts)
    assert [i for p in parts for i in p] == items
    one = real_thread_dicts()
    assert encoded_size(one) < 256 * 1024 and chunk(one) == [one]  # fits one default part: one part
    assert chunk([], limit) == []


def test_chunk_at_the_default_event_limit() -> None:
    items = real_thread_dicts() * 40  # several MiB
    parts = chunk(items)
    assert len(parts) >= encoded_size(items) // (256 * 1024)
    assert all(len(json.dumps(p, separators=(",", ":")).encode()) < 256 * 1024 for p in parts)
    assert all(len(json.dumps(p).encode()) < 256 * 1024 for p in parts)
    assert sum(len(p) for p in parts) == len(items)


def test_an_oversized_thread_keeps_its_innermost_frames_and_a_marker() -> None:
    thread = json.loads(dump_text("hang", 0))[1]  # the main thread
    assert thread["thread_name"] == "MainThread"
    big = copy.deepcopy(thread)
    big["frames"] = thread["frames"] * 400  # a runaway recursion
    original = copy.deepcopy(big)
    limit = 32 * 1024
    parts = chunk([thread, big, thread], limit)
    assert big == original  # not mutated
    flat = [i for p in parts for i in p]
    assert len(flat) == 3 and flat[0] == thread and flat[2] == thread
    cut = flat[1]
    kept = len(cut["frames"]) - 1
    assert 0 < kept < len(big["frames"])
    assert cut["frames"][:kept] == big["frames"][:kept]  # innermost first: the innermost are kept
    assert cut["frames"][-1]["name"] == f"{TRUNCATION_MARKER} {len(big['frames']) - kept} outer frames dropped"
    assert cut["truncated_frames"] == len(big["frames"]) - kept
    assert all(len(json.dumps(p).encode()) < limit for p in parts)
    # as many frames as fit: one more would not
    more = copy.deepcopy(cut)
    more["frames"] = big["frames"][: kept + 1] + [cut["frames"][-1]]
    assert encoded_size(more) + 2 >= limit
    # the marker is a valid py-spy frame: the truncated thread still parses and signs
    (parsed,) = parse_threads([cut])
    assert signature(parsed)[0].startswith(TRUNCATION_MARKER)


def test_an_oversized_process_dict_truncates_each_thread() -> None:
    threads = json.loads(dump_text("hang", 0))
    for t in threads:
        t["frames"] = t["frames"] * 300
    proc = {"rank": 3, "role": "rank", "pid": 1, "threads": threads}
    (part,) = chunk([proc], 24 * 1024)
    (item,) = part
    assert len(json.dumps(part).encode()) < 24 * 1024
    assert all(t["frames"][-1]["name"].startswith(TRUNCATION_MARKER) for t in item["threads"])
    assert item["rank"] == 3


def test_an_item_that_cannot_fit_is_refused_not_dropped() -> None:
    thread = json.loads(dump_text("hang", 0))[1]
    thread["thread_name"] = "x" * 5000
    with pytest.raises(ValueError, match="refusing to drop it silently"):
        chunk([thread], 4096)
    with pytest.raises(ValueError, match="too small"):
        chunk([thread], 8)
