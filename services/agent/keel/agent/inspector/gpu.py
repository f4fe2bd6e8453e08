"""GPU health via NVML: XIDs, ECC, row remapping, lost GPUs, temperature, clock throttling.

The probe reads an ``NvmlSnapshot`` from an ``NvmlSource``:

- ``PynvmlSource``: the real NVML (``nvidia-ml-py``, import name ``pynvml``). Without a GPU or
  driver it raises ``NvmlUnavailable`` and the probe reports that once, as information, not a fault.
- ``OverlayNvmlSource``: ``<root>/run/keel/nvml.json``, the same shape as ``NvmlSnapshot.to_json``
  (fault injection writes it for ``gpu-lost`` and ``xid``)::

      {"driver_version": "550.54.15", "device_count": 8,
       "devices": [{"index": 0, "uuid": "GPU-…", "name": "NVIDIA H100 80GB HBM3",
                    "pci_bus_id": "00000000:18:00.0", "temperature_c": 41,
                    "ecc": {"volatile_sbe": 0, "volatile_dbe": 0, "aggregate_sbe": 0, "aggregate_dbe": 0},
                    "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": false, "failure": false},
                    "retired_pages_pending": false, "throttle_reasons": 0,
                    "xids": [{"seq": 1, "xid": 79, "data": 0}],
                    "lost": false, "error": null}]}

  Only ``index`` is required per device; absent fields are "not reported" and their checks are
  skipped. ``xids`` may keep growing: the probe reports each ``(index, seq)`` once. A device with
  ``"lost": true`` (or a ``device_count`` below the most ever seen) is a lost GPU.
  A missing file means "no GPU on this node" (informational); an unreadable or malformed one is a
  probe failure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from .observation import Observation, fatal, finish, healthy, informational
from .policy import InspectorPolicy

XID_NAMES: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "NVDEC0 exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

# nvmlClocksThrottleReason* / nvmlClocksEventReason* bits that mean the hardware is slowing the GPU down.
THROTTLE_BITS: dict[int, str] = {
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}
BENIGN_THROTTLE_BITS: dict[int, str] = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x10: "sync_boost", 0x100: "display_clock"}

XidClass = str  # "fatal" | "ignored" | "unknown"


def classify_xid(xid: int, policy: InspectorPolicy) -> XidClass:
    """``fatal``: the node is broken; ``ignored``: an application error or on the ignore list; else ``unknown``."""
    if xid in policy.xid_ignore:
        return "ignored"
    if xid in policy.xid_fatal:
        return "fatal"
    return "unknown"


def xid_name(xid: int) -> str:
    return XID_NAMES.get(xid, "unlisted XID")


class NvmlUnavailable(Exception):
    """No NVML on this node (no library, no driver, no GPU): information, not a fault."""


class NvmlReadError(Exception):
    """NVML exists but could not be read: the probe failed."""


@dataclass(frozen=True)
class XidEvent:
    seq: int
    xid: int
    data: int = 0


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    temperature_c: float | None = None
    ecc: dict[str, int] | None = None
    """``volatile_sbe``, ``volatile_dbe``, ``aggregate_sbe``, ``aggregate_dbe``."""
    remapped_rows: dict[str, Any] | None = None
    """``correctable``, ``uncorrectable`` (counts), ``pending``, ``failure`` (bools)."""
    retired_pages_pending: bool | None = None
    throttle_reasons: int | None = None
    xids: tuple[XidEvent, ...] = ()
    lost: bool = False
    error: str | None = None
    """A read error on this device other than "lost" (the probe reports it as a probe failure)."""


@dataclass(frozen=True)
class NvmlSnapshot:
    device_count: int
    devices: tuple[GpuDevice, ...] = ()
    driver_version: str = ""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["devices"] = [{**d, "xids": [asdict(x) for x in dev.xids]} for d, dev in zip(data["devices"], self.devices)]
        return data

    @staticmethod
    def from_json(data: Any) -> NvmlSnapshot:
        """Validate and read the overlay/recorded shape. Raises ``ValueError`` with the reason."""
        if not isinstance(data, dict):
            raise ValueError(f"top level must be an object, got {type(data).__name__}")
        raw_devices = data.get("devices", [])
        if not isinstance(raw_devices, list):
            raise ValueError("'devices' must be a list")
        devices = []
        for i, raw in enumerate(raw_devices):
            if not isinstance(raw, dict) or not isinstance(raw.get("index"), int):
                raise ValueError(f"devices[{i}] must be an object with an integer 'index'")
            known = {f for f in GpuDevice.__dataclass_fields__}
            unknown = set(raw) - known
            if unknown:
                raise ValueError(f"devices[{i}] has unknown fields {sorted(unknown)}")
            xids = raw.get("xids") or []
            if not isinstance(xids, list) or not all(isinstance(x, dict) and isinstance(x.get("xid"), int) for x in xids):
                raise ValueError(f"devices[{i}].xids must be a list of objects with an integer 'xid'")
            events = tuple(XidEvent(seq=int(x.get("seq", n)), xid=int(x["xid"]), data=int(x.get("data", 0))) for n, x in enumerate(xids))
            for name in ("ecc", "remapped_rows"):
                if raw.get(name) is not None and not isinstance(raw[name], dict):
                    raise ValueError(f"devices[{i}].{name} must be an object")
            for name, types in _FIELD_TYPES.items():
                if raw.get(name) is not None and (not isinstance(raw[name], types) or isinstance(raw[name], bool) and bool not in types):
                    raise ValueError(f"devices[{i}].{name} has the wrong type ({type(raw[name]).__name__})")
            devices.append(GpuDevice(**{**raw, "xids": events}))
        count = data.get("device_count", len(devices))
        if not isinstance(count, int) or count < 0:
            raise ValueError("'device_count' must be a non-negative integer")
        return NvmlSnapshot(device_count=count, devices=tuple(devices), driver_version=str(data.get("driver_version", "")))


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "uuid": (str,), "name": (str,), "pci_bus_id": (str,), "temperature_c": (int, float), "throttle_reasons": (int,),
    "retired_pages_pending": (bool,), "lost": (bool,), "error": (str,),
}


class NvmlSource(Protocol):
    """Where the GPU probe gets its snapshot. Raises ``NvmlUnavailable`` or ``NvmlReadError``."""

    def read(self) -> NvmlSnapshot: ...


class OverlayNvmlSource:
    """Reads ``<root>/run/keel/nvml.json`` (simulated nodes, fault injection, recorded fixtures)."""

    RELATIVE_PATH = Path("run/keel/nvml.json")

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / self.RELATIVE_PATH

    def read(self) -> NvmlSnapshot:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            raise NvmlUnavailable(f"no GPU: {self.path} does not exist") from None
        except OSError as exc:
            raise NvmlReadError(f"cannot read {self.path}: {exc}") from exc
        try:
            return NvmlSnapshot.from_json(json.loads(text))
        except (ValueError, TypeError) as exc:
            raise NvmlReadError(f"malformed {self.path}: {exc}") from exc


class PynvmlSource:
    """The real NVML. XIDs come from an NVML event set polled without blocking."""

    def __init__(self) -> None:
        import pynvml  # imported here so the module imports on machines without nvidia-ml-py

        self._nvml = pynvml
        self._initialised = False
        self._events: Any = None
        self._xid_seq = 0
        self._index_by_handle: dict[Any, int] = {}

    def _init(self) -> None:
        nv = self._nvml
        try:
            nv.nvmlInit()
        except (nv.NVMLError_LibraryNotFound, nv.NVMLError_DriverNotLoaded, nv.NVMLError_NoPermission) as exc:
            raise NvmlUnavailable(f"no GPU: NVML unavailable ({exc})") from exc
        except nv.NVMLError as exc:
            raise NvmlReadError(f"nvmlInit failed: {exc}") from exc
        self._initialised = True
        try:
            self._events = nv.nvmlEventSetCreate()
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                try:
                    nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, self._events)
                except nv.NVMLError_NotSupported:
                    pass
        except nv.NVMLError:
            self._events = None  # XIDs then come from the kernel log only

    def _optional(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError_NotSupported:
            return None

    def _new_xids(self) -> dict[str, list[XidEvent]]:
        nv = self._nvml
        out: dict[str, list[XidEvent]] = {}
        if self._events is None:
            return out
        while True:
            try:
                event = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError_Timeout:
                return out
            self._xid_seq += 1
            uuid = _text(nv.nvmlDeviceGetUUID(event.device))
            out.setdefault(uuid, []).append(XidEvent(seq=self._xid_seq, xid=int(event.eventData)))

    def read(self) -> NvmlSnapshot:
        nv = self._nvml
        if not self._initialised:
            self._init()
        try:
            count = nv.nvmlDeviceGetCount()
            driver = _text(nv.nvmlSystemGetDriverVersion())
            xids = self._new_xids()
        except nv.NVMLError as exc:
            raise NvmlReadError(f"NVML query failed: {exc}") from exc
        devices = []
        for i in range(count):
            devices.append(self._device(i, xids))
        return NvmlSnapshot(device_count=count, devices=tuple(devices), driver_version=driver)

    def _device(self, index: int, xids: dict[str, list[XidEvent]]) -> GpuDevice:
        nv = self._nvml
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nv.nvmlDeviceGetUUID(h))
            ecc = None
            vol_dbe = self._optional(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            if vol_dbe is not None:
                ecc = {
                    "volatile_dbe": int(vol_dbe),
                    "volatile_sbe": int(nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)),
                    "aggregate_dbe": int(nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC)),
                    "aggregate_sbe": int(nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC)),
                }
            remap = self._optional(nv.nvmlDeviceGetRemappedRows, h)
            remapped = None
            if remap is not None:
                corr, unc, pending, failure = remap
                remapped = {"correctable": int(corr), "uncorrectable": int(unc), "pending": bool(pending), "failure": bool(failure)}
            retired = self._optional(nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
            reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
            return GpuDevice(
                index=index,
                uuid=uuid,
                name=_text(nv.nvmlDeviceGetName(h)),
                pci_bus_id=_text(nv.nvmlDeviceGetPciInfo(h).busId),
                temperature_c=float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                ecc=ecc,
                remapped_rows=remapped,
                retired_pages_pending=None if retired is None else bool(retired),
                throttle_reasons=self._optional(reasons_fn, h),
                xids=tuple(xids.get(uuid, ())),
            )
        except nv.NVMLError_GpuIsLost as exc:
            return GpuDevice(index=index, lost=True, error=str(exc))
        except nv.NVMLError as exc:
            return GpuDevice(index=index, error=f"{type(exc).__name__}: {exc}")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuProbe:
    """Samples an ``NvmlSource`` and turns the snapshot into observations (component ``gpu``).

    Stateful only where a delta needs a previous sample: XIDs already reported, SBE counts, the
    most devices ever seen (a drop means GPUs fell off).
    """

    name = "gpu"

    def __init__(self, source: NvmlSource, policy: InspectorPolicy | None = None) -> None:
        self.source = source
        self.policy = policy or InspectorPolicy()
        self._seen_xids: set[tuple[int, int]] = set()
        self._last_sbe: dict[int, int] = {}
        self._max_devices = 0
        self._announced_unavailable = False

    def collect(self) -> list[Observation]:
        try:
            snap = self.source.read()
        except NvmlUnavailable as exc:
            # Information, not a fault; reported once by the probe (the core would dedupe it anyway).
            if self._announced_unavailable:
                return []
            self._announced_unavailable = True
            return [informational("gpu", "nvml", "node", str(exc), available=False)]
        except NvmlReadError as exc:
            return finish("gpu", "nvml", [], [str(exc)])
        self._announced_unavailable = False
        obs: list[Observation] = []
        errors: list[str] = []
        self._max_devices = max(self._max_devices, snap.device_count, len(snap.devices))
        present = {d.index for d in snap.devices}
        if snap.device_count < self._max_devices:
            missing = sorted(set(range(self._max_devices)) - present) or list(range(snap.device_count, self._max_devices))
            for idx in missing:
                obs.append(fatal("gpu", "gpu_lost", f"gpu{idx}",
                                 f"gpu{idx} is gone: NVML sees {snap.device_count} of {self._max_devices} GPUs",
                                 gpu=idx, device_count=snap.device_count, expected=self._max_devices))
        for dev in snap.devices:
            obs.extend(self._device(dev, errors))
        return finish("gpu", "nvml", obs, errors)

    def _device(self, dev: GpuDevice, errors: list[str]) -> Iterable[Observation]:
        key = f"gpu{dev.index}"
        ev: dict[str, Any] = {"gpu": dev.index, "uuid": dev.uuid, "pci_bus_id": dev.pci_bus_id}
        if dev.lost:
            yield fatal("gpu", "gpu_lost", key, f"{key} is lost ({dev.error or 'NVML: GPU is lost'})", **ev)
            return
        yield healthy("gpu", "gpu_lost", key, **ev)
        if dev.error:
            errors.append(f"{key}: {dev.error}")
            return
        yield from self._xids(dev, key, ev)
        if dev.ecc is not None:
            yield from self._ecc(dev, key, ev)
        if dev.remapped_rows is not None:
            rows = dev.remapped_rows
            if rows.get("failure"):
                yield fatal("gpu", "row_remap", key, f"{key}: row remapping failed (uncorrectable memory)", **ev, **rows)
            elif rows.get("pending") or dev.retired_pages_pending:
                yield Observation("gpu", "row_remap", key, "degraded", "high", False,
                                  f"{key}: row remap / page retirement pending, GPU reset needed", {**ev, **rows}, immediate=True)
            else:
                yield healthy("gpu", "row_remap", key, **ev, **rows)
        if dev.temperature_c is not None:
            if dev.temperature_c >= self.policy.gpu_temp_degraded_c:
                yield Observation("gpu", "temperature", key, "degraded", "low", False,
                                  f"{key} at {dev.temperature_c:g} °C (limit {self.policy.gpu_temp_degraded_c:g} °C)",
                                  {**ev, "temperature_c": dev.temperature_c})
            else:
                yield healthy("gpu", "temperature", key, **ev, temperature_c=dev.temperature_c)
        if dev.throttle_reasons is not None:
            bad = [name for bit, name in THROTTLE_BITS.items() if dev.throttle_reasons & bit]
            if bad:
                yield Observation("gpu", "clock_throttle", key, "degraded", "low", False,
                                  f"{key} clocks throttled: {', '.join(bad)}",
                                  {**ev, "throttle_reasons": dev.throttle_reasons, "reasons": bad})
            else:
                yield healthy("gpu", "clock_throttle", key, **ev, throttle_reasons=dev.throttle_reasons)

    def _xids(self, dev: GpuDevice, key: str, ev: dict[str, Any]) -> Iterable[Observation]:
        new = [x for x in dev.xids if (dev.index, x.seq) not in self._seen_xids]
        self._seen_xids.update((dev.index, x.seq) for x in new)
        fatal_xids = [x for x in new if classify_xid(x.xid, self.policy) == "fatal"]
        unknown = [x for x in new if classify_xid(x.xid, self.policy) == "unknown"]
        ignored = [x for x in new if classify_xid(x.xid, self.policy) == "ignored"]
        if fatal_xids:
            x = fatal_xids[-1]
            yield fatal("gpu", "xid", key, f"{key}: XID {x.xid} ({xid_name(x.xid)})", event=True,
                        **ev, xid=x.xid, xid_name=xid_name(x.xid), xids=[y.xid for y in new], seq=x.seq)
        elif unknown:
            x = unknown[-1]
            yield Observation("gpu", "xid", key, "degraded", "low", False,
                              f"{key}: XID {x.xid} ({xid_name(x.xid)}), not classified as fatal",
                              {**ev, "xid": x.xid, "xids": [y.xid for y in unknown]}, new_events=len(unknown))
        else:
            detail = ""
            if ignored:
                detail = "ignored (application errors, not a node fault): " + ", ".join(f"XID {x.xid}" for x in ignored)
            yield Observation("gpu", "xid", key, "healthy", "high", False, detail,
                              {**ev, "ignored_xids": [x.xid for x in ignored]} if ignored else dict(ev), new_events=0)

    def _ecc(self, dev: GpuDevice, key: str, ev: dict[str, Any]) -> Iterable[Observation]:
        ecc = dev.ecc or {}
        dbe = int(ecc.get("volatile_dbe", 0))
        if dbe > 0:
            yield fatal("gpu", "ecc_dbe", key, f"{key}: {dbe} uncorrectable (double-bit) ECC errors since boot", **ev, volatile_dbe=dbe)
        else:
            yield healthy("gpu", "ecc_dbe", key, **ev, volatile_dbe=0)
        sbe = int(ecc.get("volatile_sbe", 0))
        previous = self._last_sbe.get(dev.index, sbe)
        self._last_sbe[dev.index] = sbe
        delta = sbe - previous
        if delta >= self.policy.gpu_sbe_delta_degraded:
            yield Observation("gpu", "ecc_sbe_rate", key, "degraded", "low", False,
                              f"{key}: {delta} new correctable ECC errors since the last sample",
                              {**ev, "sbe_delta": delta, "volatile_sbe": sbe}, new_events=1)
        else:
            yield Observation("gpu", "ecc_sbe_rate", key, "healthy", "high", False, "", {**ev, "volatile_sbe": sbe}, new_events=0)
