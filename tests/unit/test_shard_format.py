"""The shard payload format (keel.sdk.shard): exact round trips of every supported type, no pickle, and clear
errors for unsupported values and for truncated or corrupted bytes."""

from __future__ import annotations

import json
import math
import random
import struct

import numpy as np
import pytest
import torch

from keel.sdk.shard import (
    ALIGN,
    MAGIC,
    CapturedState,
    ShardedTensor,
    ShardFormatError,
    ShardLayout,
    capture_state,
    decode_shard,
    encode_state,
    parse_placement,
    placement_text,
    read_meta,
    tree_fingerprint,
    write_payload,
)

TOPO = {"dp": 1, "pp": 1, "tp": 1, "groups": {"dp": [0], "pp": [0], "tp": [0]}}


def _encode(tree: object, step: int = 7) -> bytearray:
    return encode_state(tree, step=step, rank=0, world_size=1, topology=TOPO)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same(a: object, b: object, where: str = "tree") -> None:
    """Equal values *and* types, recursively; tensors and floats bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), where
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), where
        assert [type(k) for k in a] == [type(k) for k in b], f"{where}: key types differ"
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), where
    else:
        assert a == b, where


def test_every_supported_type_round_trips_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    tree = {
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3, generator=g)},
                                "0": "a str key next to an int key"},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "foreach": None, "params": [0]}]},
        "dtypes": {str(dt): torch.randn(5, generator=g).to(dt)
                   for dt in (torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int64, torch.bool,
                              torch.uint8, torch.float8_e4m3fn)},
        "complex": torch.randn(3, dtype=torch.complex64, generator=g),
        "scalar_tensor": torch.tensor(-0.0),
        "empty": torch.empty(0, 5),
        "floats": [0.1, -0.0, 1e308, 5e-324, math.nan, math.inf, -math.inf, 1, True, None, "x"],
        "big_int": 2**100,
        "bytes": b"\x00\xffkeel",
        "bytearray": bytearray(b"\x01\x02"),
        "nested_tuple": (1, (2.5, "three"), [4]),
        "python_rng": random.Random(5).getstate(),
        "numpy_rng": np.random.RandomState(5).get_state(),
        "ndarrays": [np.arange(6, dtype=">u4").reshape(2, 3), np.zeros((0,), dtype=np.float32), np.float64(2.5),
                     np.int32(-7), np.bool_(True)],
        "keys": {1: "int", "1": "str", 2.5: "float", None: "none", (1, "a"): "tuple", False: "bool"},
    }
    meta, out = decode_shard(_encode(tree))
    _assert_same(tree, out)
    assert meta["step"] == 7 and meta["rank"] == 0 and meta["world_size"] == 1 and meta["topology"] == TOPO
    assert meta["fingerprint"] == tree_fingerprint(tree)
    # NaN payload bits of a tensor survive (not just "some NaN").
    weird_nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    _, out = decode_shard(_encode({"n": weird_nan}))
    assert _bits(out["n"]) == _bits(weird_nan)


def test_decoding_without_copies_gives_views_of_the_buffer_with_the_same_values() -> None:
    g = torch.Generator().manual_seed(1)
    tree = {"model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3, generator=g)}}},
            "empty": torch.empty(0, 2), "transposed": torch.randn(3, 5, generator=g).t(),
            "array": np.arange(6, dtype=np.int16).reshape(2, 3)}
    buf = bytearray(_encode(tree))
    _, out = decode_shard(buf, copy=False)
    _assert_same(tree, out)
    assert out["transposed"].is_contiguous() and out["transposed"].shape == (5, 3)
    # Views, not copies: a byte changed in the buffer shows in the tensor (which is what makes a restore
    # copy each byte once, from the mapped file into its final place).
    w = out["model"]["w"]
    assert w.untyped_storage().nbytes() == len(buf), "every view shares the payload's one storage"
    offset = w.storage_offset() * w.element_size()
    assert bytes(buf[offset : offset + w.nbytes]) == w.numpy().tobytes()
    before = w.flatten()[0].item()
    buf[offset] ^= 1
    assert w.flatten()[0].item() != before
    # A read-only buffer cannot be viewed safely: the tensors are copies then.
    _, copied = decode_shard(bytes(buf), copy=False)
    assert copied["model"]["w"].untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


def test_rng_states_restore_the_same_streams() -> None:
    py, npy = random.Random(3), np.random.RandomState(3)
    _, out = decode_shard(_encode({"py": py.getstate(), "np": npy.get_state(), "torch": torch.get_rng_state()}))
    expected = (py.random(), npy.rand(), torch.rand(3))
    py.setstate(out["py"])
    npy.set_state(out["np"])
    torch.set_rng_state(out["torch"])
    assert (py.random(), npy.rand()) == expected[:2] and torch.equal(torch.rand(3), expected[2])


def test_layout_is_aligned_and_the_format_is_what_the_docs_say() -> None:
    tree = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.arange(5), "c": torch.zeros(())}
    payload = bytes(_encode(tree))
    assert payload[:8] == MAGIC
    version, meta_len = struct.unpack_from("<IQ", payload, 8)
    assert version == 1
    meta = json.loads(payload[20 : 20 + meta_len])
    assert set(meta) >= {"step", "rank", "world_size", "topology", "fingerprint", "tree", "tensors"}
    data_start = (20 + meta_len + ALIGN - 1) // ALIGN * ALIGN
    assert payload[20 + meta_len : data_start] == bytes(data_start - 20 - meta_len)  # zero padding
    offsets = [t["offset"] for t in meta["tensors"]]
    assert offsets[0] == data_start and all(o % ALIGN == 0 for o in offsets)
    assert meta["tree"]["t"] == "dict" and meta["tensors"][0]["dtype"] == "bfloat16"


def test_same_state_encodes_to_the_same_bytes() -> None:
    tree = {"w": torch.randn(8, 8), "opt": {"state": {0: {"step": torch.tensor(1.0)}}}, "lr": 0.1}
    assert _encode(tree) == _encode(tree)


def test_fast_path_reuses_the_layout_and_writes_the_same_payload() -> None:
    w = torch.randn(16, 4)
    tree = {"w": w, "step": 1}
    captured = capture_state(tree)
    layout = ShardLayout.plan(captured, meta_capacity=4096)
    buf = bytearray(layout.nbytes)
    views = layout.destinations(buf)
    for step in range(3):
        w.add_(1.0)  # the tensor changes between steps: the same layout, new bytes
        tree["step"] = step
        captured = capture_state(tree)
        assert layout.fits(captured)
        head = layout.encode_head(captured, step=step, rank=0, world_size=1, topology=TOPO)
        n = write_payload(buf, layout, head, captured.leaves, views)
        meta, out = decode_shard(bytes(buf[:n]))
        assert meta["step"] == step and out["step"] == step and torch.equal(out["w"], w)
    assert not layout.fits(capture_state({"w": torch.randn(16, 5), "step": 1}))  # shape changed
    assert not layout.fits(capture_state({"v": w, "step": 1}))  # path changed
    del views


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_unsupported_values_name_their_path() -> None:
    with pytest.raises(ShardFormatError, match=r"tree\['model'\]\['bad'\].*object"):
        _encode({"model": {"bad": object()}})
    with pytest.raises(ShardFormatError, match=r"tree\['s'\].*sparse"):
        _encode({"s": torch.eye(3).to_sparse()})
    with pytest.raises(ShardFormatError, match=r"tree\['q'\].*quantized"):
        _encode({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)})
    with pytest.raises(ShardFormatError, match=r"tree\['o'\]\[0\].*object"):
        _encode({"o": [np.array([None, 1], dtype=object)]})
    with pytest.raises(ShardFormatError, match="dict key"):
        _encode({frozenset(): 1})
    with pytest.raises(ShardFormatError, match="namedtuple"):
        from collections import namedtuple

        _encode({"nt": namedtuple("P", "x")(1)})


def test_truncated_payloads_are_refused_with_a_clear_message() -> None:
    payload = bytes(_encode({"w": torch.randn(100), "b": torch.randn(3)}))
    for cut in (0, 10, 19, 40, len(payload) - 1, len(payload) - 300):
        with pytest.raises(ShardFormatError, match="truncated"):
            decode_shard(payload[:cut])


def test_corrupted_payloads_are_refused() -> None:
    payload = bytearray(_encode({"w": torch.randn(10), "opt": {0: torch.ones(2)}}))
    with pytest.raises(ShardFormatError, match="not a Keel shard"):
        decode_shard(b"KEELSLOT" + bytes(payload[8:]))
    wrong_version = bytearray(payload)
    struct.pack_into("<I", wrong_version, 8, 99)
    with pytest.raises(ShardFormatError, match="version 99"):
        decode_shard(wrong_version)
    meta_len = struct.unpack_from("<Q", payload, 12)[0]
    text = payload[20 : 20 + meta_len].decode()
    broken_json = bytearray(payload)
    broken_json[20] = ord("[")
    with pytest.raises(ShardFormatError, match="not valid JSON|not an object"):
        decode_shard(broken_json)
    # A shape tampered with in the meta: the byte count no longer matches.
    tampered = text.replace('"shape":[10]', '"shape":[11]')
    assert tampered != text
    with pytest.raises(ShardFormatError, match="tensors\\[0\\]"):
        decode_shard(payload[:20] + tampered.encode() + payload[20 + meta_len :])
    # An int key changed in the meta (same length, tensors still valid): the fingerprint gives it away.
    tampered = text.replace('"t":"dict","v":[[0,', '"t":"dict","v":[[1,')
    assert tampered != text
    with pytest.raises(ShardFormatError, match="fingerprint mismatch"):
        decode_shard(payload[:20] + tampered.encode() + payload[20 + meta_len :])
    # An unknown tag.
    bad_tag = text.replace('"t":"tensor"', '"t":"tensoX"', 1)
    with pytest.raises(ShardFormatError, match="unknown tag"):
        decode_shard(payload[:20] + bad_tag.encode() + payload[20 + meta_len :])


def test_fingerprint_tells_models_and_structures_apart() -> None:
    a = {"model": {"w": torch.zeros(4, 4)}, "opt": {0: {"m": torch.zeros(4, 4)}}}
    assert tree_fingerprint(a) == tree_fingerprint({"model": {"w": torch.ones(4, 4)}, "opt": {0: {"m": torch.ones(4, 4)}}})
    assert tree_fingerprint(a) != tree_fingerprint({"model": {"w": torch.zeros(4, 5)}, "opt": {0: {"m": torch.zeros(4, 4)}}})
    assert tree_fingerprint(a) != tree_fingerprint({"model": {"w": torch.zeros(4, 4, dtype=torch.bfloat16)},
                                                    "opt": {0: {"m": torch.zeros(4, 4)}}})
    assert tree_fingerprint(a) != tree_fingerprint({"model": {"w": torch.zeros(4, 4)}, "opt": {"0": {"m": torch.zeros(4, 4)}}})
    assert read_meta(_encode(a))["fingerprint"] == tree_fingerprint(a)


def test_captured_state_keeps_tensors_by_reference() -> None:
    w = torch.zeros(3)
    captured: CapturedState = capture_state({"w": w})
    assert captured.leaves[0] is w and captured.paths == [("w",)]


# -- sharded tensors (FSDP2 / tensor-parallel DTensor shards) ----------------------------------------------------


def _sharded(local: torch.Tensor, **kw: object) -> ShardedTensor:
    fields: dict[str, object] = {"shape": (8, 3), "stride": (3, 1), "placements": ("S(0)",), "mesh_shape": (2,),
                                 "mesh_dim_names": ("dp",)}
    fields.update(kw)
    return ShardedTensor(local=local, **fields)  # type: ignore[arg-type]


def test_a_sharded_tensor_round_trips_with_its_layout() -> None:
    local = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    hsdp = _sharded(local.clone(), placements=("R", "S(0)"), mesh_shape=(1, 2), mesh_dim_names=None)
    tree = {"model": {"w": _sharded(local)}, "optimizer": {"state": {"w": {"exp_avg": hsdp, "step": torch.tensor(3.0)}}}}
    _, back = decode_shard(encode_state(tree, step=1, rank=0, world_size=2, topology=TOPO))
    w = back["model"]["w"]
    assert isinstance(w, ShardedTensor) and torch.equal(w.local, local)
    assert (w.shape, w.stride, w.placements, w.mesh_shape, w.mesh_dim_names) == ((8, 3), (3, 1), ("S(0)",), (2,), ("dp",))
    moment = back["optimizer"]["state"]["w"]["exp_avg"]
    assert moment.placements == ("R", "S(0)") and moment.mesh_shape == (1, 2) and moment.mesh_dim_names is None
    assert w.layout_text() == "[S(0)] on mesh (2,)"


@pytest.mark.parametrize("text", ["S(x)", "Q", "P(mean)", "S(0", ""])
def test_an_unknown_placement_is_refused_as_corrupt(text: str) -> None:
    # The writer takes a ShardedTensor's placement texts as they are: a reader must not.
    payload = encode_state({"w": _sharded(torch.zeros(4, 3), placements=(text,))}, step=1, rank=0, world_size=2, topology=TOPO)
    with pytest.raises(ShardFormatError, match="unknown DTensor placement"):
        decode_shard(payload)


def test_placements_other_than_shard_replicate_partial_are_refused_by_name() -> None:
    class StridedShard:  # stands in for FSDP2 + TP's private _StridedShard
        dim = 0

    with pytest.raises(ShardFormatError, match="StridedShard"):
        placement_text(StridedShard(), ("model", "w"))
    from torch.distributed.tensor import Partial, Replicate, Shard

    assert [placement_text(p) for p in (Shard(1), Replicate(), Partial())] == ["S(1)", "R", "P(sum)"]
    assert [type(parse_placement(t)) for t in ("S(1)", "R", "P(sum)")] == [Shard, Replicate, Partial]


@pytest.mark.parametrize(("fields", "message"), [
    ({"shape": (2, 3)}, r"local shard \[4, 3\] does not fit the global shape \[2, 3\]"),
    ({"shape": (-5, 3)}, "shape .* is not a list of integers >= 0"),
    ({"mesh_shape": (0,)}, "mesh .* is not a list of integers >= 1"),
    ({"placements": ("S(5)",)}, "placement S\\(5\\) shards dimension 5 of a 2-dimensional tensor"),
    ({"placements": ("R", "R")}, "not one text per mesh dimension"),
    ({"mesh_dim_names": (7,)}, "not one name per mesh dimension"),
    ({"stride": (3,)}, "differ in length"),
])
def test_a_malformed_dtensor_layout_is_refused_as_corrupt(fields: dict[str, object], message: str) -> None:
    payload = encode_state({"w": _sharded(torch.zeros(4, 3), **fields)}, step=1, rank=0, world_size=2, topology=TOPO)
    with pytest.raises(ShardFormatError, match=message):
        decode_shard(payload)
