"""The shard payload: one rank's training state as one self-describing byte string, without pickle.

Layout (all integers little-endian)::

    b"KEELSHRD" | u32 format version | u64 meta length | meta JSON (UTF-8) | zero padding | tensor bytes

Tensor bytes start at a 64-byte boundary and every tensor starts 64-byte aligned; the meta's ``tensors``
entries give each one's absolute ``offset`` in the payload, ``nbytes``, ``dtype``, ``shape`` and ``kind``
(``torch`` or ``numpy``), so a writer may leave more than the minimal padding after the meta (the
Checkpointer reserves room there so that the tensor region does not move when the meta grows by a few
bytes from one step to the next).

Meta keys: ``format``, ``step``, ``rank``, ``world_size``, ``topology``, ``fingerprint`` (SHA-256 over
the path, kind, dtype and shape of every tensor and array in the tree), any extra keys the writer adds,
``tree`` and ``tensors``. The tree is JSON in which every JSON object is a tagged value, so a user's
dict can never be confused with an encoding:

- ``None``, ``bool``, ``int``, finite ``float``, ``str`` and ``list`` are plain JSON (Python's ``json``
  keeps ``int`` vs ``float`` and writes floats with ``repr``, which reads back bit for bit);
- ``{"t": "dict", "v": [[key, value], ...]}`` keeps key types (an optimizer's ``state`` has int keys)
  and order; ``{"t": "tuple", "v": [...]}``; ``{"t": "float", "v": "nan" | "inf" | "-inf"}``;
  ``{"t": "bytes" | "bytearray", "v": base64}``; ``{"t": "np", "dtype": ..., "v": base64}`` (a NumPy
  scalar); ``{"t": "tensor" | "ndarray", "i": index into tensors}``;
  ``{"t": "dtensor", "i": index of the local shard, "shape": global shape, "stride": global stride,
  "placements": ["S(0)" | "R" | "P(sum)", ...], "mesh": mesh shape, "mesh_dims": names or null,
  "coord": this rank's coordinate in the mesh (absent in shards written before resharding existed)}``: a
  ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallel) as this rank holds it, its local shard
  stored like any tensor; it decodes to a ``ShardedTensor`` (the reader knows the live device mesh).

Anything else (a sparse or quantized tensor, an object array, a custom class) is refused with
``ShardFormatError`` naming where in the tree it is. The format carries no checksum of its own: the
container does (the slot header's digest, the restore plan's digest, the persistent manifest).

Fast path for a writer that snapshots every step (``keel.sdk.checkpoint``): ``capture_state`` walks the
tree once (tensors are kept by reference), ``ShardLayout.plan`` fixes every tensor's offset once and is
reused while ``layout.fits(captured)``, ``layout.encode_head`` re-encodes only the small meta JSON, and
``write_payload`` copies the tensors with ``Tensor.copy_`` (which releases the GIL) into views of a
pre-allocated buffer made once by ``layout.destinations``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "ALIGN",
    "ShardFormatError",
    "TensorSpec",
    "CapturedState",
    "ShardLayout",
    "ShardedTensor",
    "capture_state",
    "write_payload",
    "encode_state",
    "decode_shard",
    "read_meta",
    "tree_fingerprint",
]

MAGIC = b"KEELSHRD"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sIQ")  # magic, format version, meta length

Leaf = torch.Tensor | np.ndarray
Path = tuple[Any, ...]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}
_DTYPE_NAMES: dict[torch.dtype, str] = {}
for _name, _dtype in _TORCH_DTYPES.items():
    # Aliases (torch.float / torch.float32): keep the canonical spelling, the one str(dtype) uses.
    if str(_dtype) == f"torch.{_name}":
        _DTYPE_NAMES[_dtype] = _name


class ShardFormatError(ValueError):
    """A value that the shard format cannot hold, or bytes that are not a valid (complete) shard."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _path_text(path: Path) -> str:
    return "tree" + "".join(f"[{key!r}]" for key in path)


