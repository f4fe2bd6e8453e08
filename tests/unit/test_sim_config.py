"""keel.sim's inputs: the packaged defaults load, bad YAML fails with where and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.sim.config import ConfigError, load_calibration, load_mix


def test_the_packaged_mix_and_calibration_load_with_their_sources() -> None:
    mix, cal = load_mix(), load_calibration()
    rates = {k.name: k.rate_per_node_day for k in mix.kinds}
    # Llama 3: 419 interruptions / (54 days x 2,048 machines) = 0.003789 per node-day over the cited kinds.
    cited = sum(rates[k] for k in ("gpu_lost", "xid", "user_code", "nic_flap", "host_crash", "sdc"))
    assert abs(cited - 419 / (54 * 2048)) < 0.00002
    assert any("recovery" in s for s in cal.sources) and cal.detection["hang"].mean_s == pytest.approx(5.229)


@pytest.mark.parametrize(("text", "error"), [
    ("kinds: [1, 2]", "kinds must be a mapping"),
    ("kinds: {a: {rate_per_node_day: 0.1, signal: meteor}}", "signal must be one of"),
    ("kinds: {a: {rate_per_node_day: -1, signal: hang}}", "rate_per_node_day must be >= 0"),
    ("kinds: {a: {signal: hang}}", "exactly one of rate_per_node_day, rate_per_job_day"),
    ("kinds: {a: {rate_per_node_day: 0.1, signal: hang, colour: red}}", "unknown field(s) colour"),
    ("kinds: {a: {rate_per_node_day: 0.1, signal: fail_slow, slowdown: 0.5}}", "slowdown must be > 1"),
    ("kinds: {a: {rate_per_node_day: 0.1, signal: hang, correlated: {probability: 2, extra_nodes_max: 1}}}",
     "probability must be <= 1"),
    ("kinds: {}", "kinds is empty"),
    ("kinds: {a: {rate_per_node_day: 'often', signal: hang}}", "must be a number"),
    ("kinds: [unclosed", "not valid YAML"),
    ("kinds: {a: {rate_per_node_day: 0.1, signal: hang}}\nextra: 1", "unknown top-level key(s) extra"),
])
def test_a_bad_mix_is_refused_with_the_key_and_the_reason(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "mix.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as raised:
        load_mix(path)
    assert error in str(raised.value) and str(path) in str(raised.value)


def test_a_calibration_missing_a_figure_or_its_sources_is_refused(tmp_path: Path) -> None:
    good = Path(load_calibration.__code__.co_filename).with_name("calibration.yaml").read_text()
    path = tmp_path / "cal.yaml"
    path.write_text(good.replace("  hang: {mean_s: 5.229, cv: 0.1}\n", ""))
    with pytest.raises(ConfigError, match="detection: missing hang"):
        load_calibration(path)
    path.write_text(good.replace("sources:", "origins:"))
    with pytest.raises(ConfigError, match="sources must list"):
        load_calibration(path)
    path.write_text(good.replace("step_time_s: 10.0", "step_time_s: 0"))
    with pytest.raises(ConfigError, match="step_time_s must be > 0"):
        load_calibration(path)
    with pytest.raises(ConfigError, match="cannot read it"):
        load_calibration(tmp_path / "absent.yaml")
