"""The supervisor's restart policy (``keel.infra.supervision``): back-off, reset after health, crash loops."""

from __future__ import annotations

from datetime import timedelta

import pytest

from keel.infra.config import ConfigError, load_settings
from keel.infra.supervision import ExitStatus, RestartPolicy, ServiceHistory, on_exit
from keel.infra.supervisor import policy_from_settings

POLICY = RestartPolicy(backoff_initial=timedelta(seconds=1), backoff_max=timedelta(seconds=8),
                       healthy_after=timedelta(seconds=60), crash_loop_restarts=5, crash_loop_window=timedelta(minutes=5))


def test_backoff_doubles_up_to_the_cap_then_a_crash_loop_is_given_up() -> None:
    history, now, backoffs = ServiceHistory(), 0.0, []
    for _ in range(5):
        decision = on_exit(POLICY, history, "controller", ExitStatus(1), uptime_s=0.5, now_s=now)
        assert decision.restart, decision.reason
        backoffs.append(decision.backoff_s)
        history, now = decision.history, now + decision.backoff_s + 0.5
    assert backoffs == [1, 2, 4, 8, 8]
    assert history.attempt == 5
    final = on_exit(POLICY, history, "controller", ExitStatus(1), uptime_s=0.5, now_s=now)
    assert not final.restart
    assert "crash loop" in final.reason and "exited with status 1" in final.reason and "keel up" in final.reason
    assert final.restarts_in_window == 5


def test_a_healthy_run_resets_the_backoff_and_old_restarts_leave_the_window() -> None:
    history = ServiceHistory()
    for now in (0.0, 2.0, 5.0):
        history = on_exit(POLICY, history, "recorder", ExitStatus(-9), uptime_s=1, now_s=now).history
    assert history.attempt == 3
    healthy = on_exit(POLICY, history, "recorder", ExitStatus(-9), uptime_s=120, now_s=125.0)
    assert healthy.restart and healthy.attempt == 1 and healthy.backoff_s == 1
    assert "SIGKILL" in healthy.reason and "back-off reset" in healthy.reason
    # Ten minutes later the earlier restarts are outside the 5-minute window: not a crash loop.
    history = healthy.history
    for now in (700.0, 701.0, 703.0, 707.0):
        decision = on_exit(POLICY, history, "recorder", ExitStatus(1), uptime_s=0.1, now_s=now)
        assert decision.restart
        history = decision.history
    assert len(history.restarts_at) == 4


def test_exit_status_says_code_signal_or_unknown() -> None:
    assert (ExitStatus(3).exit_code, ExitStatus(3).signal) == (3, None)
    assert (ExitStatus(-9).exit_code, ExitStatus(-9).signal) == (None, "SIGKILL")
    assert (ExitStatus(None).exit_code, ExitStatus(None).signal) == (None, None)
    assert "unknown" in ExitStatus(None).describe()


def test_settings_carry_units_and_bad_ones_fail_with_the_field() -> None:
    settings = load_settings(environ={"KEEL_SUPERVISOR__RESTART_BACKOFF_MAX": "2m",
                                      "KEEL_SUPERVISOR__CRASH_LOOP_WINDOW": "10m"})
    policy = policy_from_settings(settings.supervisor)
    assert policy.backoff_max == timedelta(minutes=2) and policy.crash_loop_window == timedelta(minutes=10)
    with pytest.raises(ConfigError, match="supervisor"):
        load_settings(environ={"KEEL_SUPERVISOR__RESTART_BACKOFF_MAX": "30"})  # no unit
    with pytest.raises(ConfigError, match="restart_backoff_max"):
        load_settings(environ={"KEEL_SUPERVISOR__RESTART_BACKOFF_INITIAL": "1m",
                               "KEEL_SUPERVISOR__RESTART_BACKOFF_MAX": "10s"})
    with pytest.raises(ValueError):
        RestartPolicy(crash_loop_restarts=0)
