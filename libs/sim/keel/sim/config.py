"""The simulator's inputs, read from YAML and checked: the failure mix and the calibration (pure).

A bad file fails with ``ConfigError`` naming the file, the key and what was wrong: never a ``KeyError``
from deep inside the simulation. No pickle: YAML (``yaml.safe_load``) only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

SIGNALS = frozenset({"gpu_lost", "xid", "host_lost", "nic_flap", "hang", "user_code", "sdc", "fail_slow",
                     "bad_deploy"})
"""How a failure shows itself, and so which agent events the simulator emits for it."""


class ConfigError(ValueError):
    """A failure mix or calibration file the simulator cannot use, with where and why."""


@dataclass(frozen=True)
class Dist:
    """A duration: lognormal with mean ``mean_s`` and coefficient of variation ``cv`` (0: always the mean)."""

    mean_s: float
    cv: float = 0.0

    def draw(self, rng: Any) -> float:
        if self.cv <= 0 or self.mean_s <= 0:
            return self.mean_s
        sigma2 = math.log1p(self.cv * self.cv)
        return float(rng.lognormvariate(math.log(self.mean_s) - sigma2 / 2, math.sqrt(sigma2)))


@dataclass(frozen=True)
class Correlation:
    probability: float
    extra_nodes_max: int


@dataclass(frozen=True)
class FailureKind:
    name: str
    signal: str
    rate_per_node_day: float = 0.0
    rate_per_job_day: float = 0.0
    repair_h: float = 0.0
    slowdown: float = 1.0
    duration_h: float = 0.0
    correlated: Correlation | None = None


@dataclass(frozen=True)
class FailureMix:
    kinds: tuple[FailureKind, ...]
    fault_domain_nodes: int = 16
    code_changes_per_job_day: float = 0.0

    def scaled(self, factor: float) -> FailureMix:
        """Every failure rate times ``factor`` (the sensitivity table); code changes are not failures."""
        kinds = tuple(FailureKind(k.name, k.signal, k.rate_per_node_day * factor, k.rate_per_job_day * factor,
                                  k.repair_h, k.slowdown, k.duration_h, k.correlated) for k in self.kinds)
        return FailureMix(kinds, self.fault_domain_nodes, self.code_changes_per_job_day)


@dataclass(frozen=True)
class Calibration:
    detection: Mapping[str, Dist]
    agent: Mapping[str, Dist]
    actuator: Mapping[str, Dist]
    job: Mapping[str, float]
    baselines: Mapping[str, float]
    sources: tuple[str, ...] = field(default_factory=tuple)


DETECTION_KEYS = ("gpu_lost", "xid", "nic_down", "crash", "hang", "host_lost", "metric_anomaly")
AGENT_KEYS = ("ack", "diagnostics", "stacks_verdict", "restart", "setup_restore_memory", "setup_restore_persistent",
              "sdc_replay", "failslow_conviction")
ACTUATOR_KEYS = ("evict", "standby_provision", "cold_replacement", "human_response")
JOB_KEYS = ("step_time_s", "memory_blocking_per_step_s", "persist_save_s", "keel_persist_interval_s",
            "gpus_per_node", "nodes_per_pp_group")
BASELINE_KEYS = ("hang_timeout_s", "torchelastic_hang_timeout_s", "crash_detection_s", "node_lost_detection_s",
                 "requeue_s", "elastic_restart_s", "conventional_persist_interval_s", "human_detection_s",
                 "human_rollback_s")


def _load(path: Path | None, default: str) -> tuple[str, Any]:
    if path is None:
        text = resources.files("keel.sim").joinpath(default).read_text()
        where = f"keel.sim/{default}"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read it ({exc})") from exc
        where = str(path)
    try:
        return where, yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML ({exc})") from exc


def _mapping(where: str, key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: {key} must be a mapping, got {type(value).__name__}")
    return value


def _number(where: str, key: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{where}: {key} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _dist(where: str, key: str, value: Any) -> Dist:
    spec = _mapping(where, key, value)
    unknown = set(spec) - {"mean_s", "cv"}
    if unknown:
        raise ConfigError(f"{where}: {key}: unknown field(s) {sorted(unknown)}; a duration has mean_s and cv")
    if "mean_s" not in spec:
        raise ConfigError(f"{where}: {key}: mean_s is missing")
    return Dist(_number(where, f"{key}.mean_s", spec["mean_s"]), _number(where, f"{key}.cv", spec.get("cv", 0.0)))


def _section(where: str, doc: Mapping[str, Any], name: str, keys: tuple[str, ...]) -> Mapping[str, Any]:
    section = _mapping(where, name, doc.get(name))
    missing = [k for k in keys if k not in section]
    if missing:
        raise ConfigError(f"{where}: {name}: missing {', '.join(missing)}")
    unknown = sorted(set(section) - set(keys))
    if unknown:
        raise ConfigError(f"{where}: {name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(keys)}")
    return section


def load_calibration(path: Path | None = None) -> Calibration:
    """The calibration file (``None``: the packaged ``calibration.yaml``), checked."""
    where, doc = _load(path, "calibration.yaml")
    doc = _mapping(where, "the document", doc)
    sources = doc.get("sources")
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) for s in sources):
        raise ConfigError(f"{where}: sources must list the benchmark results the figures came from")
    sections = {name: _section(where, doc, name, keys) for name, keys in
                (("detection", DETECTION_KEYS), ("agent", AGENT_KEYS), ("actuator", ACTUATOR_KEYS),
                 ("job", JOB_KEYS), ("baselines", BASELINE_KEYS))}
    dists = {name: {k: _dist(where, f"{name}.{k}", v) for k, v in sections[name].items()}
             for name in ("detection", "agent", "actuator")}
    job = {k: _number(where, f"job.{k}", v) for k, v in sections["job"].items()}
    for key in ("step_time_s", "gpus_per_node", "nodes_per_pp_group", "keel_persist_interval_s"):
        if job[key] <= 0:
            raise ConfigError(f"{where}: job.{key} must be > 0, got {job[key]!r}")
    baselines = {k: _number(where, f"baselines.{k}", v) for k, v in sections["baselines"].items()}
    return Calibration(dists["detection"], dists["agent"], dists["actuator"], job, baselines, tuple(sources))


KIND_FIELDS = frozenset({"rate_per_node_day", "rate_per_job_day", "signal", "repair_h", "slowdown", "duration_h",
                         "correlated"})


def load_mix(path: Path | None = None) -> FailureMix:
    """The failure mix (``None``: the packaged ``failures.yaml``), checked."""
    where, doc = _load(path, "failures.yaml")
    doc = _mapping(where, "the document", doc)
    unknown = sorted(set(doc) - {"kinds", "fault_domain_nodes", "code_changes_per_job_day"})
    if unknown:
        raise ConfigError(f"{where}: unknown top-level key(s) {', '.join(unknown)}")
    kinds = []
    for name, spec in _mapping(where, "kinds", doc.get("kinds")).items():
        spec = _mapping(where, f"kinds.{name}", spec)
        unknown = sorted(set(spec) - KIND_FIELDS)
        if unknown:
            raise ConfigError(f"{where}: kinds.{name}: unknown field(s) {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(KIND_FIELDS))}")
        signal = spec.get("signal")
        if signal not in SIGNALS:
            raise ConfigError(f"{where}: kinds.{name}.signal must be one of {', '.join(sorted(SIGNALS))}, "
                              f"got {signal!r}")
        if ("rate_per_node_day" in spec) == ("rate_per_job_day" in spec):
            raise ConfigError(f"{where}: kinds.{name}: give exactly one of rate_per_node_day, rate_per_job_day")
        correlated = None
        if "correlated" in spec:
            c = _mapping(where, f"kinds.{name}.correlated", spec["correlated"])
            probability = _number(where, f"kinds.{name}.correlated.probability", c.get("probability"))
            if probability > 1:
                raise ConfigError(f"{where}: kinds.{name}.correlated.probability must be <= 1, got {probability}")
            extra = _number(where, f"kinds.{name}.correlated.extra_nodes_max", c.get("extra_nodes_max"), positive=True)
            correlated = Correlation(probability, int(extra))
        slowdown = _number(where, f"kinds.{name}.slowdown", spec.get("slowdown", 1.0), positive=True)
        if signal == "fail_slow" and slowdown <= 1:
            raise ConfigError(f"{where}: kinds.{name}.slowdown must be > 1 for a fail-slow kind, got {slowdown}")
        kinds.append(FailureKind(
            name=str(name), signal=str(signal),
            rate_per_node_day=_number(where, f"kinds.{name}.rate_per_node_day", spec.get("rate_per_node_day", 0.0)),
            rate_per_job_day=_number(where, f"kinds.{name}.rate_per_job_day", spec.get("rate_per_job_day", 0.0)),
            repair_h=_number(where, f"kinds.{name}.repair_h", spec.get("repair_h", 0.0)),
            slowdown=slowdown,
            duration_h=_number(where, f"kinds.{name}.duration_h", spec.get("duration_h", 0.0)),
            correlated=correlated))
    if not kinds:
        raise ConfigError(f"{where}: kinds is empty: no failure to simulate")
    domain = _number(where, "fault_domain_nodes", doc.get("fault_domain_nodes", 16), positive=True)
    changes = _number(where, "code_changes_per_job_day", doc.get("code_changes_per_job_day", 0.0))
    return FailureMix(tuple(kinds), int(domain), changes)