class TensorSpec(NamedTuple):
    """What the layout needs to know about one tensor or array: ``kind`` is ``torch`` or ``numpy``."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class ShardedTensor:
    """A DTensor as a shard holds it: this rank's ``local`` shard and the global layout it belongs to.

    ``placements`` are texts (``"S(0)"``: sharded on dim 0, ``"R"``: replicated, ``"P(sum)"``: partial)
    over a device mesh of shape ``mesh_shape``, in which the rank that held it sits at ``coord`` (what says
    which part of the global tensor ``local`` is; ``None`` in a shard written before it was recorded).
    ``to_dtensor(mesh)`` rebuilds the DTensor on a live mesh of the same shape (no copy of ``local``)."""

    local: torch.Tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    coord: tuple[int, ...] | None = None

    @classmethod
    def of(cls, dt: Any, path: Path = ()) -> ShardedTensor:
        """The local shard (a view, not a copy) and layout of DTensor ``dt``."""
        mesh = dt.device_mesh
        names = mesh.mesh_dim_names
        with torch.no_grad():  # a plain view of the local shard; ``detach()`` first costs 10x more per tensor
            local = dt.to_local()
        placements = dt.placements
        texts = _PLACEMENT_TEXTS.get(placements)
        if texts is None:
            texts = _PLACEMENT_TEXTS[placements] = tuple(placement_text(p, path) for p in placements)
        coord = mesh.get_coordinate()  # cached by the mesh: cheap per tensor per step
        return cls(local=local, shape=tuple(dt.shape), stride=tuple(dt.stride()), placements=texts,
                   mesh_shape=tuple(mesh.shape), mesh_dim_names=tuple(names) if names else None,
                   coord=tuple(coord) if coord is not None else None)

    def layout_text(self) -> str:
        """E.g. ``[S(0)] on mesh (4,)``: what a mismatch message shows."""
        return f"[{', '.join(self.placements)}] on mesh {self.mesh_shape}"

    def to_dtensor(self, mesh: Any) -> Any:
        """The DTensor on ``mesh`` (whose shape must be ``mesh_shape``), viewing ``local``."""
        from torch.distributed.tensor import DTensor

        if tuple(mesh.shape) != self.mesh_shape:
            raise ValueError(f"saved on a device mesh of shape {self.mesh_shape}, the live mesh is {tuple(mesh.shape)}")
        return DTensor.from_local(self.local, device_mesh=mesh, placements=[parse_placement(p) for p in self.placements],
                                  run_check=False, shape=torch.Size(self.shape), stride=self.stride)


_PLACEMENT_TEXTS: dict[tuple[Any, ...], tuple[str, ...]] = {}
"""Placement tuples (hashable, a handful per model) to their texts: ``ShardedTensor.of`` runs per tensor per step."""


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed: no DTensor can exist
        return None
    return DTensor


_DTENSOR = _dtensor_type()


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (FSDP2 and tensor-parallel parameters)."""
    return _DTENSOR is not None and isinstance(value, _DTENSOR)


def placement_text(placement: Any, path: Path = ()) -> str:
    """``"S(dim)"``, ``"R"`` or ``"P(op)"`` for a DTensor placement; ``ShardFormatError`` for any other kind
    (for example the strided shards FSDP2 uses on top of tensor parallelism: not supported yet)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    kind = type(placement)
    if kind is Shard:
        return f"S({int(placement.dim)})"
    if kind is Replicate:
        return "R"
    if kind is Partial:
        return f"P({placement.reduce_op})"
    raise ShardFormatError(f"{_path_text(path)}: DTensor placement {placement!r} ({kind.__name__}) is not supported "
                           "(Shard, Replicate and Partial are)")


def parse_placement(text: str) -> Any:
    """The placement ``placement_text`` wrote; ``ShardFormatError`` for any other text."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if text == "R":
        return Replicate()
    if len(text) > 3 and text[1] == "(" and text[-1] == ")":
        inner = text[2:-1]
        if text[0] == "S" and inner.isdigit():
            return Shard(int(inner))
        if text[0] == "P" and inner in ("sum", "avg", "max", "min", "product"):
            return Partial(inner)
    raise ShardFormatError(f"corrupt shard: unknown DTensor placement {text!r}")


