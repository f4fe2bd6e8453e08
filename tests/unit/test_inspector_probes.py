"""Each node probe on recorded fixtures in real shapes (tests/fixtures/inspector), including bad input."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from keel.agent.inspector import (
    DiskSpaceProbe,
    FileKmsgReader,
    GpuProbe,
    InspectorCore,
    InspectorPolicy,
    KernelLogProbe,
    LoadProbe,
    NicProbe,
    Observation,
    OomProbe,
    OverlayNvmlSource,
    PressureProbe,
    PynvmlSource,
    default_probes,
    parse_kmsg_line,
)
from keel.agent.inspector.gpu import NvmlSnapshot

FIXTURES = Path(__file__).parents[1] / "fixtures" / "inspector"
T0 = datetime(2026, 11, 29, 7, 0, tzinfo=UTC)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    node = tmp_path / "node"
    shutil.copytree(FIXTURES / "node", node)
    return node


def by_check(observations: list[Observation]) -> dict[tuple[str, str], Observation]:
    return {(o.check, o.key): o for o in observations}


def probe_health(observations: list[Observation]) -> Observation:
    [probe] = [o for o in observations if o.check == "probe"]
    return probe


# -- GPU ------------------------------------------------------------------------------------------

def write_nvml(root: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = root / "run/keel/nvml.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_gpu_healthy_snapshot(root: Path) -> None:
    obs = GpuProbe(OverlayNvmlSource(root)).collect()
    assert all(o.status == "healthy" for o in obs), [o for o in obs if o.status != "healthy"]
    checks = by_check(obs)
    assert {"gpu_lost", "xid", "ecc_dbe", "ecc_sbe_rate", "row_remap", "temperature", "clock_throttle"} <= {c for c, _ in checks}
    assert checks[("temperature", "gpu1")].evidence["temperature_c"] == 44
    assert probe_health(obs).status == "healthy"


def test_snapshot_round_trips_through_json(root: Path) -> None:
    snap = OverlayNvmlSource(root).read()
    assert NvmlSnapshot.from_json(json.loads(json.dumps(snap.to_json()))) == snap


def test_fatal_xid_reported_once_and_app_xids_ignored(root: Path) -> None:
    probe = GpuProbe(OverlayNvmlSource(root))
    probe.collect()
    write_nvml(root, lambda d: d["devices"][1].update(xids=[{"seq": 1, "xid": 13}, {"seq": 2, "xid": 79}]))
    xid = by_check(probe.collect())[("xid", "gpu1")]
    assert (xid.status, xid.confidence, xid.is_fatal) == ("failed", "high", True)
    assert xid.evidence["xid"] == 79 and "fallen off the bus" in xid.detail
    again = by_check(probe.collect())[("xid", "gpu1")]
    assert again.status == "healthy"  # the same (gpu, seq) is not reported twice

    write_nvml(root, lambda d: d["devices"][0].update(xids=[{"seq": 7, "xid": 31}, {"seq": 8, "xid": 43}]))
    app = by_check(probe.collect())[("xid", "gpu0")]
    assert app.status == "healthy" and app.evidence["ignored_xids"] == [31, 43] and "ignored" in app.detail


def test_xid_ignore_list_is_configurable(root: Path) -> None:
    probe = GpuProbe(OverlayNvmlSource(root), InspectorPolicy(xid_ignore=frozenset({74})))
    write_nvml(root, lambda d: d["devices"][0].update(xids=[{"seq": 1, "xid": 74}]))
    assert by_check(probe.collect())[("xid", "gpu0")].status == "healthy"


def test_unlisted_xid_is_a_soft_signal(root: Path) -> None:
    write_nvml(root, lambda d: d["devices"][0].update(xids=[{"seq": 1, "xid": 57}]))
    xid = by_check(GpuProbe(OverlayNvmlSource(root)).collect())[("xid", "gpu0")]
    assert (xid.status, xid.confidence, xid.is_fatal, xid.new_events) == ("degraded", "low", False, 1)


def test_gpu_lost_by_flag_and_by_count_drop(root: Path) -> None:
    probe = GpuProbe(OverlayNvmlSource(root))
    probe.collect()
    write_nvml(root, lambda d: d["devices"][1].update(lost=True, error="GPU is lost"))
    lost = by_check(probe.collect())[("gpu_lost", "gpu1")]
    assert lost.is_fatal_hardware and "lost" in lost.detail

    def drop(d: dict) -> None:
        d["device_count"] = 1
        d["devices"] = d["devices"][:1]

    write_nvml(root, drop)
    gone = by_check(probe.collect())[("gpu_lost", "gpu1")]
    assert gone.is_fatal_hardware and gone.evidence["device_count"] == 1 and gone.evidence["expected"] == 2


def test_ecc_remap_temperature_throttle(root: Path) -> None:
    probe = GpuProbe(OverlayNvmlSource(root))
    probe.collect()

    def faults(d: dict) -> None:
        d["devices"][0]["ecc"].update(volatile_dbe=2)
        d["devices"][0]["remapped_rows"].update(uncorrectable=1, pending=True)
        d["devices"][1]["ecc"].update(volatile_sbe=250)
        d["devices"][1]["remapped_rows"].update(failure=True)
        d["devices"][1].update(temperature_c=91, throttle_reasons=0x40 | 0x4)

    write_nvml(root, faults)
    c = by_check(probe.collect())
    assert c[("ecc_dbe", "gpu0")].is_fatal_hardware
    assert (c[("row_remap", "gpu0")].status, c[("row_remap", "gpu0")].immediate) == ("degraded", True)
    assert c[("row_remap", "gpu1")].is_fatal_hardware
    assert c[("ecc_sbe_rate", "gpu1")].status == "degraded" and c[("ecc_sbe_rate", "gpu1")].evidence["sbe_delta"] == 250
    assert c[("temperature", "gpu1")].status == "degraded"
    assert c[("clock_throttle", "gpu1")].evidence["reasons"] == ["hw_thermal_slowdown"]  # sw_power_cap is normal
    assert c[("clock_throttle", "gpu0")].status == "healthy"


def test_malformed_nvml_json_is_a_probe_failure_not_healthy(root: Path) -> None:
    path = root / "run/keel/nvml.json"
    for text in ("{not json", json.dumps({"devices": [{"uuid": "no index"}]}),
                 json.dumps({"devices": [{"index": 0, "temperature_c": "hot"}]}), json.dumps([1, 2])):
        path.write_text(text)
        [obs] = GpuProbe(OverlayNvmlSource(root)).collect()
        assert (obs.check, obs.status) == ("probe", "degraded") and "malformed" in obs.detail


def test_no_overlay_file_means_no_gpu_reported_once(root: Path) -> None:
    (root / "run/keel/nvml.json").unlink()
    probe = GpuProbe(OverlayNvmlSource(root))
    [info] = probe.collect()
    assert info.informational and info.status == "healthy" and "no GPU" in info.detail
    assert probe.collect() == []


def test_real_nvml_without_gpu_is_informational_once() -> None:
    pytest.importorskip("pynvml")
    probe = GpuProbe(PynvmlSource())
    first = probe.collect()
    if first and first[0].check != "nvml":
        pytest.skip("this machine has a GPU")
    [info] = first
    assert info.informational and not info.is_fatal and "no GPU" in info.detail
    assert probe.collect() == []
    state, events = InspectorCore("n1").step(InspectorCore("n1").initial_state(), first, T0)
    assert [(e.status, e.component, e.check) for e in events] == [("healthy", "gpu", "nvml")]


# -- kernel log -----------------------------------------------------------------------------------

def test_parse_kmsg_records() -> None:
    r = parse_kmsg_line("4,1453,3812345678,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=2211, name=python, GPU has fallen off the bus.")
    assert r is not None and (r.priority, r.level, r.seq, r.usec, r.flags) == (4, 4, 1453, 3812345678, "-")
    assert r.message.startswith("NVRM: Xid")
    caller = parse_kmsg_line("4,1470,3814000000,-,caller=T812;hello")
    assert caller is not None and caller.seq == 1470 and caller.message == "hello"
    assert parse_kmsg_line(" SUBSYSTEM=pci") is None
    with pytest.raises(ValueError):
        parse_kmsg_line("this is not a kmsg record")


def test_kernel_log_classifies_recorded_lines(root: Path) -> None:
    kmsg = root / "dev/kmsg"
    probe = KernelLogProbe(FileKmsgReader(kmsg))
    assert [o.check for o in probe.collect()] == ["probe"]
    kmsg.write_text((FIXTURES / "kmsg_faults.txt").read_text())
    obs = probe.collect()
    c = by_check(obs)
    fallen = c[("xid_kmsg", "pci:0000:3b:00")]
    assert fallen.is_fatal_hardware and fallen.evidence["xid"] == 79 and fallen.evidence["seq"] == 1453
    dbe = c[("xid_kmsg", "pci:0000:18:00")]
    assert dbe.is_fatal_hardware and dbe.evidence["xid"] == 48
    app = c[("xid_kmsg", "pci:0000:86:00")]
    assert app.status == "healthy" and app.evidence["records"] == 0  # XIDs 13 and 31: the application's fault
    assert c[("hung_task", "node")].status == "degraded" and c[("hung_task", "node")].evidence["task"] == "python"
    assert c[("machine_check", "node")].is_fatal_hardware
    assert c[("machine_check_corrected", "node")].status == "degraded"
    io = c[("io_error", "nvme1n1")]
    assert io.is_fatal_hardware and io.component == "disk"
    assert ("io_error", "nvme1n1p1") in c and ("io_error", "sr0") not in c  # optical drive noise ignored
    oom = c[("oom_killer", "kmsg")]
    assert oom.evidence["pid"] == 12345 and oom.evidence["process"] == "python"
    garbled = probe_health(obs)
    assert garbled.status == "degraded" and "not a kmsg record" in garbled.detail
    assert probe.last_seq == 5002

    # nothing new: every signal seen so far gets a clear sample (so it can recover), nothing is re-reported
    quiet = probe.collect()
    assert all(o.status == "healthy" for o in quiet) and ("xid_kmsg", "pci:0000:3b:00") in by_check(quiet)


def test_kernel_log_reads_only_new_records_and_waits_for_a_full_line(root: Path) -> None:
    kmsg = root / "dev/kmsg"
    probe = KernelLogProbe(FileKmsgReader(kmsg))
    kmsg.write_text("3,10,100,-;Out of memory: Killed process 1 (a) total-vm:1kB\n3,11,101,-;Out of mem")
    assert by_check(probe.collect())[("oom_killer", "kmsg")].new_events == 1
    with kmsg.open("a") as fh:
        fh.write("ory: Killed process 2 (b) total-vm:1kB\n3,11,101,-;Out of memory: Killed process 2 (b) duplicate seq\n")
    oom = by_check(probe.collect())[("oom_killer", "kmsg")]
    assert oom.new_events == 1 and oom.evidence["pid"] == 2
    kmsg.write_text("3,1,5,-;Out of memory: Killed process 9 (c) total-vm:1kB\n")  # truncated: a new log
    assert by_check(probe.collect())[("oom_killer", "kmsg")].evidence["pid"] == 9


def test_kernel_fatal_xid_through_the_core(root: Path) -> None:
    kmsg = root / "dev/kmsg"
    probe = KernelLogProbe(FileKmsgReader(kmsg))
    core = InspectorCore("n1")
    state, _ = core.step(core.initial_state(), probe.collect(), T0)
    kmsg.write_text("4,1453,3812345678,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=2211, name=python, GPU has fallen off the bus.\n")
    state, events = core.step(state, probe.collect(), T0 + timedelta(seconds=1))
    [event] = events
    assert (event.status, event.component, event.check, event.is_fatal, event.confidence) == ("failed", "gpu", "xid_kmsg", True, "high")


# -- host -----------------------------------------------------------------------------------------

def test_psi_calm_and_thrashing(root: Path) -> None:
    obs = PressureProbe(root).collect()
    assert all(o.status == "healthy" for o in obs)
    assert by_check(obs)[("cpu_pressure", "cpu")].evidence["avg10"] == 12.40
    shutil.copy(FIXTURES / "psi/memory_thrashing", root / "proc/pressure/memory")
    mem = by_check(PressureProbe(root).collect())[("memory_pressure", "memory")]
    assert mem.status == "degraded" and mem.evidence["avg10"] == 63.05 and "full avg10=63.05%" in mem.detail


def test_psi_malformed_and_missing(root: Path) -> None:
    shutil.copy(FIXTURES / "psi/memory_malformed", root / "proc/pressure/memory")
    obs = PressureProbe(root).collect()
    assert ("memory_pressure", "memory") not in by_check(obs)
    assert probe_health(obs).status == "degraded" and "memory" in probe_health(obs).detail
    shutil.rmtree(root / "proc/pressure")
    probe = PressureProbe(root)
    [info] = probe.collect()
    assert info.informational and probe.collect() == []


def test_oom_kill_counter_delta(root: Path) -> None:
    probe = OomProbe(root)
    assert by_check(probe.collect())[("oom_kill", "vmstat")].status == "healthy"  # baseline: 2 kills before we started
    vmstat = root / "proc/vmstat"
    vmstat.write_text(vmstat.read_text().replace("oom_kill 2", "oom_kill 3"))
    oom = by_check(probe.collect())[("oom_kill", "vmstat")]
    assert (oom.status, oom.new_events, oom.evidence["new_kills"]) == ("degraded", 1, 1)
    assert by_check(probe.collect())[("oom_kill", "vmstat")].status == "healthy"
    vmstat.write_text("oom_kill lots\n")
    assert probe_health(probe.collect()).status == "degraded"


def test_cpu_overload(root: Path) -> None:
    assert by_check(LoadProbe(root, cpu_count=16).collect())[("cpu_overload", "node")].status == "healthy"
    over = by_check(LoadProbe(root, cpu_count=4).collect())[("cpu_overload", "node")]
    assert over.status == "degraded" and over.evidence["load_per_cpu"] == pytest.approx(4.653, abs=1e-3)
    (root / "proc/loadavg").write_text("")
    assert probe_health(LoadProbe(root, cpu_count=4).collect()).status == "degraded"


def test_disk_full_via_overlay_and_statvfs(root: Path) -> None:
    policy = InspectorPolicy(disk_paths=("/", "/data"))
    (root / "data").mkdir()
    obs = DiskSpaceProbe(root, policy).collect()
    assert by_check(obs)[("disk_full", "/data")].evidence["source"] == "statvfs"
    (root / "run/keel/disk.json").write_text(json.dumps({"/data": {"free_bytes": 0, "total_bytes": 10 * 1024**4}}))
    full = by_check(DiskSpaceProbe(root, policy).collect())[("disk_full", "/data")]
    assert full.is_fatal_hardware and full.component == "disk" and full.evidence["free_bytes"] == 0
    (root / "run/keel/disk.json").write_text(json.dumps({"/data": {"free_bytes": 2 * 1024**3, "total_bytes": 100 * 1024**3}}))
    low = by_check(DiskSpaceProbe(root, policy).collect())[("disk_full", "/data")]
    assert low.status == "degraded" and not low.is_fatal
    (root / "run/keel/disk.json").write_text('{"/data": {"free": "lots"}}')
    assert probe_health(DiskSpaceProbe(root, policy).collect()).status == "degraded"
    missing = DiskSpaceProbe(root, InspectorPolicy(disk_paths=("/nope",))).collect()
    assert "statvfs" in probe_health(missing).detail


# -- NICs -----------------------------------------------------------------------------------------

def test_nic_tree_watches_up_links_and_skips_virtual(root: Path) -> None:
    probe = NicProbe(root)
    obs = probe.collect()
    c = by_check(obs)
    assert c[("link_down", "eth0")].status == "healthy" and c[("link_down", "ib0")].status == "healthy"
    assert c[("link_down", "mlx5_0/1")].evidence["state"] == "4: ACTIVE"
    assert not any(o.key in ("lo", "veth3f2a1c") for o in obs)
    assert c[("link", "eth1")].informational  # down at first sight: no cable, not watched
    assert probe_health(obs).status == "healthy"


def test_nic_down_becomes_fatal_when_it_persists(root: Path) -> None:
    probe, core = NicProbe(root), InspectorCore("n1")
    state, _ = core.step(core.initial_state(), probe.collect(), T0)
    eth0 = root / "sys/class/net/eth0"
    (eth0 / "operstate").write_text("down\n")
    (eth0 / "carrier").write_text("0\n")
    (eth0 / "carrier_changes").write_text("5\n")
    emitted = []
    for t in range(1, 35):
        state, events = core.step(state, probe.collect(), T0 + timedelta(seconds=t))
        emitted += [(t, e.check, e.status, e.is_fatal) for e in events]
    assert emitted == [(1, "link_down", "degraded", False), (31, "link_down", "failed", True)]


def test_link_flaps_tolerated_twice_in_five_minutes(root: Path) -> None:
    probe, core = NicProbe(root), InspectorCore("n1")
    state, _ = core.step(core.initial_state(), probe.collect(), T0)
    counter = root / "sys/class/infiniband/mlx5_0/ports/1/counters/link_downed"
    emitted = []
    for i, t in enumerate((10, 70, 130), start=1):
        counter.write_text(f"{i}\n")
        for dt in (0, 1):
            state, events = core.step(state, probe.collect(), T0 + timedelta(seconds=t + dt))
            emitted += [(t + dt, e.check, e.status) for e in events]
    assert emitted == [(10, "link_flap", "degraded"), (70, "link_flap", "degraded"), (130, "link_flap", "failed")]


def test_ethernet_flap_counts_pairs_of_carrier_changes(root: Path) -> None:
    probe = NicProbe(root)
    probe.collect()
    changes = root / "sys/class/net/eth0/carrier_changes"
    changes.write_text("5\n")  # went down (one change): not yet a flap
    assert by_check(probe.collect())[("link_flap", "eth0")].status == "healthy"
    changes.write_text("6\n")  # and back up: one flap
    flap = by_check(probe.collect())[("link_flap", "eth0")]
    assert (flap.status, flap.new_events) == ("degraded", 1)


def test_unreadable_sysfs_file_is_a_probe_failure(root: Path) -> None:
    probe = NicProbe(root)
    probe.collect()
    operstate = root / "sys/class/net/eth0/operstate"
    operstate.unlink()
    operstate.mkdir()  # reading a directory fails even as root
    (root / "sys/class/infiniband/mlx5_0/ports/1/state").write_text("garbage\n")
    obs = probe.collect()
    assert ("link_down", "eth0") not in by_check(obs) and ("link_down", "mlx5_0/1") not in by_check(obs)
    failed = probe_health(obs)
    assert failed.status == "degraded" and "eth0/operstate" in failed.detail and "unexpected state" in failed.detail


def test_default_probes_on_an_overlay_root(root: Path) -> None:
    probes = default_probes(root)
    obs = [o for p in probes for o in p.collect()]
    bad = [o for o in obs if o.status != "healthy" and o.check != "cpu_overload"]
    assert bad == []
    assert {p.name for p in probes} == {"gpu", "kmsg", "psi", "vmstat", "loadavg", "disk", "nic"}
