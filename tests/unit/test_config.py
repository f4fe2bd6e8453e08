from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from keel.events.units import format_duration, parse_duration, parse_size
from keel.infra.config import ConfigError, load_settings


def test_defaults() -> None:
    settings = load_settings(environ={})
    assert settings.bus.max_age == timedelta(days=7)
    assert settings.bus.max_event_bytes == 256 * 1024
    assert settings.nats.sync_always is True
    assert settings.nats_url is None


def test_precedence_defaults_yaml_env_flags(tmp_path: Path) -> None:
    config = tmp_path / "keel.yaml"
    config.write_text("bus:\n  max_age: 3d\n  duplicate_window: 5m\nnats:\n  port: 5000\n")
    env = {"KEEL_BUS__MAX_AGE": "2d", "KEEL_NATS_URL": "nats://env:4222"}
    settings = load_settings(config, environ=env, overrides={"nats": {"port": 6000}, "nats_url": None})
    assert settings.bus.duplicate_window == timedelta(minutes=5)  # YAML over default
    assert settings.bus.max_age == timedelta(days=2)  # env over YAML
    assert settings.nats.port == 6000  # flag over YAML
    assert settings.nats_url == "nats://env:4222"  # an unset flag does not mask the env


def test_config_path_from_environment(tmp_path: Path) -> None:
    config = tmp_path / "k.yaml"
    config.write_text("controller:\n  observe_only: true\n")
    assert load_settings(environ={"KEEL_CONFIG": str(config)}).controller.observe_only is True


@pytest.mark.parametrize(
    "text, message",
    [
        ("bus:\n  max_age: 30\n", "bus.max_age: duration needs a unit"),
        ("bus:\n  max_age: soon\n", "bus.max_age: invalid duration 'soon'"),
        ("bus:\n  max_bytes: 1000\n", "bus.max_bytes: size needs a unit"),
        ("bus:\n  max_ages: 3d\n", "bus.max_ages: unknown setting"),
        ("nats:\n  port: 70000\n", "nats.port"),
        ("nats:\n  hosts: [bridge]\n", "is not an IP address"),
        ("bus:\n  subject_prefix: 'a.b'\n", "bus.subject_prefix: must be letters"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("bus: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_config_file_names_the_file_field_and_reason(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(config, environ={})
    assert message in str(info.value)
    assert str(config) in str(info.value)


def test_bad_environment_value_names_the_environment() -> None:
    with pytest.raises(ConfigError, match="environment: recorder.batch_size"):
        load_settings(environ={"KEEL_RECORDER__BATCH_SIZE": "lots"})


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "absent.yaml", environ={})


@pytest.mark.parametrize("text, seconds", [("250ms", 0.25), ("30s", 30), ("5m", 300), ("24h", 86400), ("7d", 604800), ("1.5s", 1.5)])
def test_durations(text: str, seconds: float) -> None:
    value = parse_duration(text)
    assert value.total_seconds() == seconds
    assert parse_duration(format_duration(value)) == value


def test_sizes() -> None:
    assert parse_size("256KiB") == 262144 and parse_size("8GiB") == 8 * 1024**3
    with pytest.raises(ValueError):
        parse_size("12 parsecs")


def test_checkpoint_section_defaults_env_and_units(tmp_path: Path) -> None:
    defaults = load_settings(environ={}).checkpoint
    assert (defaults.retention, defaults.persist_every_floor, defaults.persist_every_ceiling) == (3, 10, 1000)
    assert defaults.initial_save_cost == timedelta(seconds=5) and defaults.mtbf_prior == timedelta(hours=4)
    assert defaults.restore_plan_timeout == timedelta(seconds=10) and defaults.report_interval == timedelta(seconds=1)
    assert defaults.resolved_persist_root(tmp_path) == tmp_path / "checkpoints"
    settings = load_settings(environ={"KEEL_CHECKPOINT__PERSIST_ROOT": str(tmp_path / "ckpt"),
                                      "KEEL_CHECKPOINT__MTBF_PRIOR": "2h", "KEEL_CHECKPOINT__RETENTION": "5"})
    assert settings.checkpoint.resolved_persist_root(tmp_path) == tmp_path / "ckpt"
    assert settings.checkpoint.mtbf_prior == timedelta(hours=2) and settings.checkpoint.retention == 5
    with pytest.raises(ConfigError, match="checkpoint.initial_save_cost: invalid duration '5'"):
        load_settings(environ={"KEEL_CHECKPOINT__INITIAL_SAVE_COST": "5"})
    with pytest.raises(ConfigError, match="must not exceed persist_every_ceiling"):
        load_settings(environ={"KEEL_CHECKPOINT__PERSIST_EVERY_FLOOR": "2000"})


def test_analyzer_settings_reach_the_metric_checks_and_bad_ones_are_refused() -> None:
    settings = load_settings(environ={"KEEL_ANALYZER__METRIC_SPIKE_FACTOR": "8", "KEEL_ANALYZER__FAILSLOW_INTERVAL": "4s"})
    metric = settings.analyzer.metric_settings()
    assert metric.spike_factor == 8.0 and metric.spike_window == 20 and metric.decline_fraction == 0.8
    assert settings.analyzer.failslow_interval == timedelta(seconds=4)
    with pytest.raises(ConfigError, match="metric_spike_factor"):
        load_settings(environ={"KEEL_ANALYZER__METRIC_SPIKE_FACTOR": "1"})
    with pytest.raises(ConfigError, match="failslow_min_flags"):
        load_settings(environ={"KEEL_ANALYZER__FAILSLOW_MIN_FLAGS": "6"})


def test_nested_sections_and_lists_from_the_environment() -> None:
    settings = load_settings(environ={
        "KEEL_ACTUATOR__KIND": "slurm", "KEEL_ACTUATOR__SLURM__CONF": "/etc/slurm/slurm.conf",
        "KEEL_ACTUATOR__SLURM__WORKERS": "4", "KEEL_ACTUATOR__SLURM__COMMAND_TIMEOUT": "1m",
        "KEEL_ACTUATOR__SLURM__STANDBY_COMMAND": '["srun", "keel", "run", "--keel-standby", "train.py"]'})
    slurm = settings.actuator.slurm
    assert settings.actuator.kind == "slurm" and str(slurm.conf) == "/etc/slurm/slurm.conf" and slurm.workers == 4
    assert slurm.standby_command == ["srun", "keel", "run", "--keel-standby", "train.py"]
    assert slurm.command_timeout.total_seconds() == 60
    # Text in list syntax given to a text setting stays text (only list settings read JSON lists).
    assert load_settings(environ={"KEEL_CHECKPOINT__STORE_ADDRESS": "[::1]:0"}).checkpoint.store_address == "[::1]:0"
    assert load_settings(environ={"KEEL_ACTUATOR__SLURM__PARTITION": '["gpu"]'}).actuator.slurm.partition == '["gpu"]'


@pytest.mark.parametrize("environ, message", [
    ({"KEEL_ACTUATOR__KIND": "kubernetes-someday"}, "unknown actuator kind"),
    ({"KEEL_ACTUATOR__SLURM__WORKERS": "0"}, "actuator.slurm.workers"),
    ({"KEEL_ACTUATOR__SLURM__STANDBY_COMMAND": "srun keel run"}, "JSON list"),
    ({"KEEL_ACTUATOR__SLURM__STANDBY_COMMAND": '{"a": 1}'}, "actuator.slurm.standby_command"),
    ({"KEEL_ACTUATOR__KIND__DEEPER": "x"}, "actuator.kind"),
])
def test_bad_nested_environment_values_name_the_setting(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(environ=environ)