@dataclass
class CapturedState:
    """A state tree walked once: its JSON form (tensors replaced by references), the tensors and arrays
    themselves (by reference, not copied), and the signature that decides whether a layout still fits."""

    tree_json: Any
    leaves: list[Leaf]
    paths: list[Path]
    specs: list[TensorSpec]

    @property
    def signature(self) -> tuple[tuple[Path, TensorSpec], ...]:
        return tuple(zip(self.paths, self.specs))


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _torch_spec(t: torch.Tensor, path: Path) -> TensorSpec:
    if t.layout is not torch.strided:
        raise ShardFormatError(f"{_path_text(path)}: {t.layout} tensors are not supported (densify it first)")
    if t.is_quantized:
        raise ShardFormatError(f"{_path_text(path)}: quantized tensors are not supported (dequantize it first)")
    if t.is_meta:
        raise ShardFormatError(f"{_path_text(path)}: a meta tensor has no data to save")
    if type(t) not in _TENSOR_TYPES:
        raise ShardFormatError(f"{_path_text(path)}: tensor subclass {type(t).__name__} is not supported")
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise ShardFormatError(f"{_path_text(path)}: unsupported dtype {t.dtype}")
    return TensorSpec("torch", name, tuple(t.shape), t.nbytes)


def _numpy_spec(a: np.ndarray, path: Path) -> TensorSpec:
    if a.dtype.hasobject or a.dtype.fields is not None or a.dtype.kind == "V":
        raise ShardFormatError(f"{_path_text(path)}: numpy dtype {a.dtype} is not supported (object or structured)")
    return TensorSpec("numpy", a.dtype.str, tuple(int(d) for d in a.shape), int(a.nbytes))


def _non_finite(x: float) -> dict[str, str]:
    return {"t": "float", "v": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def capture_state(tree: Any) -> CapturedState:
    """Walk ``tree`` into its JSON form; tensors and arrays are kept by reference (not copied).

    Raises ``ShardFormatError`` naming the path of the first value the format cannot hold. Runs every
    step on the training thread, hence the exact-type fast paths before the general ``isinstance`` chain.
    """
    leaves: list[Leaf] = []
    paths: list[Path] = []
    specs: list[TensorSpec] = []
    int_only = {int}

    def leaf(value: Leaf, spec: TensorSpec, path: Path, tag: str) -> dict[str, Any]:
        leaves.append(value)
        paths.append(path)
        specs.append(spec)
        return {"t": tag, "i": len(leaves) - 1}

    def seq(obj: list[Any] | tuple[Any, ...], path: Path) -> list[Any]:
        # A long run of plain ints (Python's RNG state: 625 of them) is already JSON.
        if len(obj) >= 8 and set(map(type, obj)) <= int_only:
            return list(obj)
        return [enc(v, path + (i,)) for i, v in enumerate(obj)]

    def enc(obj: Any, path: Path) -> Any:
        kind = type(obj)
        if kind is str or kind is int or kind is bool or obj is None:
            return obj
        if kind is float:
            return obj if math.isfinite(obj) else _non_finite(obj)
        if kind in _TENSOR_TYPES:
            return leaf(obj, _torch_spec(obj, path), path, "tensor")
        if kind is dict or isinstance(obj, dict):
            items = []
            for key, value in obj.items():
                if type(key) is not str and type(key) is not int and key is not None \
                        and not isinstance(key, (str, int, float, tuple)):
                    raise ShardFormatError(f"{_path_text(path)}: dict key {key!r} of type {type(key).__name__} "
                                           "is not supported")
                items.append([enc(key, path + ("<key>",)), enc(value, path + (key,))])
            return {"t": "dict", "v": items}
        if kind is list or (isinstance(obj, list)):
            return seq(obj, path)
        # The general chain. Order matters: bool before int, numpy scalars (np.float64 is a float) before float.
        if isinstance(obj, (bool, str)):
            return bool(obj) if isinstance(obj, bool) else str(obj)
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, np.generic):
            if obj.dtype.hasobject or obj.dtype.kind == "V":
                raise ShardFormatError(f"{_path_text(path)}: numpy scalar of dtype {obj.dtype} is not supported")
            return {"t": "np", "dtype": obj.dtype.str, "v": base64.b64encode(obj.tobytes()).decode("ascii")}
        if isinstance(obj, float):
            return float(obj) if math.isfinite(obj) else _non_finite(obj)
        if is_dtensor(obj):
            obj = ShardedTensor.of(obj, path)
        if kind is ShardedTensor or isinstance(obj, ShardedTensor):
            ref = leaf(obj.local, _torch_spec(obj.local, path), path, "dtensor")
            return {**ref, "shape": list(obj.shape), "stride": list(obj.stride), "placements": list(obj.placements),
                    "mesh": list(obj.mesh_shape),
                    "mesh_dims": list(obj.mesh_dim_names) if obj.mesh_dim_names is not None else None,
                    **({"coord": list(obj.coord)} if obj.coord is not None else {})}
        if isinstance(obj, torch.Tensor):
            return leaf(obj, _torch_spec(obj, path), path, "tensor")
        if isinstance(obj, np.ndarray):
            return leaf(obj, _numpy_spec(obj, path), path, "ndarray")
        if isinstance(obj, tuple):
            if hasattr(obj, "_fields"):
                raise ShardFormatError(f"{_path_text(path)}: namedtuple {type(obj).__name__} is not supported")
            return {"t": "tuple", "v": seq(obj, path)}
        if isinstance(obj, (bytes, bytearray)):
            tag = "bytes" if isinstance(obj, bytes) else "bytearray"
            return {"t": tag, "v": base64.b64encode(bytes(obj)).decode("ascii")}
        raise ShardFormatError(f"{_path_text(path)}: cannot store a value of type {type(obj).__module__}."
                               f"{type(obj).__qualname__}")

    return CapturedState(enc(tree, ()), leaves, paths, specs)


def _fingerprint(paths: Sequence[Path], specs: Sequence[TensorSpec]) -> str:
    rows = [[list(p), s.kind, s.dtype, list(s.shape)] for p, s in zip(paths, specs)]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":"), default=repr).encode()).hexdigest()


def tree_fingerprint(tree: Any) -> str:
    """SHA-256 over the path, kind, dtype and shape of every tensor and array in ``tree`` (in order)."""
    captured = capture_state(tree)
    return _fingerprint(captured.paths, captured.specs)


@dataclass(frozen=True)
class ShardLayout:
    """Where each tensor goes in the payload. Fixed for a tree signature; reused while it ``fits``.

    ``data_offset`` (64-aligned) leaves ``meta_capacity`` bytes for the meta JSON after the 20-byte prefix;
    ``nbytes`` is the payload size (the end of the last tensor).
    """

    signature: tuple[tuple[Path, TensorSpec], ...]
    offsets: tuple[int, ...]
    data_offset: int
    nbytes: int
    fingerprint: str
    tensors_json: str  # the meta's "tensors" list, encoded once per layout

    @classmethod
    def plan(cls, captured: CapturedState, meta_capacity: int) -> ShardLayout:
        data_offset = _align(_PREFIX.size + max(0, meta_capacity))
        offsets, cursor = [], data_offset
        for spec in captured.specs:
            offsets.append(cursor)
            cursor = _align(cursor + spec.nbytes)
        nbytes = offsets[-1] + captured.specs[-1].nbytes if offsets else data_offset
        entries = [{"offset": off, "nbytes": s.nbytes, "dtype": s.dtype, "shape": list(s.shape), "kind": s.kind}
                   for off, s in zip(offsets, captured.specs)]
        return cls(
            signature=captured.signature,
            offsets=tuple(offsets),
            data_offset=data_offset,
            nbytes=nbytes,
            fingerprint=_fingerprint(captured.paths, captured.specs),
            tensors_json=json.dumps(entries, separators=(",", ":")),
        )

    @property
    def meta_capacity(self) -> int:
        return self.data_offset - _PREFIX.size

    def fits(self, captured: CapturedState) -> bool:
        """Whether ``captured`` has exactly the tensors (paths, dtypes, shapes) this layout was planned for."""
        return captured.signature == self.signature

    def encode_head(self, captured: CapturedState, *, step: int, rank: int, world_size: int,
                    topology: dict[str, Any], extra_meta: dict[str, Any] | None = None) -> bytes:
        """The prefix and meta JSON for ``captured`` (which must ``fit``). May be longer than
        ``data_offset``: the caller then plans a layout with more ``meta_capacity``."""
        meta: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "step": int(step),
            "rank": int(rank),
            "world_size": int(world_size),
            "topology": topology,
            "fingerprint": self.fingerprint,
        }
        if extra_meta:
            meta.update(extra_meta)
        meta["tree"] = captured.tree_json
        try:
            text = json.dumps(meta, separators=(",", ":"), allow_nan=False)
        except ValueError as exc:  # a non-finite float in extra_meta or topology
            raise ShardFormatError(f"meta is not valid JSON: {exc}") from None
        body = (text[:-1] + ',"tensors":' + self.tensors_json + "}").encode()
        return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body)) + body

    def destinations(self, buf: memoryview | bytearray) -> list[Leaf | None]:
        """Typed views of ``buf`` (writable, at least ``nbytes`` long) where each tensor goes; ``None``
        for empty tensors. Make them once per buffer: they hold an export of ``buf`` until dropped."""
        views: list[Leaf | None] = []
        for (_, spec), offset in zip(self.signature, self.offsets):
            if spec.nbytes == 0:
                views.append(None)
            elif spec.kind == "torch":
                dtype = _TORCH_DTYPES[spec.dtype]
                numel = spec.nbytes // dtype.itemsize
                views.append(torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).reshape(spec.shape))
            else:
                dt = np.dtype(spec.dtype)
                views.append(np.frombuffer(buf, dtype=dt, count=spec.nbytes // dt.itemsize, offset=offset)
                             .reshape(spec.shape))
        return views


def write_payload(buf: memoryview | bytearray, layout: ShardLayout, head: bytes, sources: Sequence[Leaf],
                  destinations: Sequence[Leaf | None] | None = None) -> int:
    """Write one payload into ``buf``: ``head``, zero padding up to ``layout.data_offset``, then each source
    copied to its place. Returns the payload length (``layout.nbytes``).

    ``sources`` are the captured leaves (or stand-ins with the same dtype and shape, e.g. pinned host
    copies of CUDA tensors); ``destinations`` are ``layout.destinations(buf)`` if the caller keeps them.
    Bytes between tensors are left as they are (zero in a fresh buffer).
    """
    if len(head) > layout.data_offset:
        raise ShardFormatError(f"meta of {len(head)} bytes does not fit the layout's {layout.data_offset}")
    if len(buf) < layout.nbytes:
        raise ShardFormatError(f"buffer of {len(buf)} bytes is smaller than the payload's {layout.nbytes}")
    buf[: len(head)] = head
    buf[len(head) : layout.data_offset] = bytes(layout.data_offset - len(head))
    dsts = layout.destinations(buf) if destinations is None else destinations
    for dst, src in zip(dsts, sources):
        if dst is None:
            continue
        if isinstance(dst, torch.Tensor):
            if not isinstance(src, torch.Tensor):  # copy_ would raise this TypeError too; here it types src
                raise TypeError(f"a torch tensor's place needs a torch tensor, got {type(src).__name__}")
            dst.copy_(src)  # releases the GIL; handles strided and conjugated sources
        else:
            np.copyto(dst, src, casting="no")
    return layout.nbytes


def encode_state(tree: Any, *, step: int, rank: int, world_size: int, topology: dict[str, Any],
                 extra_meta: dict[str, Any] | None = None) -> bytearray:
    """The whole payload for ``tree`` in a new buffer, with the minimal padding after the meta: the same
    state always encodes to the same bytes."""
    captured = capture_state(tree)
    capacity = 0
    while True:  # the offsets are in the meta, so its length depends on them: converges in 2-3 rounds
        layout = ShardLayout.plan(captured, capacity)
        head = layout.encode_head(captured, step=step, rank=rank, world_size=world_size, topology=topology,
                                  extra_meta=extra_meta)
        if len(head) <= layout.data_offset:
            break
        capacity = len(head) - _PREFIX.size
    out = bytearray(layout.nbytes)
    write_payload(out, layout, head, captured.leaves)  # its views of ``out`` are dropped on return
    return out


# -- decoding --------------------------------------------------------------------------------------------------


def read_meta(buf: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The meta of a shard (tree still in its JSON form). Raises ``ShardFormatError`` for bytes that are
    not a shard, are truncated, or carry a meta that is not valid JSON."""
    return _read_meta(_byte_view(buf))[0]


def _byte_view(buf: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _read_meta(view: memoryview) -> tuple[dict[str, Any], int]:
    """The meta and where the tensor region may start (the first 64-byte boundary after the meta)."""
    if len(view) < _PREFIX.size:
        raise ShardFormatError(f"truncated shard: {len(view)} bytes, the prefix alone is {_PREFIX.size}")
    magic, version, meta_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise ShardFormatError(f"not a Keel shard (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise ShardFormatError(f"shard format version {version}; this Keel reads version {FORMAT_VERSION}")
    if _PREFIX.size + meta_len > len(view):
        raise ShardFormatError(f"truncated shard: meta of {meta_len} bytes, only {len(view) - _PREFIX.size} "
                               "bytes follow the prefix")
    try:
        meta = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + meta_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardFormatError(f"corrupt shard: meta is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ShardFormatError(f"corrupt shard: meta is a JSON {type(meta).__name__}, not an object")
    for key, kind in (("step", int), ("rank", int), ("world_size", int), ("fingerprint", str), ("tensors", list)):
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise ShardFormatError(f"corrupt shard: meta field {key!r} missing or not {kind.__name__}")
    if "tree" not in meta:
        raise ShardFormatError("corrupt shard: meta has no 'tree'")
    return meta, _align(_PREFIX.size + meta_len)


def _tensor_spec_from_meta(i: int, entry: Any, data_start: int, total: int) -> tuple[TensorSpec, int]:
    # Runs once per tensor of every restore: plain type checks (``type(x) is int`` also refuses a bool).
    if type(entry) is not dict:
        raise ShardFormatError(f"corrupt shard: tensors[{i}] is not an object")
    offset: Any = entry.get("offset")
    nbytes: Any = entry.get("nbytes")
    dtype: Any = entry.get("dtype")
    shape: Any = entry.get("shape")
    kind: Any = entry.get("kind")
    numel = 1
    well_formed = (type(offset) is int and type(nbytes) is int and type(dtype) is str and type(shape) is list
                   and kind in ("torch", "numpy") and nbytes >= 0)
    if well_formed:
        for d in shape:
            if type(d) is not int or d < 0:
                well_formed = False
                break
            numel *= d
    if not well_formed:
        raise ShardFormatError(f"corrupt shard: tensors[{i}] = {entry!r} is malformed")
    if kind == "torch":
        torch_dtype = _TORCH_DTYPES.get(dtype)
        if torch_dtype is None:
            raise ShardFormatError(f"corrupt shard: tensors[{i}] has unknown torch dtype {dtype!r}")
        itemsize = torch_dtype.itemsize
    else:
        try:
            np_dtype = np.dtype(dtype)
        except TypeError:
            raise ShardFormatError(f"corrupt shard: tensors[{i}] has unknown numpy dtype {dtype!r}") from None
        if np_dtype.hasobject:
            raise ShardFormatError(f"corrupt shard: tensors[{i}] has an object dtype")
        itemsize = np_dtype.itemsize
    if numel * itemsize != nbytes:
        raise ShardFormatError(f"corrupt shard: tensors[{i}] has {nbytes} bytes for shape {shape} of {dtype}")
    if offset % ALIGN or offset < data_start:
        raise ShardFormatError(f"corrupt shard: tensors[{i}] offset {offset} is not 64-aligned after the meta")
    if offset + nbytes > total:
        raise ShardFormatError(f"truncated shard: tensors[{i}] needs bytes [{offset}, {offset + nbytes}) "
                               f"but the payload has {total}")
    return TensorSpec(kind, dtype, tuple(shape), nbytes), offset


def _load_leaf(view: memoryview, spec: TensorSpec, offset: int, copy: bool,
               base: torch.Tensor | None = None) -> Leaf:
    """One tensor or array at ``offset``: a copy, or (``copy=False``) a view of ``view``; ``base`` (a uint8
    tensor over the whole of ``view``, made once) lets a torch leaf be a slice of it: a few microseconds,
    where wrapping the buffer anew for every tensor costs tens."""
    if spec.kind == "numpy":
        dt = np.dtype(spec.dtype)
        if spec.nbytes == 0:
            return np.empty(spec.shape, dtype=dt)
        array = np.frombuffer(view, dtype=dt, count=spec.nbytes // dt.itemsize, offset=offset).reshape(spec.shape)
        return array.copy() if copy else array
    dtype = _TORCH_DTYPES[spec.dtype]
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    if base is not None and not copy:
        strides, step = [], 1
        for dim in reversed(spec.shape):
            strides.append(step)
            step *= dim
        # One ``set_`` onto the whole payload's storage: half the cost of slicing, viewing and reshaping.
        return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), offset // dtype.itemsize, spec.shape,
                                                tuple(reversed(strides)))
    raw = np.frombuffer(view, dtype=np.uint8, count=spec.nbytes, offset=offset)
    return torch.from_numpy(raw.copy() if copy else raw).view(dtype).reshape(spec.shape)


def decode_shard(buf: bytes | bytearray | memoryview, *, copy: bool = True) -> tuple[dict[str, Any], Any]:
    """``(meta, tree)`` from a payload; the tree's tensors and arrays own their memory (copies).

    ``copy=False``: they are views of ``buf`` instead (no copy at all), for a reader that copies them
    straight into their final place (``Checkpointer`` restores the model's parameters this way, so the
    bytes are copied once, from the mapped file into the live parameters). ``buf`` must then be
    writable (a read-only buffer is copied as with ``copy=True``: torch cannot view it safely), and the
    views are only valid while ``buf`` is.

    ``meta`` is the meta without ``tree`` (``tensors`` kept). Raises ``ShardFormatError`` when the bytes
    are not a shard, are truncated, or are inconsistent (bad references, a fingerprint that does not
    match the tree).
    """
    view = _byte_view(buf)
    copy = copy or view.readonly
    meta, data_start = _read_meta(view)
    entries = [_tensor_spec_from_meta(i, e, data_start, len(view)) for i, e in enumerate(meta["tensors"])]
    base = None if copy or not entries else torch.frombuffer(view, dtype=torch.uint8)
    paths: list[Path] = []
    specs: list[TensorSpec] = []

    def dec(obj: Any, path: Path) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, list):
            return [dec(v, path + (i,)) for i, v in enumerate(obj)]
        if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
            raise ShardFormatError(f"corrupt shard: {_path_text(path)} is an untagged JSON object")
        tag = obj["t"]
        try:
            if tag == "dict":
                out: dict[Any, Any] = {}
                for key_json, value_json in obj["v"]:
                    key = dec(key_json, path + ("<key>",))
                    try:
                        out[key] = dec(value_json, path + (key,))
                    except TypeError:
                        raise ShardFormatError(f"corrupt shard: {_path_text(path)} has an unhashable key") from None
                return out
            if tag == "tuple":
                return tuple(dec(v, path + (i,)) for i, v in enumerate(obj["v"]))
            if tag == "float":
                return float(obj["v"]) if obj["v"] in ("nan", "inf", "-inf") else _bad(path, obj)
            if tag in ("bytes", "bytearray"):
                raw = base64.b64decode(obj["v"], validate=True)
                return raw if tag == "bytes" else bytearray(raw)
            if tag == "np":
                return np.frombuffer(base64.b64decode(obj["v"], validate=True), dtype=np.dtype(obj["dtype"]))[0]
            if tag == "dtensor":
                return _dec_sharded(obj, dec({"t": "tensor", "i": obj["i"]}, path), path)
            if tag in ("tensor", "ndarray"):
                index = obj["i"]
                if not isinstance(index, int) or not 0 <= index < len(entries):
                    raise ShardFormatError(f"corrupt shard: {_path_text(path)} refers to tensor {index!r} "
                                           f"of {len(entries)}")
                spec, offset = entries[index]
                if (spec.kind == "torch") != (tag == "tensor"):
                    raise ShardFormatError(f"corrupt shard: {_path_text(path)} is a {tag} but tensors[{index}] "
                                           f"is {spec.kind}")
                paths.append(path)
                specs.append(spec)
                return _load_leaf(view, spec, offset, copy, base)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            if isinstance(exc, ShardFormatError):
                raise
            raise ShardFormatError(f"corrupt shard: {_path_text(path)} = {obj!r:.200}: {exc}") from None
        raise ShardFormatError(f"corrupt shard: {_path_text(path)} has unknown tag {tag!r}")

    tree = dec(meta.pop("tree"), ())
    actual = _fingerprint(paths, specs)
    if actual != meta["fingerprint"]:
        raise ShardFormatError(f"corrupt shard: fingerprint mismatch (meta says {meta['fingerprint'][:12]}, the "
                               f"tree's tensors give {actual[:12]})")
    return meta, tree


def _int_list(value: Any, key: str, path: Path, minimum: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and v >= minimum for v in value):
        raise ShardFormatError(f"corrupt shard: {_path_text(path)}: DTensor {key} {value!r:.80} is not a list of "
                               f"integers >= {minimum}")
    return tuple(value)


def _dec_sharded(obj: dict[str, Any], local: Any, path: Path) -> ShardedTensor:
    """The ``ShardedTensor`` of a ``dtensor`` entry whose local shard is ``local``; ``ShardFormatError`` when the
    layout is malformed or does not fit the local shard."""
    if not isinstance(local, torch.Tensor):
        raise ShardFormatError(f"corrupt shard: {_path_text(path)}: a DTensor's local shard must be a torch tensor")
    shape, stride = _int_list(obj["shape"], "shape", path, 0), _int_list(obj["stride"], "stride", path, 0)
    mesh = _int_list(obj["mesh"], "mesh", path, 1)
    placements, dims = obj["placements"], obj["mesh_dims"]
    coord = _int_list(obj["coord"], "coord", path, 0) if "coord" in obj else None
    problem = None
    if len(stride) != len(shape):
        problem = f"stride {list(stride)} and shape {list(shape)} differ in length"
    elif not mesh:
        problem = "an empty device mesh"
    elif not (isinstance(placements, list) and len(placements) == len(mesh) and all(isinstance(p, str) for p in placements)):
        problem = f"placements {placements!r:.80} are not one text per mesh dimension"
    elif dims is not None and not (isinstance(dims, list) and len(dims) == len(mesh) and all(isinstance(d, str) for d in dims)):
        problem = f"mesh_dims {dims!r:.80} are not one name per mesh dimension"
    elif local.dim() != len(shape) or any(n > g for n, g in zip(local.shape, shape, strict=True)):
        problem = f"the local shard {list(local.shape)} does not fit the global shape {list(shape)}"
    elif coord is not None and (len(coord) != len(mesh) or any(c >= n for c, n in zip(coord, mesh, strict=True))):
        problem = f"coordinate {list(coord)} is not in the mesh {list(mesh)}"
    if problem is not None:
        raise ShardFormatError(f"corrupt shard: {_path_text(path)}: DTensor layout: {problem}")
    for text in placements:
        dim = getattr(parse_placement(text), "dim", None)
        if dim is not None and dim >= len(shape):
            raise ShardFormatError(f"corrupt shard: {_path_text(path)}: placement {text} shards dimension {dim} of a "
                                   f"{len(shape)}-dimensional tensor")
    return ShardedTensor(local=local, shape=shape, stride=stride, placements=tuple(placements), mesh_shape=mesh,
                         mesh_dim_names=tuple(dims) if dims is not None else None, coord=coord)


def _bad(path: Path, obj: Any) -> Any:
    raise ShardFormatError(f"corrupt shard: {_path_text(path)} = {obj!r:.200} is not a valid value")
